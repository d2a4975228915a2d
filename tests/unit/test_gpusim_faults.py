"""The GPU simulator (a test double) learns faults: `gpusimctl fault --gpu N KIND` makes the
simulated nvidia-smi, nvidia-smi nvlink -s and the dmesg stand-in print what a real GPU in that
state prints; the real GpuHealth parser and gpufleet/plans/health.py then find it on the right GPU.
Healthy, the simulated H200 prints the recorded H200's health line field for field."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.facts._common import MARK
from gpufleet.facts.health import HEALTH_FIELDS, GpuHealth
from gpufleet.plans.health import assess
from testing.gpusim.local import LocalSim

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).parents[1] / "fixtures/nvidia/h200-x1/health/query-health-noheader.txt"


def health(sim: LocalSim):
    query = sim.smi(f"--query-gpu={','.join(HEALTH_FIELDS)}", "--format=csv,noheader,nounits")
    links = sim.smi("nvlink", "-s")
    dmesg = sim._run("dmesg", [], None)
    assert query.returncode == links.returncode == dmesg.returncode == 0, query.stdout + query.stderr
    return GpuHealth().process([f"{MARK} begin query", *query.stdout.splitlines(), f"{MARK} rc query 0",
                                f"{MARK} begin nvlink", *links.stdout.splitlines(), f"{MARK} rc nvlink 0",
                                f"{MARK} begin xid", *dmesg.stdout.splitlines(), f"{MARK} kernel-log yes"])


@pytest.fixture
def sim(tmp_path):
    return LocalSim(tmp_path, "h200x2")


def test_healthy_simulated_h200_prints_the_recorded_health_line(tmp_path):
    one = LocalSim(tmp_path, "h200x1")
    recorded = [line for line in RECORDED.read_text().splitlines() if not line.startswith(("$", "[rc="))][0]
    printed = one.smi(f"--query-gpu={','.join(HEALTH_FIELDS)}", "--format=csv,noheader,nounits").stdout.strip()
    volatile = {"power.draw", "temperature.gpu", "temperature.memory"}   # readings that move between samples
    for field, want, got in zip(HEALTH_FIELDS, recorded.split(", "), printed.split(", ")):
        if field not in volatile:
            assert got == want, field
    assert assess(health(one)).worst == "ok"


@pytest.mark.parametrize("kind, check, cls", [
    ("ecc-uncorrected", "ecc_uncorrected_volatile", "reset"),
    ("row-remap-pending", "row_remap_pending", "reset"),
    ("row-remap-failure", "row_remap_failure", "rma"),
    ("hw-slowdown", "hw_slowdown", "drain"),
    ("pcie-degraded", "pcie_width_degraded", "drain"),
    ("nvlink-down", "nvlink_down", "drain"),
    ("xid:79", "xid_79", "reboot"),
    ("xid:13", "xid_13", "monitor"),
])
def test_each_fault_gets_its_class_on_the_right_gpu_and_clear_makes_it_ok(sim, kind, check, cls):
    assert sim.ctl("fault", "--gpu", "1", kind).returncode == 0
    verdict = assess(health(sim))
    assert [(f.check, f.cls) for f in verdict.gpus[1].findings] == [(check, cls)]
    assert verdict.gpus[0].findings == () and verdict.gpus[1].bus_id == "00000000:00:07.0"
    assert sim.ctl("fault", "--clear").returncode == 0
    assert assess(health(sim)).worst == "ok"


def test_an_unknown_fault_is_refused(sim):
    r = sim.ctl("fault", "--gpu", "0", "melted")
    assert r.returncode == 2 and "unknown fault" in r.stderr


def run_fact_command(sim: LocalSim, tmp_path) -> list[str]:
    """The GpuHealth fact's own command, run with the simulator's nvidia-smi and dmesg first on PATH."""
    import os
    import subprocess
    import sys

    from gpufleet.facts.health import HEALTH_SCRIPT

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("nvidia-smi", "dmesg"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls.log\n'
                                    f'exec {sys.executable} {sim.root}/usr/lib/gpusim/{name} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin", GPUSIM_ROOT=str(sim.root))
    return subprocess.run(["sh", "-c", HEALTH_SCRIPT], capture_output=True, text=True, env=env, timeout=60).stdout.splitlines()


def test_the_fact_command_itself_reads_faults_and_asks_nvlink_only_with_two_gpus(sim, tmp_path):
    sim.ctl("fault", "--gpu", "0", "xid:48")
    data = GpuHealth().process(run_fact_command(sim, tmp_path))
    assert [(f.check, f.cls) for f in assess(data).gpus[0].findings] == [("xid_48", "reset")]
    assert len(data.gpus[1].nvlinks) == 18
    one = LocalSim(tmp_path / "one", "h200x1")
    (tmp_path / "calls.log").unlink()
    data = GpuHealth().process(run_fact_command(one, tmp_path))
    assert data.status == "ok" and data.kernel_log and data.gpus[0].nvlinks == ()
    # this machine's python3 has no nvidia-ml-py: the NVML script starts, reads nothing, fails nothing
    assert not data.nvml and data.gpus[0].recovery_action is None
    calls = (tmp_path / "calls.log").read_text()
    assert calls.count("nvidia-smi") == 1 and "nvlink" not in calls   # one call on a one-GPU host


def nvml_lines(sim: LocalSim) -> list[str]:
    """The health fact's NVML script, run against the simulator's pynvml stand-in (installed in the
    host root as the system's nvidia-ml-py), as the fact's section of output."""
    import os
    import subprocess
    import sys

    from gpufleet.facts.health import NVML_SCRIPT

    env = dict(os.environ, GPUSIM_ROOT=str(sim.root), PYTHONPATH=str(sim.root / "usr/lib/python3/dist-packages"))
    run = subprocess.run([sys.executable, "-c", NVML_SCRIPT], capture_output=True, text=True, env=env, timeout=60)
    return [f"{MARK} begin nvml", *run.stdout.splitlines(), f"{MARK} rc nvml {run.returncode}"]


def test_nvml_through_the_stand_in_reads_as_recorded_and_learns_recovery_actions(sim):
    def read():
        query = sim.smi(f"--query-gpu={','.join(HEALTH_FIELDS)}", "--format=csv,noheader,nounits")
        return GpuHealth().process([f"{MARK} begin query", *query.stdout.splitlines(), f"{MARK} rc query 0",
                                    f"{MARK} kernel-log yes", *nvml_lines(sim)])

    healthy = read()
    # as NVML answered on the recorded H200 (nvml-health.txt)
    assert healthy.nvml and [(g.pcie_replays, g.temperature_slowdown, g.thermal_violation_ms, g.recovery_action)
                             for g in healthy.gpus] == [(0, 89, 0, 0)] * 2
    assert assess(healthy).worst == "ok"
    assert sim.ctl("fault", "--gpu", "1", "recovery:2").returncode == 0
    assert sim.ctl("fault", "--gpu", "0", "pcie-replay:12").returncode == 0
    verdict = assess(read())
    assert [[(f.check, f.cls) for f in g.findings] for g in verdict.gpus] == [
        [("pcie_replays", "monitor")], [("recovery_reboot", "reboot")]]
    assert sim.ctl("fault", "--clear").returncode == 0 and assess(read()).worst == "ok"
    assert sim.ctl("fault", "--gpu", "0", "recovery:8").returncode == 2


def test_without_a_loaded_driver_the_stand_in_nvml_does_not_start(tmp_path):
    off = LocalSim(tmp_path, "h200x2:nodriver")
    lines = nvml_lines(off)
    assert lines[-1] != f"{MARK} rc nvml 0"
