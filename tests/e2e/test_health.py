"""End-to-end: tools/health and the validation gate find the failing GPU (issue 29), on a real
test host whose two H200s are SIMULATED (testing/gpusim, a test double: `gpusimctl fault` makes
its nvidia-smi, nvidia-smi nvlink -s, kernel log and pynvml stand-ins print what a real GPU in that
state prints). The host is the one test_foundation provisions with all.py (shared, so no extra boot);
alone, this module gets it fresh, which the health check does not need. Logged in as the sudo
user, as an operator's inventory does.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import REPO, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]


def fault(host, *args: str) -> None:
    r = testhosts.ssh(host, "sudo gpusimctl fault " + " ".join(args), check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def hgx(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    (host,) = hostpool.get("foundation-hgx", 1, release="trixie", gpu=f"h200x2@{TEST_DRIVER}")
    data = {host.name: {**environment_data(host, "hgx", aptrepo), "tier_mismatch": "warn",
                        "tuning_nccl_socket_ifname": "auto"}}
    inv = write_inventory(tmp_path_factory.mktemp("health") / "inventory.py", [host], data=data)
    yield host, inv
    fault(host, "--clear")   # the host is shared: it leaves healthy


def health(inv, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "tools/health"), str(inv), "--quiet", *args], capture_output=True, text=True,
                          timeout=300)


def findings(run: subprocess.CompletedProcess) -> dict[tuple[int, str], str]:
    (host,) = json.loads(run.stdout)["hosts"]
    assert host["status"] == "ok", host
    return {(g["index"], f["check"]): f["class"] for g in host["gpus"] for f in g["findings"]}


def test_healthy_gpus_are_ok_and_exit_zero(hgx):
    host, inv = hgx
    plan = REPO / ".gpufleet/factplans" / f"{host.name}.json"
    before = plan.read_bytes() if plan.exists() else None
    run = health(inv, "--json")
    # one fact read: the host's plan of its last deploy run (the next run's prefetch) is left alone
    assert (plan.read_bytes() if plan.exists() else None) == before
    assert run.returncode == 0, run.stdout + run.stderr
    (host,) = json.loads(run.stdout)["hosts"]
    assert host["worst"] == "ok" and [g["bus_id"] for g in host["gpus"]] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert all(g["findings"] == [] for g in host["gpus"])


@pytest.mark.parametrize("kind, check, cls, act", [
    ("row-remap-pending", "row_remap_pending", "reset", True),
    ("row-remap-failure", "row_remap_failure", "rma", True),
    ("ecc-uncorrected", "ecc_uncorrected_volatile", "reset", True),
    ("hw-slowdown", "hw_slowdown", "drain", True),
    ("pcie-degraded", "pcie_width_degraded", "drain", True),
    ("nvlink-down", "nvlink_down", "drain", True),
    ("xid:79", "xid_79", "reboot", True),
    ("xid:13", "xid_13", "monitor", False),
    # read through NVML (python3 -I and the host's system pynvml: the simulator's stand-in)
    ("recovery:2", "recovery_reboot", "reboot", True),
    ("pcie-replay:7", "pcie_replays", "monitor", False),
])
def test_each_fault_gets_its_class_on_the_right_gpu_and_clear_makes_it_ok(hgx, kind, check, cls, act):
    host, inv = hgx
    fault(host, "--gpu", "1", kind)
    try:
        run = health(inv, "--json")
        assert findings(run) == {(1, check): cls}
        assert run.returncode == (1 if act else 0), run.stderr
    finally:
        fault(host, "--clear")
    assert health(inv).returncode == 0


def test_the_table_names_the_gpu_class_and_fix(hgx):
    host, inv = hgx
    fault(host, "--gpu", "0", "row-remap-failure")
    try:
        run = health(inv)
    finally:
        fault(host, "--clear")
    assert run.returncode == 1
    line = next(line for line in run.stdout.splitlines() if "00000000:00:06.0" in line)
    assert " rma " in line and "open an RMA" in line
    assert f"1 host(s), 1 need action: {host.name}" in run.stdout


def test_the_gate_fails_the_host_naming_the_gpus_bus_id(hgx):
    host, inv = hgx
    fault(host, "--gpu", "1", "xid:79")
    try:
        run = pyinfra(inv, "deploys/validate.py")
    finally:
        fault(host, "--clear")
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if "the GPUs are healthy" in line]
    assert lines and "GPU 1 (00000000:00:07.0): reboot: XID 79" in lines[0], run.output
