"""End-to-end: nothing leaks. deploys/all.py run twice through sudo with a password (a deploy
user that must type it: no NOPASSWD), then the password is looked for everywhere gpufleet could
have written it: the project directory (fact plans, state, reports), /tmp on the controller,
and the host (every file it wrote since boot, plus /tmp, /run, /var, /etc, /home, /root).
Everything under .gpufleet/ must be 0600 files in 0700 directories.

The inventory reads the password from the environment, so that the test's own input is not a
file under /tmp that holds it.
"""
from __future__ import annotations

import os
import secrets
import stat
import subprocess

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import REPO, changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

USER = "gfdeploy"
ENV = "GPUFLEET_TEST_SUDO_PASSWORD"
PLACEHOLDER = "@@sudo-password@@"


def _ssh_root(host, command: str, stdin: str = "") -> subprocess.CompletedProcess:
    return testhosts.ssh(host, command, timeout=120, input=stdin)


@pytest.fixture(scope="module")
def sudo_run(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    host = hostpool.get("secrets-sudo", 1, gpu=f"a100x4@{TEST_DRIVER}")[0]
    password = "gf-" + secrets.token_hex(12) + "-pw"
    # A deploy user in group sudo (Debian's sudoers: ALL, with a password), with root's key.
    _ssh_root(host, f"id {USER} >/dev/null 2>&1 || useradd -m -s /bin/bash -G sudo {USER}; "
                    f"install -d -m 700 -o {USER} -g {USER} /home/{USER}/.ssh; "
                    f"install -m 600 -o {USER} -g {USER} /root/.ssh/authorized_keys /home/{USER}/.ssh/authorized_keys")
    _ssh_root(host, "chpasswd", stdin=f"{USER}:{password}\n")  # on stdin: in no command line
    data = {host.name: {**environment_data(host, "research", aptrepo), "ssh_user": USER,
                        # this deploy user first (a list without it is refused at planning: its
                        # next login would be shut out), then the harness's own login and the lab's
                        "hardening_allow_users": [USER, host.ssh_user, "lab-admin"],
                        "_sudo": True, "_sudo_password": PLACEHOLDER}}
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host], data=data)
    text = inv.read_text()
    assert text.count(repr(PLACEHOLDER)) == 1
    inv.write_text("import os\n" + text.replace(repr(PLACEHOLDER), f"os.environ[{ENV!r}]"))
    os.environ[ENV] = password
    try:
        first = pyinfra(inv)
        second = pyinfra(inv)
    finally:
        del os.environ[ENV]
    return host, password, first, second


def test_the_deploy_runs_through_sudo_with_a_password(sudo_run):
    host, _, first, second = sudo_run
    assert first.returncode == 0 and first.errors == 0, first.output
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    # It really went through sudo as the deploy user: sudo's log names the user and root.
    log = _ssh_root(host, "journalctl -q --no-pager _COMM=sudo | tail -n 50").stdout
    assert f"{USER} : " in log and "USER=root" in log, log


def _grep(paths: list[str], needle: str) -> list[str]:
    proc = subprocess.run(["grep", "-rlsF", "--binary-files=text", "-e", needle, "--", *paths],
                          capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr  # 1: no match
    return proc.stdout.split()


def test_the_password_is_nowhere_gpufleet_writes(sudo_run):
    host, password, _, _ = sudo_run
    assert _grep([str(REPO)], password) == []
    assert _grep(["/tmp"], password) == []
    # Every file the host wrote since it booted (the overlay's upper layer)...
    assert _grep([str(host.dir / "upper")], password) == []
    # ...and its tmpfs and state directories, read on the host; the needle comes on stdin.
    found = _ssh_root(host, "grep -rlsF --binary-files=text -f - /tmp /run /var /etc /home /root || true",
                      stdin=password + "\n").stdout.split()
    assert found == [], found


def test_gpufleet_files_are_private(sudo_run):
    host, _, _, _ = sudo_run
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
