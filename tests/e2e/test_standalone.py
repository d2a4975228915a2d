"""End-to-end: every deploy file runs on its own (`pyinfra INV deploys/<area>.py`, through
deploys/standalone.py) on a fresh real test host: the inventory is validated, the host's
hardware checked, that area alone is applied, and a second run changes nothing. The driver
deploy on a host with no NVIDIA GPU refuses it by name and changes nothing."""
from __future__ import annotations

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import pyinfra

pytestmark = pytest.mark.e2e

MARKER = "/root/gf-standalone-marker"
NCCL = "/etc/nccl.conf"
SSHD_DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
MANAGED = "/etc/gpufleet/managed"


def exists(host, path: str) -> bool:
    return testhosts.ssh(host, f"test -e {path}", check=False).returncode == 0


@pytest.fixture(scope="module")
def alone(hostpool, tmp_path_factory):
    (host,) = hostpool.get("standalone", 1, release="bookworm")
    data = {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn"}
    inv = write_inventory(tmp_path_factory.mktemp("standalone") / "inventory.py", [host], data={host.name: data})
    testhosts.ssh(host, f"touch {MARKER} && sleep 1")
    runs = {"preflight": pyinfra(inv, "deploys/preflight.py"), "driver": pyinfra(inv, "deploys/driver.py")}
    runs["driver-newer"] = testhosts.ssh(host, f"find /etc /usr /var/lib/dpkg -newer {MARKER} 2>/dev/null || true").stdout
    for area in ("base", "tuning", "hardening"):
        runs[area] = pyinfra(inv, f"deploys/{area}.py")
        runs[f"{area}-files"] = {path: exists(host, path) for path in (MANAGED, NCCL, SSHD_DROPIN)}
        runs[f"{area}-again"] = pyinfra(inv, f"deploys/{area}.py")
    runs["validate"] = pyinfra(inv, "deploys/validate.py")
    return host, runs


def test_preflight_alone_checks_the_hardware_against_the_tier(alone):
    host, runs = alone
    run = runs["preflight"]
    assert run.returncode == 0 and run.changed == 0, run.output[-3000:]
    assert f"[{host.name}] hardware does not match tier dev" in run.output, run.output[-3000:]


def test_driver_alone_refuses_a_host_without_a_gpu_and_changes_nothing(alone):
    host, runs = alone
    run = runs["driver"]
    assert run.returncode != 0, run.output
    assert (f"[{host.name}] refused (driver): no supported NVIDIA GPU found on the host (no NVIDIA GPU). "
            "Fix: leave this host out of the driver deploy, or give it a GPU gpufleet supports") in run.output, \
        run.output[-3000:]
    assert runs["driver-newer"].strip() == "", runs["driver-newer"]


@pytest.mark.parametrize("area,present", [
    ("base", {MANAGED}),
    ("tuning", {MANAGED, NCCL}),
    ("hardening", {MANAGED, NCCL, SSHD_DROPIN}),
])
def test_area_alone_applies_that_area_and_a_second_run_changes_nothing(alone, area, present):
    _, runs = alone
    first, again = runs[area], runs[f"{area}-again"]
    assert first.returncode == 0 and first.errors == 0, first.output[-5000:]
    assert first.changed > 0, first.output[-5000:]
    # that area's files and those of the areas run before it, nothing of the areas after it
    assert {path for path, there in runs[f"{area}-files"].items() if there} == present
    assert again.returncode == 0 and again.changed == 0, again.output[-5000:]


def test_validate_alone_judges_the_host_and_changes_nothing(alone):
    host, runs = alone
    run = runs["validate"]
    assert run.changed == 0, run.output[-5000:]
    for line in ("[PASS] base: the gpufleet marker matches the tier", "[PASS] tuning:", "[PASS] hardening:"):
        assert f"[{host.name}] {line}" in run.output, run.output[-5000:]
