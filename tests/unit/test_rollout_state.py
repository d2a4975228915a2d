"""Per-host rollout state: persistence, resume rules, what counts as out of service."""
import json

import pytest

from gpufleet.rollout.state import RolloutState, StateError


def test_state_round_trips_and_is_written_after_every_step(tmp_path):
    path = tmp_path / "s.json"
    st = RolloutState.load(path, "580.126.09", "inv.py")
    st.start("h1", "drain")
    assert json.loads(path.read_text())["hosts"]["h1"]["status"] == "in-progress"
    st.finish("h1", "drain", True)
    st.start("h1", "snapshot")
    st.finish("h1", "snapshot", True, "manifest m.json")
    again = RolloutState.load(path, "580.126.09", "inv.py")
    assert again.host("h1").step_ok("snapshot")
    assert again.host("h1").steps["drain"]["seconds"] >= 0


def test_other_target_refused_while_unfinished(tmp_path):
    path = tmp_path / "s.json"
    st = RolloutState.load(path, "580.126.09", "inv.py")
    st.mark("h1", "done")
    st.finish("h2", "upgrade", True)
    st.finish("h2", "validate", False, "bad")
    with pytest.raises(StateError, match="580.126.09, not 590.48.01, that is not finished on h2"):
        RolloutState.load(path, "590.48.01", "inv.py")
    st.mark("h2", "done")
    fresh = RolloutState.load(path, "590.48.01", "inv.py")   # finished: the next rollout starts afresh
    assert fresh.hosts == {} and fresh.target == "590.48.01"


def test_per_host_target_from_the_inventory(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "inventory", "inv.py")
    assert st.retarget("h1", "580.126.09") is None
    st.mark("h1", "done")
    assert st.retarget("h1", "580.126.09") is None and st.host("h1").status == "done"
    assert st.retarget("h1", "580.159.04") is None                      # finished: a new rollout
    assert st.host("h1").status == "pending" and st.host("h1").target == "580.159.04"
    st.finish("h1", "upgrade", True)
    why = st.retarget("h1", "580.126.09")
    assert "h1 is half-way through a rollout to 580.159.04" in why


def test_resume_never_redoes_a_finished_host_nor_a_taken_snapshot(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "V", "inv")
    st.mark("done-host", "done")
    assert st.host("done-host").steps_to_run() == []
    for step in ("drain", "snapshot", "upgrade", "reboot", "tune"):
        st.finish("h", step, True)
    st.finish("h", "validate", False, "loaded module is old")
    assert st.host("h").status == "failed"
    # drain again (re-checks GPU processes), no second snapshot, then every later step
    assert st.host("h").steps_to_run() == ["drain", "upgrade", "reboot", "mig", "tune", "validate", "accept", "undrain"]
    st.finish("fresh", "drain", False, "busy", status="busy")
    assert st.host("fresh").steps_to_run()[:2] == ["drain", "snapshot"]


def test_unavailable_means_out_of_service(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "V", "inv")
    st.finish("early", "snapshot", False, "snapshot command failed")   # nothing changed: back in service
    st.finish("late", "upgrade", True)
    st.finish("late", "validate", False, "bad")                         # changed, failed: stays out
    st.finish("manual", "reboot", False, "reboot by hand", status="reboot-pending")
    st.finish("busy", "drain", False, "busy", status="busy")
    assert sorted(st.unavailable()) == ["late", "manual"]
    assert sorted(st.failed()) == ["early", "late"]


def test_a_mig_change_busy_on_a_drained_host_gives_it_back_an_upgrade_busy_at_its_reboot_does_not(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "V", "inv")
    for step in ("drain", "snapshot", "upgrade"):
        st.finish("upgraded", step, True)
        st.finish("mig-only", step, True)
    st.finish("upgraded", "reboot", False, "busy, pending (upgraded, not rebooted)", status="busy")
    st.finish("mig-only", "reboot", True)
    st.finish("mig-only", "mig", False, "busy, pending (MIG partitions not changed ...)", status="busy")
    assert st.unavailable() == ["upgraded"]
    st.finish("mig-failed", "mig", False, "the MIG script failed")
    assert st.host("mig-failed").changed and "mig-failed" in st.unavailable()   # may have changed: stays out


# --- atomic writes and the state lock ------------------------------------------------------------

WRITER = r"""
import sys
from gpufleet.rollout.state import RolloutState
st = RolloutState.load(sys.argv[1], "580.126.09", "inv.py")
i = 0
while True:   # as fast as it can, until killed: big records so a write takes a while
    i += 1
    st.host(f"h{i % 50}").message = "x" * (i % 5000)
    st.start(f"h{i % 50}", "drain")
"""


def test_state_file_is_whole_json_after_kill_9_at_any_moment(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / ".gpufleet" / "rollouts" / "s.json"
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    for delay in (0.05, 0.13, 0.21, 0.34, 0.5, 0.8, 1.3):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=repo,
                                env=dict(os.environ, PYTHONPATH=repo))
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if path.exists():
            data = json.loads(path.read_text())            # whole, valid JSON
            assert data["target"] == "580.126.09"
    assert path.exists()
    # no temporary files left readable by others, and everything private
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    assert oct((tmp_path / ".gpufleet").stat().st_mode & 0o777) == "0o700"
    for leftover in path.parent.glob(".s.json.*.tmp"):
        assert oct(leftover.stat().st_mode & 0o777) == "0o600"


def test_second_rollout_on_the_same_state_is_refused_naming_the_first(tmp_path):
    import subprocess
    import sys

    from gpufleet.rollout.state import StateLock, StateLocked

    path = tmp_path / "s.json"
    first = StateLock(path)
    first.acquire("tools/rollout inv.py")
    try:
        second = StateLock(path)
        with pytest.raises(StateLocked, match=rf"in use by another tools/rollout .*\"pid\": {__import__('os').getpid()}"):
            second.acquire("tools/rollout inv.py")
        # another process too (flock locks are per open file, but check across processes as well)
        code = ("import sys\nfrom gpufleet.rollout.state import StateLock, StateLocked\n"
                "try:\n    StateLock(sys.argv[1]).acquire('x')\nexcept StateLocked as e:\n    print(e); sys.exit(7)\n")
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
        assert r.returncode == 7 and "tools/rollout inv.py" in r.stdout
    finally:
        first.release()
    (tmp_path / ".s.json.abc123.tmp").write_text("{half")    # left by a writer killed before its rename
    again = StateLock(path)
    again.acquire("next")      # released: free again
    assert not list(tmp_path.glob(".s.json.*.tmp"))
    again.release()
