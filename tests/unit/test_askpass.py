"""gpufleet/controller/askpass.py: the sudo password reaches a host on stdin, never in a command line.

The holder script runs for real here under dash (Debian's /bin/sh), on this machine's /proc and
files; the whole path (pyinfra, sshd, sudo asking for the password, a local user polling /proc)
is proven on real test hosts in tests/e2e/test_secrets.py and tests/e2e/test_rollout.py.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api.command import StringCommand

from gpufleet.controller import askpass
from gpufleet import pyinfra_private

pytestmark = pytest.mark.unit

PASSWORD = "hunter2 with 'quotes' $and \\ back"
DASH = shutil.which("dash") or "/bin/sh"


def _hold(base: Path, password: str = PASSWORD) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([DASH, "-c", askpass.HOLD_SCRIPT, "gpufleet-askpass", str(base)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(base / "no-runtime-dir")})
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(password + "\n")
    proc.stdin.flush()
    line = proc.stdout.readline().strip()
    assert line.startswith("READY "), line
    return proc, line.split(" ", 1)[1]


def test_the_holder_keeps_the_password_in_a_private_file_and_removes_it_at_the_end(tmp_path):
    proc, program = _hold(tmp_path)
    folder = Path(program).parent
    assert askpass._READY.fullmatch(f"READY {program}")
    assert folder.parent == tmp_path and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "password").stat().st_mode) == 0o600
    # sudo runs the program with its prompt as the argument: it prints the password's line
    said = subprocess.run([program, "[sudo] password for gpufleet: "], capture_output=True, text=True)
    assert said.stdout == PASSWORD + "\n"
    # the holder's own command line has no password in it
    assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert proc.stdin is not None
    proc.stdin.close()   # the run's channel ends
    assert proc.wait(10) == 0
    assert not folder.exists()


def test_a_dead_holders_folder_is_removed_by_the_next_one_a_live_ones_kept(tmp_path):
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    dead = tmp_path / "gpufleet-askpass.deaddeadde"
    rebooted = tmp_path / "gpufleet-askpass.rebootedxx"
    live = tmp_path / "gpufleet-askpass.livelivexx"
    for folder, holder in ((dead, f"{boot} 999999999"), (rebooted, f"another-boot {os.getpid()}"),
                           (live, f"{boot} {os.getpid()}")):
        folder.mkdir(mode=0o700)
        (folder / "holder").write_text(holder + "\n")
        (folder / "password").write_text("old\n")
    proc, program = _hold(tmp_path)
    try:
        assert not dead.exists() and not rebooted.exists()
        assert live.exists()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


class _Host(SimpleNamespace):
    pass


def _host(**connector_data: str) -> _Host:
    return _Host(name="gpu-a01", connector_data=dict(connector_data))


def _asked() -> tuple[list[tuple[str, str]], object]:
    asked: list[tuple[str, str]] = []

    def path(host: object, kind: str, password: str) -> str:
        asked.append((kind, password))
        return f"/run/user/1000/gpufleet-askpass.AbCdEfGhIj/askpass-{kind}"
    return asked, path


@pytest.mark.parametrize("arguments,prompted", [
    ({"_sudo": True, "_sudo_password": PASSWORD}, None),
    ({"_sudo": True}, PASSWORD),   # the password pyinfra asked for at the terminal
    ({"_sudo": True, "_sudo_password": PASSWORD, "_sudo_user": "postgres", "_env": {"A": "1"}}, None),
])
def test_sudo_commands_carry_only_the_askpass_path(arguments, prompted):
    asked, path = _asked()
    host = _host(**({"prompted_sudo_password": prompted} if prompted else {}))
    text = pyinfra_private.unix_command_with_askpass(host, StringCommand("id", "-u"), path,
                                                      **arguments).get_raw_value()
    assert asked == [("sudo", PASSWORD)]
    assert text.startswith("env SUDO_ASKPASS=/run/user/1000/gpufleet-askpass.AbCdEfGhIj/askpass-sudo sudo -H -A -k ")
    assert PASSWORD not in text and "PYINFRA_SUDO_PASSWORD" not in text
    assert pyinfra_private.PASSWORD_MARK not in text


def test_su_commands_carry_only_the_askpass_path():
    asked, path = _asked()
    text = pyinfra_private.unix_command_with_askpass(_host(), StringCommand("id"), path, _su_user="svc",
                                                      _su_password=PASSWORD).get_raw_value()
    assert asked == [("su", PASSWORD)]
    assert text.startswith("env /run/user/1000/gpufleet-askpass.AbCdEfGhIj/askpass-su | su ")
    assert PASSWORD not in text and "PYINFRA_SU_PASSWORD" not in text


def test_without_a_password_nothing_is_asked_and_sudo_never_prompts():
    asked, path = _asked()
    text = pyinfra_private.unix_command_with_askpass(_host(), StringCommand("id"), path, _sudo=True).get_raw_value()
    assert asked == [] and text == "sudo -H -n sh -c id"


def test_a_password_for_a_host_not_reached_over_ssh_is_refused():
    host = _Host(name="gpu-a01", connector=SimpleNamespace(), connector_data={})
    with pytest.raises(askpass.PasswordRefused, match="only on an SSH connection"):
        askpass.askpass_path(host, "sudo", PASSWORD)


def test_on_an_unverified_pyinfra_a_password_is_refused_never_sent(monkeypatch):
    monkeypatch.setattr(pyinfra_private, "pyinfra_version", lambda: "3.99.0")
    askpass.refuse_unverified(_host(), {"_sudo": True})   # no password: goes through
    for arguments, data in (({"_sudo": True, "_sudo_password": PASSWORD}, {}),
                            ({"_sudo": True}, {"prompted_sudo_password": PASSWORD}),
                            ({"_su_user": "svc", "_su_password": PASSWORD}, {})):
        with pytest.raises(askpass.PasswordRefused, match="pyinfra 3.99.0 is not a release gpufleet verified") as exc:
            askpass.refuse_unverified(_host(**data), arguments)
        assert PASSWORD not in str(exc.value)
