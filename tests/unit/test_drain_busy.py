"""The drain's waits (operations/drain.py) end like a refused change when work outlasts them:
exit BUSY_EXIT with a last line that starts with BUSY_MARK, and the rollout's runner tells a busy
host from a failed one by that mark alone, never by an operation's name or a process's name
(which a student chooses). The scripts run here in sh, with stand-ins for nvidia-smi, sinfo and
squeue on PATH (test doubles, printing what a busy node prints)."""
from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import pytest

from gpufleet.apps.rollout.runner import Options, Runner
from gpufleet.operations import drain
from gpufleet.rollout import plan
from gpufleet.rollout.state import RolloutState

pytestmark = pytest.mark.unit

# a student's process named like gpufleet's own wait operation and like a refused change
STUDENT = "Wait for running GPU processes to finish"


def _tools(tmp_path: Path, apps: str, node_state: str = "mixed") -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stubs = {
        "nvidia-smi": f"printf '%s' {apps!r}",
        "sinfo": f"echo {node_state}",
        "squeue": f"echo '4242 student {STUDENT} 1:02'",
    }
    for name, body in stubs.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", script, "wait", *args], env=env, capture_output=True, text=True,
                          timeout=30)


BUSY = f"777, {STUDENT}\n"
CASES = {
    "gpus_idle": (drain._WAIT_IDLE, ("1", "0", "0")),
    "gpus_idle_now": (drain._IDLE_LOOP, ("0", "1")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wait_outlasted_by_gpu_work_ends_busy_with_the_mark_last(tmp_path, name):
    script, args = CASES[name]
    done = _run(script, _tools(tmp_path, BUSY), *args)
    assert done.returncode == drain.BUSY_EXIT, done
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(drain.BUSY_MARK) and "777" in last, done.stderr


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wait_on_idle_gpus_succeeds(tmp_path, name):
    script, args = CASES[name]
    done = _run(script, _tools(tmp_path, ""), *args)
    assert done.returncode == 0 and drain.BUSY_MARK not in done.stderr, done


def test_a_slurm_drain_that_times_out_ends_busy_with_the_mark_after_the_jobs(tmp_path):
    done = _run(drain._WAIT_DRAINED, _tools(tmp_path, ""), "gpu01", "0")
    assert done.returncode == drain.BUSY_EXIT, done
    lines = done.stderr.strip().splitlines()
    assert "4242 student" in lines[0] and lines[-1].startswith(drain.BUSY_MARK + " Slurm node gpu01 is still mixed")


def test_a_drained_slurm_node_is_not_busy(tmp_path):
    done = _run(drain._WAIT_DRAINED, _tools(tmp_path, "", node_state="drained"), "gpu01", "0")
    assert done.returncode == 0 and done.stdout.strip() == "Slurm node gpu01: drained"


def _runner(tmp_path: Path, why: str) -> Runner:
    """A Runner whose drain step fails host `h` with `why` (what pyinfra's run gave back)."""
    r = Runner(Options(inventory="fleet.py", heartbeat=0), out=io.StringIO())
    r.state = RolloutState(tmp_path / "s.json", "580.126.09", "fleet.py")

    class Result:
        ok: list[str] = []
        failed = {"h": why}
        changed: dict[str, int] = {}

    r.run_per_target = lambda names, func: Result()   # type: ignore[method-assign]
    r.locks = type("Locks", (), {"retake": staticmethod(lambda names: {})})()
    return r


def test_the_runner_tells_a_busy_drain_by_the_mark(tmp_path):
    r = _runner(tmp_path, f"operation failed: Wait for the Slurm jobs on the node to finish (DRAINED): "
                          f"{drain.BUSY_MARK} Slurm node h is still mixed after 3600 s")
    r.run_wave(plan.Batch(0, ("h",)), ["h"])
    assert r.state.host("h").status == "busy"


def test_a_drain_failing_otherwise_is_a_failure_whatever_the_names_say(tmp_path):
    # before: the runner matched the operation's name, so any failure of these waits (sinfo
    # missing, a lost connection) was reported as busy and the host given back
    r = _runner(tmp_path, f"operation failed: {STUDENT}: sh: 1: nvidia-smi: Permission denied")
    r.run_wave(plan.Batch(0, ("h",)), ["h"])
    assert r.state.host("h").status == "failed"
