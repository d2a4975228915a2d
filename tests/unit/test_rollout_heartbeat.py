"""tools/rollout's heartbeat (elapsed and an estimate of the rest) and its confirmation before
draining (gpufleet/rollout/progress.py); the question asked on a real pseudo-terminal."""
from __future__ import annotations

import io
import os

import pytest

from gpufleet.rollout import progress as prog


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (60, "1m00s"), (252, "4m12s"),
                                           (3599, "59m59s"), (3900, "1h05m"), (-3, "0s")])
def test_duration(seconds, text):
    assert prog.duration(seconds) == text


def test_planned_waves_per_batch():
    assert prog.planned_waves([1, 3, 3], 2) == 1 + 2 + 2
    assert prog.planned_waves([1, 8, 0], 8) == 2
    assert prog.planned_waves([], 4) == 0


def test_estimate_from_the_waves_so_far():
    assert prog.estimate_left([], 1, 4, 100.0) is None                # nothing to go by yet
    # waves of 120 s: wave 2 of 4 at 30 s has 90 s to go, then two more
    assert prog.estimate_left([120.0], 2, 4, 30.0) == 90.0 + 240.0
    # a wave overrunning the mean counts as about to end, not as negative time
    assert prog.estimate_left([100.0, 140.0], 3, 4, 500.0) == 120.0
    assert prog.estimate_left([60.0], 4, 4, 10.0) == 50.0              # the last wave


def test_heartbeat_line():
    assert prog.heartbeat_line(2, 4, 3, 8, 252, 540) == "wave 2/4: 3 of 8 hosts done, 4m12s elapsed, about 9m left"
    assert prog.heartbeat_line(1, 4, 0, 8, 31, None) == ("wave 1/4: 0 of 8 hosts done, 31s elapsed, "
                                                         "an estimate after the first wave")
    assert prog.heartbeat_line(5, 4, 7, 8, 900, 30).startswith("wave 5/5: ")   # more waves than planned
    assert prog.heartbeat_line(4, 4, 7, 8, 900, 30).endswith("about a minute left")


def _ask_on_a_pty(answer: bytes, assume_yes: bool = False) -> tuple[bool, str]:
    controller, terminal = os.openpty()
    try:
        os.write(controller, answer)
        out = io.StringIO()
        with open(terminal, closefd=False) as stdin:
            assert stdin.isatty()
            ok = prog.confirmed("Drain and upgrade 2 host(s)?", assume_yes, stdin, out)
        return ok, out.getvalue()
    finally:
        os.close(controller)
        os.close(terminal)


@pytest.mark.parametrize("answer, ok", [(b"y\n", True), (b"YES\n", True), (b"n\n", False), (b"\n", False),
                                        (b"sure\n", False)])
def test_a_terminal_is_asked_and_only_yes_goes_on(answer, ok):
    got, shown = _ask_on_a_pty(answer)
    assert got is ok and shown == "Drain and upgrade 2 host(s)? [y/N] \n"


def test_yes_flag_goes_on_and_no_terminal_is_a_no_without_asking():
    got, shown = _ask_on_a_pty(b"n\n", assume_yes=True)
    assert got is True and shown == ""
    for stdin in (io.StringIO("y\n"), None):   # a pipe that says yes, a closed stdin: no one was asked
        out = io.StringIO()
        assert prog.confirmed("Drain?", False, stdin, out) is False and out.getvalue() == ""
    closed = io.StringIO("y\n")
    closed.close()
    assert prog.is_terminal(closed) is False


@pytest.mark.parametrize("value, yes", [("1", True), ("true", True), ("Yes", True), ("on", True), ("0", False),
                                        ("false", False), ("", False), (None, False)])
def test_pyinfra_yes_is_read_as_pyinfra_reads_it(value, yes):
    assert prog.env_yes({} if value is None else {"PYINFRA_YES": value}) is yes


def test_a_pyinfra_yes_that_is_neither_is_refused():
    with pytest.raises(ValueError, match="PYINFRA_YES='maybe' is not a yes or a no: allowed 1, true"):
        prog.env_yes({"PYINFRA_YES": "maybe"})



def test_the_runner_beats_during_a_wave(tmp_path):
    """Runner._heartbeat (the thread run_wave starts) prints the line at its interval until the
    wave ends, with this rollout's counts."""
    import threading
    import time

    from gpufleet.apps.rollout.runner import Options, Runner
    from gpufleet.rollout.state import HostRecord, RolloutState

    out = io.StringIO()
    runner = Runner(Options(inventory="fleet.py", heartbeat=0.05), out=out)
    runner.state = RolloutState(tmp_path / "s.json", "inventory", "fleet.py",
                                {n: HostRecord(n, status=s) for n, s in
                                 {"h0": "done", "h1": "in-progress", "h2": "pending"}.items()})
    runner.eligible = ["h0", "h1", "h2"]
    runner.waves_total, runner.wave_no, runner.wave_seconds = 3, 2, [600.0]
    runner.waves_started = time.monotonic() - 700
    stop = threading.Event()
    beat = threading.Thread(target=runner._heartbeat, args=(time.monotonic() - 100, stop), daemon=True)
    beat.start()
    time.sleep(0.3)
    stop.set()
    beat.join(timeout=5)
    lines = [line for line in out.getvalue().splitlines() if "wave 2/3" in line]
    assert len(lines) >= 2, out.getvalue()
    # 700 s since the first wave began; waves of 600 s: 500 s left of this one, then one more
    assert lines[0].endswith("wave 2/3: 1 of 3 hosts done, 11m40s elapsed, about 18m left"), lines[0]
    time.sleep(0.2)
    assert out.getvalue().count("wave 2/3") == len(lines)   # stopped with the wave
