"""The host lock's command and messages (the lock itself is proved on real hosts:
tests/e2e/test_gate.py, and against a local user's planted folder: tests/e2e/test_hostlock_attack.py)."""
import json
import shlex

import pytest
from pyinfra.api import Config, Inventory, State

from gpufleet.controller import askpass
from gpufleet.controller import hostlock
from gpufleet import pyinfra_private


def test_hold_command_passes_its_values_as_arguments_of_a_fixed_script():
    owner = hostlock.owner_record("tools/rollout", "fleet 'a b' \"$(reboot)\".py")
    argv = shlex.split(hostlock.hold_command(5, owner).get_raw_value())
    assert argv == ["sh", "-c", hostlock.HOLD_SCRIPT, "gpufleet-lock", "5", "", owner]
    assert json.loads(argv[-1])["inventory"] == "fleet 'a b' \"$(reboot)\".py"


def test_the_lock_lives_in_a_root_only_folder_written_through_mktemp():
    script = hostlock.HOLD_SCRIPT
    assert hostlock.LOCK_DIR == "/run/gpufleet-lock" and "d=/run/gpufleet-lock\n" in script
    assert "/run/lock" not in script and "mkdir -p" not in script
    assert 'mkdir -m 700 "$d"' in script and "\"0 700\"" in script and '[ -L "$d" ]' in script
    assert 't=$(mktemp "$d/.owner.XXXXXX")' in script and 'mv -f "$t" "$d/owner"' in script
    assert '> "$d/owner' not in script   # never a redirection onto a fixed name


def test_owner_record_names_controller_pid_program_inventory_and_start():
    import os

    record = json.loads(hostlock.owner_record("tools/rollout", "fleet.py"))
    assert set(record) == {"controller", "pid", "program", "inventory", "since"} and record["pid"] == os.getpid()
    text = hostlock.describe(json.dumps({"controller": "ctl", "pid": 42, "program": "tools/rollout",
                                         "inventory": "f.py", "since": "2026-12-01T12:00:00Z"}))
    assert text == "pid 42 on ctl (tools/rollout f.py) since 2026-12-01T12:00:00Z"
    assert hostlock.describe("") == "an unknown run"
    assert "took over a stale gpufleet lock left by pid 42 on ctl" in hostlock.stale_message(
        "h1", json.dumps({"controller": "ctl", "pid": 42, "program": "x", "since": "t"}))


def test_the_owner_record_never_holds_the_command_lines_data_values():
    argv = ["/venv/bin/pyinfra", "-y", "--data", "_sudo_password=hunter2", "inventories/lab.py",
            "deploys/tuning.py", "--data", "x=topsecret"]
    assert hostlock.this_run(argv) == ("pyinfra deploys/tuning.py", "inventories/lab.py")
    # an operation on the command line carries its arguments: left out
    assert hostlock.this_run(["pyinfra", "inv.py", "server.shell", "echo hunter2"]) == ("pyinfra", "inv.py")
    import sys

    record = hostlock.owner_record()
    assert "hunter2" not in record and " ".join(sys.argv[1:]) not in record or not sys.argv[1:]


def test_a_hosts_lock_owner_is_printed_with_its_control_characters_escaped():
    record = json.dumps({"controller": "ctl\x1b]0;owned\x07", "pid": 1, "program": "p\u202e", "since": "t\n| x |"})
    text = hostlock.describe(record)
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\n" not in text
    assert "ctl\\x1b]0;owned\\x07" in text and "\\u202e" in text


def host_with(data):
    inventory = Inventory(([("gpu-a01", dict(data))], {}))
    State(inventory, Config())
    return inventory.get_host("gpu-a01")


def test_the_lock_is_taken_as_root_through_sudo_when_the_host_says_so():
    command = hostlock.hold_command(0, "{}")
    assert pyinfra_private.root_command(host_with({}), command) == "exec " + command.get_raw_value()
    sudo = pyinfra_private.root_command(host_with({"_sudo": True, "_sudo_user": "postgres"}), command)
    assert sudo == "exec sudo -H -n " + command.get_raw_value()   # root, not the operations' sudo user


@pytest.mark.parametrize("where", ["data", "prompted"])
def test_a_sudo_password_goes_to_sudos_askpass_never_into_the_owner_record(where, monkeypatch):
    host = host_with({"_sudo": True, **({"_sudo_password": "hunter2"} if where == "data" else {})})
    if where == "prompted":
        host.connector_data["prompted_sudo_password"] = "hunter2"
    given = []
    # the host's askpass program (gpufleet/controller/askpass.py; its holder needs an SSH connection)
    monkeypatch.setattr(askpass, "askpass_path",
                        lambda host, kind, password: given.append(password) or "/tmp/gpufleet-askpass.x/askpass")
    askpass.install()
    owner = hostlock.owner_record("pyinfra deploys/all.py", "lab.py")
    text = pyinfra_private.root_command(host, hostlock.hold_command(0, owner))
    argv = shlex.split(text)
    # exec'd (the login shell does not stay behind); only the askpass program's path on the line
    assert given == ["hunter2"] and "hunter2" not in text
    assert argv[:3] == ["exec", "env", "SUDO_ASKPASS=/tmp/gpufleet-askpass.x/askpass"]
    assert argv[3:7] == ["sudo", "-H", "-A", "-k"] and argv[-1] == owner and "hunter2" not in owner
