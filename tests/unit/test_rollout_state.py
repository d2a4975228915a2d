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


def test_other_target_refused(tmp_path):
    path = tmp_path / "s.json"
    RolloutState.load(path, "580.126.09", "inv.py").mark("h1", "done")
    with pytest.raises(StateError, match="580.126.09, not 590.48.01"):
        RolloutState.load(path, "590.48.01", "inv.py")


def test_resume_never_redoes_a_finished_host_nor_a_taken_snapshot(tmp_path):
    st = RolloutState.load(tmp_path / "s.json", "V", "inv")
    st.mark("done-host", "done")
    assert st.host("done-host").steps_to_run() == []
    for step in ("drain", "snapshot", "upgrade", "reboot", "tune"):
        st.finish("h", step, True)
    st.finish("h", "validate", False, "loaded module is old")
    assert st.host("h").status == "failed"
    # drain again (re-checks GPU processes), no second snapshot, then every later step
    assert st.host("h").steps_to_run() == ["drain", "upgrade", "reboot", "tune", "validate", "undrain"]
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
