"""The host lock's command and messages (the lock itself is proved on real hosts: tests/e2e/test_gate.py)."""
import json
import shlex

from gpufleet import hostlock


def test_hold_command_passes_its_values_as_arguments_of_a_fixed_script():
    owner = hostlock.owner_record("tools/rollout fleet.py --skip 'a b' \"$(reboot)\"")
    argv = shlex.split(hostlock.hold_command(5, owner))
    assert argv == ["sh", "-c", hostlock.HOLD_SCRIPT, "gpufleet-lock", "5", owner]
    assert json.loads(argv[-1])["command"] == "tools/rollout fleet.py --skip 'a b' \"$(reboot)\""


def test_owner_record_names_controller_pid_command_and_start():
    import os

    record = json.loads(hostlock.owner_record("all.py"))
    assert set(record) == {"controller", "pid", "command", "since"} and record["pid"] == os.getpid()
    text = hostlock.describe(json.dumps({"controller": "ctl", "pid": 42, "command": "tools/rollout f.py",
                                         "since": "2026-12-01T12:00:00Z"}))
    assert text == "pid 42 on ctl (tools/rollout f.py) since 2026-12-01T12:00:00Z"
    assert hostlock.describe("") == "an unknown run"
    assert "took over a stale gpufleet lock left by pid 42 on ctl" in hostlock.stale_message(
        "h1", json.dumps({"controller": "ctl", "pid": 42, "command": "x", "since": "t"}))
