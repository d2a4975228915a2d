"""End-to-end: bad input stops the driver deploy before any package is touched, with a clear message.

Run through deploys/all.py, as operators do. "Before any package is touched" is proved on the
host itself: the overlay's upper layer (every write to the host's disk since boot) is the same
before and after the refused run, and no apt/dpkg command ran.

The GPUs are SIMULATED (testing/gpusim, a test double): HGX H100 x8 with NVSwitch.
Proprietary modules on Blackwell are refused at validation against the tier's declared GPU
models (no B200 simulator model exists); tests/unit/test_driver_resolution.py covers the
resolver for real B200 hardware.
"""
from __future__ import annotations

import pytest

from testing import testhosts
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

BASE = {"tier": "hgx-cloud", "validate_os_release": "debian-12", "tier_mismatch": "warn"}


@pytest.fixture(scope="module")
def host(hostpool):
    (h,) = hostpool.get("driver-refusals", 1, release="bookworm", gpu="h100x8")
    return h


def _refused(host, tmp_path, data: dict):
    before = host.written_files()
    inv = write_inventory(tmp_path / "inv.py", [host], data={host.name: {**BASE, **data}})
    run = pyinfra(inv, "deploys/all.py")
    assert run.returncode != 0, run.output
    after = host.written_files()
    assert after == before, f"the refused host was changed: {sorted(set(after.items()) ^ set(before.items()))[:10]}"
    assert "Install driver" not in run.output and "apt-get" not in run.output
    return run


def _inventory_line(run, host, key: str) -> str:
    line = next((ln for ln in run.output.splitlines() if f"host {host.name}: key '{key}'" in ln), None)
    assert line, run.output
    return line


# --- refused when the inventory is validated ----------------------------------------------------


def test_unknown_driver_version(host, tmp_path):
    run = _refused(host, tmp_path, {"driver_version": "580.1.2"})
    line = _inventory_line(run, host, "driver_version")
    assert "580.1.2 is not a known R580 release" in line and "allowed: auto, 580.65.06" in line


def test_cuda_too_new_for_the_driver(host, tmp_path):
    run = _refused(host, tmp_path, {"driver_branch": "580", "cuda_version": "13.2"})
    line = _inventory_line(run, host, "cuda_version")
    # 13.2 without an update is the newest update R580's driver supports: none, so its GA's floor is named
    assert "CUDA 13.2 needs driver >= 595.45.04; driver is 580." in line and "allowed:" in line


def test_proprietary_flavour_on_blackwell(host, tmp_path):
    run = _refused(host, tmp_path, {"validate_gpu_models": ["NVIDIA B200"], "driver_flavour": "proprietary"})
    line = _inventory_line(run, host, "driver_flavour")
    assert "NVIDIA B200 must use the open kernel modules" in line and "allowed: open, auto" in line


# --- refused from the host's facts, at planning time ---------------------------------------------


def test_secure_boot_on_without_a_signing_key(host, tmp_path):
    # A test-only mokutil stand-in (not in the simulator): the Secure Boot fact reads
    # `mokutil --sb-state`, and a container has no EFI variables to read instead.
    stand_in = host.root / "usr/local/sbin/mokutil"
    stand_in.write_text("#!/bin/sh\n# gpufleet test stand-in for mokutil (Secure Boot on)\necho 'SecureBoot enabled'\n")
    stand_in.chmod(0o755)
    try:
        run = _refused(host, tmp_path, {"driver_kernel_headers": "skip"})
    finally:
        stand_in.unlink()
    assert (f"[{host.name}] refused (driver_module_signing_key): "
            "Secure Boot is enabled and no module signing key is configured: the nvidia module DKMS builds would "
            "be refused by the kernel. Fix: enroll a MOK (mokutil --import) and set driver_module_signing_key") \
        in run.output


def test_no_kernel_headers_for_the_running_kernel(host, tmp_path):
    release = testhosts.ssh(host, "uname -r").stdout.strip()
    run = _refused(host, tmp_path, {})  # driver_kernel_headers: require (the default)
    assert (f"[{host.name}] refused (driver_kernel_headers): no kernel headers "
            f"for the running kernel {release}: /lib/modules/{release}/build is missing and the package "
            f"sources offer no linux-headers-{release}") in run.output
