"""End-to-end: nothing leaks. deploys/all.py run twice as the harness's deploy user, made as a
real site makes one (`useradd`: login shell /bin/sh, dash; group sudo, whose sudo asks for its
password: no NOPASSWD), while `student`, an ordinary local user, reads every process's command
line and tries every environment in /proc as fast as it can (tests/e2e/procwatch.py); then the
password is looked for in what that user saw and everywhere gpufleet could have written it: the
project directory (fact plans, state, reports), /tmp on the controller, and the host (every file
it wrote since boot, plus /tmp, /run, /var, /etc, /home, /root). Everything under .gpufleet/
must be 0600 files in 0700 directories.

The password is made at random by the harness (testing/testhosts.sudo_password) and read by the
inventory from the environment: no file holds it. Issue 44 item 1: before gpufleet/controller/askpass.py,
pyinfra's `env ... PYINFRA_SUDO_PASSWORD=<password> sudo -A ...` stayed in the login shell's
command line, and the watcher read it.
"""
from __future__ import annotations

import stat
import subprocess

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.procwatch import watching
from tests.e2e.pyinfra_cli import REPO, changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

USER = testhosts.SSH_USER


def _ssh_root(host, command: str, stdin: str = "") -> subprocess.CompletedProcess:
    return testhosts.ssh(host, command, timeout=120, input=stdin)


@pytest.fixture(scope="module")
def sudo_run(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    host = hostpool.get("secrets-sudo", 1, gpu=f"a100x4@{TEST_DRIVER}")[0]
    password = str(testhosts.sudo_password())
    # the shape, as the host has it: useradd's default shell, sudo asking for the password
    assert testhosts.ssh(host, f"getent passwd {USER} | cut -d: -f7", user=USER).stdout.strip() == "/bin/sh"
    assert testhosts.ssh(host, "readlink -f /bin/sh", user=USER).stdout.strip() == "/usr/bin/dash"
    nopass = testhosts.ssh(host, "sudo -n true", user=USER, check=False)
    assert nopass.returncode != 0 and "password is required" in nopass.stderr, nopass.stderr
    # research hardening lets only the deploy user and lab-admin log in: the watcher's login is
    # made before it and kept open across both runs
    data = {host.name: environment_data(host, "research", aptrepo)}
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host], data=data)
    assert password not in inv.read_text() and testhosts.PASSWORD_ENV in inv.read_text()
    with watching(host) as seen:
        first = pyinfra(inv)
        second = pyinfra(inv)
    return host, password, first, second, seen


def test_the_deploy_runs_through_sudo_with_a_password(sudo_run):
    host, _, first, second, _ = sudo_run
    assert first.returncode == 0 and first.errors == 0, first.output
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    # It really went through sudo as the deploy user: sudo's log names the user and root.
    log = _ssh_root(host, "journalctl -q --no-pager _COMM=sudo | tail -n 50").stdout
    assert f"{USER} : " in log and "USER=root" in log, log


def test_a_local_user_never_sees_the_password(sudo_run):
    _, password, _, _, seen = sudo_run
    # the watcher really watched the run: it read the sudo commands' lines, many times over
    assert seen.rounds > 100, seen.rounds
    assert any("SUDO_ASKPASS=" in text and "sudo -H -A -k" in text for text in seen.cmdlines), seen.cmdlines[:50]
    assert seen.holding(password) == []


def _grep(paths: list[str], needle: str) -> list[str]:
    for _ in range(3):  # 2: a file vanished while read (other runs share the controller's /tmp)
        proc = subprocess.run(["grep", "-rlsF", "--binary-files=text", "-e", needle, "--", *paths],
                              capture_output=True, text=True)
        if proc.returncode in (0, 1) or proc.stdout:  # 1: no match
            break
    assert proc.returncode in (0, 1) or proc.stdout, proc.stderr
    return proc.stdout.split()


def test_the_password_is_nowhere_gpufleet_writes(sudo_run):
    host, password, first, second, _ = sudo_run
    assert password not in first.output and password not in second.output
    assert _grep([str(REPO)], password) == []
    assert _grep(["/tmp"], password) == []
    # Every file the host wrote since it booted (the overlay's upper layer)...
    assert _grep([str(host.dir / "upper")], password) == []
    # ...and its tmpfs and state directories, read on the host; the needle comes on stdin.
    found = _ssh_root(host, "grep -rlsF --binary-files=text -f - /tmp /run /var /etc /home /root || true",
                      stdin=password + "\n").stdout.split()
    assert found == [], found


def test_gpufleet_files_are_private(sudo_run):
    host, _, _, _, _ = sudo_run
    root = REPO / ".gpufleet"
    plan = root / "factplans" / f"{host.name}.json"
    assert plan.exists() and '"facts"' in plan.read_text()  # the fact cache was used
    loose = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if mode & 0o077:
            loose.append(f"{path} {mode:o}")
    assert loose == []
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
