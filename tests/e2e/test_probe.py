"""End-to-end: the validation gate's probes run for real against the stand-ins, and a kernel
installed after the driver is flagged.

One Debian 12 test host, GPU SIMULATED (testing/gpusim), the driver, CUDA and DCGM from the
stand-in repository (testing/aptrepo.py; its `dcgmi` is a clearly marked test double answering
from the simulated GPUs), real PyTorch (CPU build, testing/torch_cpu.py) for the performance
probe's CPU variant (GPUFLEET_VALIDATE_PROBE_DEVICE=cpu: no CUDA device exists here), and a
real Debian kernel package installed the way unattended upgrades bring one.
"""
from __future__ import annotations

import os
import re
import textwrap

import pytest

from testing import testhosts, torch_cpu
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
DRIVER_ONLY = textwrap.dedent("""\
    from pyinfra import host, state
    from gpufleet.deploys.driver import driver
    from gpufleet.config.failures import host_failed
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    driver()
    """)
DCGM = "[PASS] probe: DCGM's quick diagnostic passes: dcgmi diag -r 1"
PERF = "probe: bf16 matmul, memory and all-reduce bandwidth reach the expected minimums"


def sh(host, cmd: str, timeout: float = 300) -> str:
    return testhosts.ssh(host, cmd, timeout=timeout).stdout


@pytest.fixture(scope="module")
def probed(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    torch_site, why = torch_cpu.site()
    if torch_site is None:
        pytest.fail(f"no PyTorch CPU build for the probe: {why}")
    h = hostpool.get("probe", 1, gpu=f"t4@{TEST_DRIVER}")[0]
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "driver_only.py").write_text(DRIVER_ONLY)
    data = {**environment_data(h, "research", aptrepo), "tier_mismatch": "warn", "driver_dcgm": True}
    inv = write_inventory(tmp / "inventory.py", [h], data={h.name: data})
    installed = pyinfra(inv, str(tmp / "driver_only.py"))
    again = pyinfra(inv, str(tmp / "driver_only.py"))
    # DCGM's host engine (gpufleet installs DCGM; starting nv-hostengine is the operator's)
    sh(h, "systemctl start nvidia-dcgm.service")
    torch_cpu.install(h, torch_site)
    sh(h, "nvidia-smi -pm 1")  # what the tuning deploy does (not run here)
    os.environ["GPUFLEET_VALIDATE_PROBE_DEVICE"] = "cpu"
    try:
        before_kernel = pyinfra(inv, "deploys/validate.py")
        # a kernel arrives later, as unattended upgrades bring one (real Debian package)
        sh(h, "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
              "linux-image-cloud-amd64 >/dev/null 2>&1", timeout=900)
        sh(h, "nvidia-smi -pm 0")  # and persistence goes off: DCGM must say so
        after_kernel = pyinfra(inv, "deploys/validate.py")
    finally:
        del os.environ["GPUFLEET_VALIDATE_PROBE_DEVICE"]
    for label, run in (("install", installed), ("again", again), ("validate", before_kernel),
                       ("validate-after-kernel", after_kernel)):
        (tmp / f"{label}.log").write_text(run.output)
    return {"host": h, "installed": installed, "again": again, "before": before_kernel, "after": after_kernel,
            "inventory": inv}


def test_driver_with_dcgm_installed_twice(probed):
    assert probed["installed"].returncode == 0, probed["installed"].output[-4000:]
    assert changed_operations(probed["again"]) == [], probed["again"].output[-3000:]


def test_dcgm_diag_and_performance_probe_run_end_to_end(probed):
    h, out = probed["host"], probed["before"].output
    assert f"[{h.name}] {DCGM}" in out, out[-4000:]
    line = next((ln for ln in out.splitlines() if f"[{h.name}] [PASS] {PERF}" in ln), "")
    # real measurements of the real probe (CPU variant): numbers, no minimum applies on a CPU
    assert re.search(r"matmul cpu: [0-9.]+ TFLOP/s", line) and re.search(r"memory cpu: [0-9.]+ GB/s", line), out[-4000:]
    assert "skipped: PyTorch not installed" not in out
    assert f"[{h.name}] [SKIP] driver: every installed kernel has the nvidia module: no kernel in /lib/modules" in out


