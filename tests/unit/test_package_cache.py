"""The fleet's package cache and air-gapped hosts, as data: tests/unit/package_cache/*.json.

Each case is a host's inventory data and one of:
- "problems": the exact lines planning-time validation reports (air-gapped refusals name host and key);
- "plan": what deploys/package_cache.py writes (gpufleet/plans/package_cache.py) and every source
  line gpufleet/plans/repos.py writes, for the OS in "os" [id, codename, CUDA repo folder, uname -m];
- "daemon_json": the `registry-mirrors` Docker's daemon.json gets from an existing file.
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpufleet.catalog.compat import compat_data
from gpufleet.config.settings import _settings_for
from gpufleet.plans import dockerconf
from gpufleet.plans import package_cache as pc
from gpufleet.plans.repos import dpkg_arch, repository_lines

pytestmark = pytest.mark.unit
CASES = sorted((Path(__file__).parent / "package_cache").glob("*.json"))


def _settings(data):
    settings, problems = _settings_for("gpu01", dict(data))
    assert settings is not None, problems
    return settings


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_case(path):
    case = json.loads(path.read_text())
    if "problems" in case:
        _, problems = _settings_for("gpu01", dict(case["data"]))
        assert problems == case["problems"]
    if "plan" in case:
        settings = _settings(case["data"])
        want = case["plan"]
        got = pc.plan(settings)
        assert (got.serve, got.acng_conf, got.apt_conf) == (want["serve"], want["acng_conf"], want["apt_conf"])
        os_id, codename, os_dir, machine = case["os"]
        res = SimpleNamespace(source="nvidia", repo_os_dir=os_dir, os_release=os_dir)
        lines = repository_lines(settings, res, os_id, codename, dpkg_arch(machine), compat_data())
        assert [list(line) for line in lines] == want["sources"]
        # the cache is never a trust anchor: every source keeps its pinned keyring
        assert all("signed-by=" in line for _, line in lines)
    if "daemon_json" in case:
        settings = _settings(case["data"])
        merged = dockerconf.merge(case["daemon_json"]["existing"], dockerconf.DockerDefaults.from_settings(settings))
        assert merged["registry-mirrors"] == case["daemon_json"]["registry-mirrors"]
        assert {k: v for k, v in case["daemon_json"]["existing"].items() if k != "registry-mirrors"}.items() <= merged.items()


@pytest.mark.parametrize("url, want", [
    ("https://developer.download.nvidia.com/compute/cuda/repos", "http://c:3142/HTTPS///developer.download.nvidia.com/compute/cuda/repos"),
    ("https://mirror:8443/x", "http://c:3142/HTTPS///mirror:8443/x"),
    # http: unchanged, apt's proxy setting sends it through the cache
    ("http://127.0.0.1:41234/libnvidia-container", "http://127.0.0.1:41234/libnvidia-container"),
])
def test_via_cache(url, want):
    assert pc.via_cache(url, "http://c:3142") == want
    assert pc.via_cache(url, "none") == url


def test_every_default_url_key_is_checked_offline():
    """A URL key added to tiers.yaml's defaults without a place in the air-gapped check fails here."""
    from gpufleet.catalog.tiers import common_defaults
    from gpufleet.config import offline
    checked = {key for key, _ in offline.downloads({**common_defaults(), "pytorch_runtime": "venv",
                                                    "docker_registry_mirror": "http://r:5000"})}
    urls = {k for k, v in common_defaults().items() if isinstance(v, str) and v.startswith(("http://", "https://"))}
    assert urls <= checked
