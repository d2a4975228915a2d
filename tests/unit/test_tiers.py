"""tiers.yaml: documented, complete, consistent with the schema, and every tier resolves."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import yaml
from pyinfra.api.inventory import Inventory

from gpufleet.config.schema import KEYS
from gpufleet.config.settings import host_settings
from gpufleet.catalog.tiers import common_defaults, raw_tier, tier_defaults, tier_names

pytestmark = pytest.mark.unit

REQUIRED_TIERS = {"dev", "research", "inference", "render", "hgx", "hgx-cloud"}
MANDATORY = {
    "tier", "driver_source", "driver_branch", "driver_flavour", "cuda_version", "cudnn_version",
    "driver_reboot", "clock_policy", "nccl_profile", "driver_repo_url", "docker_source",
    "docker_default_runtime", "docker_shm_size", "docker_ulimits", "tuning_omp_threads",
    "tuning_pytorch_alloc_conf", "tuning_nccl_debug_vars", "hardening_permit_root_login",
    "hardening_allow_users", "firewall_open_ports", "extra_packages", "tier_mismatch",
}
PREFIXES = ("driver_", "cuda_", "docker_", "packages_", "gpu_", "pytorch_", "tuning_", "storage_", "hardening_", "firewall_", "monitoring_", "health_", "rollout_", "acceptance_", "validate_")
UNPREFIXED = {"tier", "tier_mismatch", "cuda_version", "cudnn_version", "pytorch_version", "clock_policy", "nccl_profile", "extra_packages"}


def _text() -> str:
    return resources.files("gpufleet").joinpath("data/tiers.yaml").read_text()


def test_required_tiers_exist():
    assert REQUIRED_TIERS <= set(tier_names())


def test_every_key_line_has_a_comment():
    in_body = False
    for number, line in enumerate(_text().splitlines(), 1):
        if line.startswith(("defaults:", "tiers:")):
            in_body = True
            continue
        if not in_body or not line.strip() or line.lstrip().startswith("#"):
            continue
        if re.match(r"^  [A-Za-z0-9-]+:\s*$", line):  # a tier name heading
            continue
        assert " # " in line or "  #" in line, f"tiers.yaml line {number} has no comment: {line!r}"


def test_keys_match_schema_and_naming_rules():
    defaults = set(common_defaults())
    assert defaults | {"tier"} == set(KEYS), sorted((defaults | {"tier"}) ^ set(KEYS))
    assert MANDATORY <= set(KEYS)
    for key in KEYS:
        assert not key.startswith("_")
        assert key in UNPREFIXED or key.startswith(PREFIXES), key
    for tier in tier_names():
        assert set(raw_tier(tier)) <= set(KEYS), tier


def test_docker_defaults_match_the_seeds():
    defaults = common_defaults()
    assert defaults["docker_shm_size"] == "1g"
    assert dict(defaults["docker_ulimits"]) == {"memlock": -1, "stack": 67108864}


def test_versions_are_quoted_in_yaml():
    raw = yaml.safe_load(_text())
    for name, values in [("defaults", raw["defaults"]), *raw["tiers"].items()]:
        for key in ("cuda_version", "cudnn_version", "driver_branch"):
            if key in values:
                assert isinstance(values[key], str), f"{name}.{key} must be a quoted string"


@pytest.mark.parametrize("tier", sorted(REQUIRED_TIERS))
def test_each_tier_validates_and_resolves(tier):
    inv = Inventory(([("h1", {"tier": tier})], {}))
    settings = host_settings(inv.get_host("h1"))
    assert settings.tier == tier
    assert settings.plan is not None
    assert settings.plan.driver_version.startswith(settings.plan.driver_branch + ".")


def test_tier_intent():
    hgx = tier_defaults("hgx")
    assert (hgx["driver_branch"], hgx["driver_flavour"], hgx["cuda_version"], hgx["cudnn_version"]) == ("580", "open", "13.0", "9.17.0")
    assert hgx["validate_nvswitch"] == "required" and hgx["validate_rdma"] == "required" and hgx["nccl_profile"] == "ib"
    cloud = tier_defaults("hgx-cloud")
    assert cloud["nccl_profile"] == "tcp" and cloud["validate_rdma"] == "absent"
    assert tier_defaults("dev")["driver_source"] == "distro"
    assert tier_defaults("inference")["driver_reboot"] == "never"
    assert "nvtop" in tier_defaults("dev")["extra_packages"] and "sysstat" in tier_defaults("hgx")["extra_packages"]


def test_hgx_plan_includes_fabric_manager():
    inv = Inventory(([("h1", {"tier": "hgx"})], {}))
    plan = host_settings(inv.get_host("h1")).plan
    assert plan.fabricmanager_needed and plan.fabricmanager_version == plan.driver_version
