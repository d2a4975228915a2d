"""tools/rollout and MIG (issue 32): a wave's steps for a host whose only change is its MIG
layout, for a host without MIG, and the answers of the mig step (busy: given back; a refused
GPU reset: reboot-pending), with the pyinfra runs replaced by a recorder (the real runs are in
tests/e2e/test_rollout_slurm.py)."""
from __future__ import annotations

import io
from dataclasses import dataclass, field

import pytest

from gpufleet.apps.rollout.runner import Options, Runner
from gpufleet.rollout import plan
from gpufleet.rollout.state import RolloutState

pytestmark = pytest.mark.unit


@dataclass
class Result:
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    changed: dict[str, int] = field(default_factory=dict)


def runner(tmp_path, survey, answers=None):
    """A Runner whose steps are recorded (step name, hosts) and answered from `answers`:
    {(step, host): (why, outcome)} fails that host's step with that outcome."""
    r = Runner(Options(inventory="fleet.py", heartbeat=0), out=io.StringIO())
    r.state = RolloutState(tmp_path / "s.json", "580.126.09", "fleet.py")
    r.ctx.survey.update(survey)
    r.calls = []
    answers = answers or {}

    def run_per_target(names, func):
        name = getattr(func, "__name__", "")
        step = {"mig_change": "mig", "tune_and_cdi": "tune"}.get(name, name)
        r.calls.append((step, tuple(names)))
        result = Result()
        for n in names:
            if (step, n) in answers:
                why, outcome = answers[(step, n)]
                result.failed[n] = why
                r.ctx.outcomes[n] = outcome
            else:
                result.ok.append(n)
        return result

    r.run_per_target = run_per_target

    def accept(batch, names):   # the acceptance step (its own unit and e2e tests): a step like the others here
        return run_per_target(names, accept)

    r.accept = accept
    r.locks = type("Locks", (), {"retake": staticmethod(lambda names: {})})()
    return r


MIG_ONLY = {"mig_changes": ["GPU 1 NVIDIA H200 (00000000:00:07.0): MIG off -> 3g.71gb + 3g.71gb"], "mig_on": True}
NO_MIG = {"mig_changes": [], "mig_on": False}


def test_a_wave_runs_the_mig_step_only_for_hosts_with_a_layout(tmp_path):
    r = runner(tmp_path, {"mig": MIG_ONLY, "plain": NO_MIG})
    r.run_wave(plan.Batch(0, ("mig", "plain")), ["mig", "plain"])
    steps = [(step, names) for step, names in r.calls]
    assert ("mig", ("mig",)) in steps and not any(step == "mig" and "plain" in names for step, names in steps)
    assert [s for s, _ in steps] == ["drain", "snapshot", "upgrade", "reboot", "mig", "tune", "validate", "accept", "undrain"]
    assert r.state.host("mig").status == r.state.host("plain").status == "done"


def test_gpu_work_at_the_mig_step_makes_the_host_busy_and_gives_it_back(tmp_path):
    r = runner(tmp_path, {"mig": MIG_ONLY},
               {("mig", "mig"): ("busy, pending (MIG partitions not changed where GPU work started after the "
                                 "drain: GPU 1: 4242, python3)", "busy")})
    r.run_wave(plan.Batch(0, ("mig",)), ["mig"])
    rec = r.state.host("mig")
    assert rec.status == "busy" and "GPU 1: 4242, python3" in rec.message
    assert [s for s, _ in r.calls][-3:] == ["reboot", "mig", "undrain"]   # no tune/validate; given back
    assert r.state.unavailable() == []


def test_a_refused_gpu_reset_leaves_the_host_reboot_pending_and_out_of_service(tmp_path):
    r = runner(tmp_path, {"mig": MIG_ONLY},
               {("mig", "mig"): ("MIG mode change pending until a GPU reset, which was refused", "reboot-pending")})
    r.run_wave(plan.Batch(0, ("mig",)), ["mig"])
    assert r.state.host("mig").status == "reboot-pending"
    assert [s for s, _ in r.calls][-1] == "mig" and r.state.unavailable() == ["mig"]
