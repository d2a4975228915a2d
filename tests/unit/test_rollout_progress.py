"""tools/rollout's progress line: hosts done / in flight / failed, and the time left at the pace
of this run's waves so far (issue 20)."""
from __future__ import annotations

import pytest

from gpufleet.apps.rollout.runner import Options, Runner
from gpufleet.rollout.state import HostRecord, RolloutState

pytestmark = pytest.mark.unit


def _runner(tmp_path, statuses: dict[str, str]) -> Runner:
    runner = Runner(Options(inventory="fleet.py"))
    runner.state = RolloutState(tmp_path / "s.json", "inventory", "fleet.py",
                                {n: HostRecord(n, status=s) for n, s in statuses.items()})
    return runner


def test_before_any_wave_no_estimate(tmp_path):
    runner = _runner(tmp_path, {f"h{i}": "pending" for i in range(4)})
    assert runner.progress(list(runner.state.hosts), in_flight=["h0"]) == \
        "progress: 0/4 done, 1 in flight, 0 failed"


def test_estimate_from_the_pace_of_this_run(tmp_path, monkeypatch):
    runner = _runner(tmp_path, {"h0": "done", "h1": "failed", "h2": "pending", "h3": "pending", "h4": "pending",
                                "old": "done"})
    clock = iter([1000.0])
    monkeypatch.setattr("gpufleet.apps.rollout.runner.time.monotonic", lambda: next(clock))
    runner.waves_started = 1000.0 - 240   # two hosts settled in 4 minutes: 2 min a host
    runner.waved = {"h0", "h1"}           # "old" was done by an earlier run: not this run's pace
    line = runner.progress(list(runner.state.hosts))
    assert line == "progress: 2/6 done, 0 in flight, 1 failed, about 6 min left"


def test_in_flight_counts_as_left_and_nothing_left_at_the_end(tmp_path):
    runner = _runner(tmp_path, {"h0": "done", "h1": "done"})
    runner.waves_started, runner.waved = 0.0, {"h0", "h1"}
    assert runner.progress(["h0", "h1"]) == "progress: 2/2 done, 0 in flight, 0 failed"