def test_kernel_installed_later_without_module_warns_and_dcgm_fails_on_persistence(probed):
    h, out = probed["host"], probed["after"].output
    release = sh(h, "ls /lib/modules").split()[0]
    assert release.endswith("-cloud-amd64")
    assert (f"[{h.name}] [WARN] driver: every installed kernel has the nvidia module: no nvidia module for {release}: "
            "booting it leaves the GPUs without a driver -> fix: install linux-headers-cloud-amd64") in out, out[-4000:]
    # DCGM's own message and error (DCGM_FR_PERSISTENCE_MODE, severity CONFIG), naming the GPU by its bus id
    assert (f"[{h.name}] [FAIL] probe: DCGM's quick diagnostic passes: GPU 0 (00000000:00:06.0): monitor: DCGM "
            "diagnostic level 1, Deployment software: Persistence mode for GPU 0 is disabled. (CONFIG: a "
            "configuration problem, DCGM error 29)") in out, out[-4000:]
    assert probed["after"].returncode != 0  # a failed check fails the host


def health(inv, *args: str):
    import json
    import subprocess

    from tests.e2e.pyinfra_cli import REPO
    run = subprocess.run([str(REPO / "tools/health"), str(inv), "--quiet", "--json", *args], capture_output=True,
                         text=True, timeout=600)
    (host,) = json.loads(run.stdout)["hosts"]
    return run.returncode, host


@pytest.fixture
def dcgm_host(probed):
    h = probed["host"]
    sh(h, "nvidia-smi -pm 1 && gpusimctl fault --clear")
    inv = probed["inventory"]
    yield h, inv
    sh(h, "gpusimctl fault --clear; gpusimctl remove-process --pid 4242 || true")


def test_burn_in_runs_dcgm_level_3_and_passes_healthy_gpus(dcgm_host):
    _, inv = dcgm_host
    rc, host = health(inv, "--burn-in")
    # --burn-in is the acceptance (docs/acceptance.md): DCGM's level 3 is one of its findings
    (dcgm,) = [f for f in host["findings"] if f["name"] == "GPU health and DCGM diagnostic level 3"]
    assert dcgm["status"] == "pass", host
    assert not [f for f in host["findings"] if f["status"] == "fail"], host


def test_level_2_sees_what_level_1_does_not_and_names_the_gpu(dcgm_host):
    h, inv = dcgm_host
    sh(h, "gpusimctl fault --gpu 0 ecc-uncorrected")
    rc, quick = health(inv, "--diag", "1")
    assert rc == 1 and quick["diagnostic"]["status"] == "pass"   # the ECC reading needs action, DCGM's level 1 passes
    rc, medium = health(inv, "--diag", "2")
    (gpu,) = medium["gpus"]
    dcgm = [f for f in gpu["findings"] if f["check"] == "dcgm_memory"]
    assert rc == 1 and medium["diagnostic"]["status"] == "fail" and gpu["bus_id"] == "00000000:00:06.0"
    assert [f["class"] for f in dcgm] == ["drain"], gpu   # DCGM_FR_VOLATILE_DBE_DETECTED: ISOLATE
    assert "Detected 1 volatile double-bit ECC error(s) in GPU 0." in dcgm[0]["detail"]


def test_a_diagnostic_that_loads_the_gpus_is_not_run_while_gpu_work_runs(dcgm_host):
    h, inv = dcgm_host
    sh(h, "gpusimctl add-process --gpu 0 --pid 4242 --name python3 --used-mib 1024")
    rc, host = health(inv, "--diag", "2")
    assert rc == 1 and host["diagnostic"]["status"] == "busy", host
    assert "4242" in host["diagnostic"]["detail"] and host["worst"] == "ok"
