"""The end-of-run summary and the fleet report read the same records (gpufleet/controller/run_summary.py),
and nothing reads a deploy's globals or hooks the interpreter's exit from a deploy."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gpufleet.controller.run_summary import RunSummary

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_what_the_run_leaves_is_said_per_host_and_read_back_by_the_report():
    s = RunSummary()
    assert s.report() == "" and s.pending("gpu-a01") == []
    s.driver_pending["gpu-a01"] = ("580.95.05", "580.126.09")
    s.stack_pending["gpu-a01"] = {"cuDNN": ("9.16.0.29", "9.17.0.29")}
    s.stack_by_hand["gpu-b02"] = {"CUDA toolkit": ["cuda-toolkit-13-0 13.0.1 installed by hand"]}
    s.needs_reboot["gpu-c03"] = "loaded 580.95.05 differs; BUSY, PENDING: not rebooted"
    s.docker_pending["gpu-d04"] = (("default-ulimits",), "GPU containers running")
    s.mig_pending["gpu-e05"] = ("gpu_mig: all GPUs: 3g.71gb, 3g.71gb", "GPU 0: 4242, python3")
    s.mig_reboot["gpu-f06"] = "GPU 1: MIG mode Enabled is pending until the GPU is reset, and the reset was refused"
    text = s.report()
    for banner in ("1 host(s) with a DRIVER UPGRADE PENDING", "1 host(s) with a CUDA/cuDNN UPGRADE PENDING",
                   "whose CUDA toolkit or cuDNN was CHANGED BY HAND", "1 host(s) NEED A REBOOT",
                   "have a Docker configuration change PENDING", "1 host(s) with MIG partitions PENDING",
                   "1 host(s) NEED A REBOOT for a MIG mode change"):
        assert banner in text, banner
    assert "580.95.05" in text and "gpu-d04: default-ulimits (GPU containers running)" in text
    assert "gpu-e05: gpu_mig: all GPUs: 3g.71gb, 3g.71gb (GPU work running: GPU 0: 4242, python3)" in text
    assert "gpu-f06: GPU 1: MIG mode Enabled is pending" in text
    pending = s.pending("gpu-a01")
    assert len(pending) == 2 and "580.126.09" in pending[0] and "9.17.0.29" in pending[1]
    assert s.pending("gpu-b02") == ["cuda-toolkit-13-0 13.0.1 installed by hand"]
    for name in ("gpu-a01", "gpu-b02", "gpu-c03", "gpu-d04", "gpu-e05", "gpu-f06"):
        s.forget(name)
    assert s.report() == ""


def test_profiling_pending_is_said_with_the_way_through_the_gate_and_forgotten_per_host():
    s = RunSummary()
    s.profiling_pending["gpu-e05"] = "tuning_profiling: users: the loaded nvidia module has the other setting"
    text = s.report()
    assert "1 host(s) with GPU profiling PENDING" in text and "tools/rollout INVENTORY" in text
    assert "    gpu-e05: tuning_profiling: users: the loaded nvidia module has the other setting" in text
    s.forget("gpu-e05")
    assert s.report() == ""


def test_a_moved_scratch_still_mounted_at_the_old_path_is_said_with_what_to_do():
    s = RunSummary()
    s.scratch_moved["gpu-g07"] = "still mounted at /scratch (now /data)"
    text = s.report()
    assert "1 host(s) whose scratch MOVED (storage_scratch_path) and is STILL MOUNTED at the old path" in text
    assert "unmount it once nothing uses it, or reboot" in text
    assert "    gpu-g07: still mounted at /scratch (now /data)" in text
    s.forget("gpu-g07")
    assert s.report() == ""


def test_nothing_hooks_the_exit_and_nobody_reads_sys_modules_but_pyinfra_private():
    found = []
    for top in ("deploys", "operations", "facts", "gpufleet"):
        for path in (ROOT / top).rglob("*.py"):
            text = path.read_text()
            rel = path.relative_to(ROOT).as_posix()
            if re.search(r"\bsys\.modules\b", text) and rel != "gpufleet/pyinfra_private.py":
                found.append(f"{rel}: sys.modules")
            if re.search(r"\batexit\b", text):  # the run's end is pyinfra's disconnect (run_end.py)
                found.append(f"{rel}: atexit")
    assert found == []


def test_the_summary_reads_the_host_contexts_and_is_said_when_the_runs_last_host_disconnects(capfd):
    """No exit hook: the records live in each host's context, and the run says them as it ends
    (pyinfra's disconnect, which the `pyinfra` command and the rollout's sessions do last)."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all, disconnect_all

    from gpufleet.config.hostcontext import host_context
    from gpufleet.controller.run_summary import outcome, pending

    state = State(Inventory(([("@local", {})], {})), Config())
    connect_all(state)
    host = state.inventory.get_host("@local")
    outcome(host).needs_reboot = "loaded 580.95.05 differs"
    outcome(host).driver_pending = ("580.95.05", "580.126.09")
    assert host_context(host).outcome.needs_reboot == "loaded 580.95.05 differs"
    assert RunSummary.of([host]).needs_reboot == {"@local": "loaded 580.95.05 differs"}
    assert "580.126.09" in pending(host)[0]
    assert "NEED A REBOOT" not in capfd.readouterr().err  # not before the run ends
    disconnect_all(state)
    err = capfd.readouterr().err
    assert err.count("1 host(s) NEED A REBOOT") == 1 and "    @local: loaded 580.95.05 differs" in err
    assert "DRIVER UPGRADE PENDING" in err

    again = State(Inventory(([("@local", {})], {})), Config())  # a second run in the process starts empty
    connect_all(again)
    assert RunSummary.of(again.inventory).report() == ""
    disconnect_all(again)
    assert "gpufleet:" not in capfd.readouterr().err
