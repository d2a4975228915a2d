"""End-to-end (issue 27, item 1): a local unprivileged user cannot turn the host lock into a
root write, on one real test host.

- `student` plants the lock folder where a user can (the old world-writable /run/lock/gpufleet;
  /run/gpufleet-lock needs root) with `owner.new`, `owner` and `host.lock` symlinks to a root-owned
  canary; deploys/tuning.py (it takes the host lock at its first change) runs twice: the first
  changes the host under its own root-only lock, the second changes nothing; the canary and
  the planted folder are as they were.
- /run/gpufleet-lock of the wrong owner, the wrong mode, or a symlink (made by root: no user can)
  is refused by name and the host is not changed.
- the lock taken through sudo (a login user with `_sudo`, and one with `_sudo_password`):
  root's lock, its owner record without the password, the password in no file, log or process
  list on the host; a login user without sudo is refused, saying so.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import REPO, pyinfra

pytestmark = pytest.mark.e2e

CANARY = "/etc/gf-canary"
OLD = "/run/lock/gpufleet"
NEW = "/run/gpufleet-lock"
NCCL = "/etc/nccl.conf"
PASSWORD = "gf-Sud0-pw-7731"

LOCKER = r"""
import sys, time
from gpufleet.controller import hostlock
name = sys.argv[2]
locks = hostlock.FleetLocks(sys.argv[1], hostlock.owner_record("e2e-locker", sys.argv[1]))
taken, refused = locks.take([name], wait=0)
print(f"TAKEN {taken[name].stale or ''}" if taken else f"REFUSED {refused[name]}", flush=True)
time.sleep(float(sys.argv[3]))
locks.close()
"""


def root(host, cmd: str, check: bool = True) -> str:
    return testhosts.ssh(host, cmd, check=check).stdout


def canary(host) -> str:
    return root(host, f"stat -c '%U %a %s %Y' {CANARY} && sha256sum {CANARY}")


@pytest.fixture(scope="module")
def lab(hostpool, tmp_path_factory):
    t0 = time.monotonic()
    (host,) = hostpool.get("hostlock", 1, release="bookworm")
    work = tmp_path_factory.mktemp("hostlock")
    data = {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn"}
    inv = write_inventory(work / "inventory.py", [host], data={host.name: data})
    # a local unprivileged user, a canary only root may write, and two sudo login users
    key = Path(host.ssh_key + ".pub").read_text()
    users = (" && ".join(f"(id {u} >/dev/null 2>&1 || useradd -m -s /bin/sh {u})" for u in ("student", "deployer", "pwdeployer"))
             + f" && printf 'canary\\n' > {CANARY} && chmod 644 {CANARY}"
             + " && echo 'deployer ALL=(ALL) NOPASSWD: ALL' > /etc/sudoers.d/gf-deployer"
             + " && echo 'pwdeployer ALL=(ALL) ALL' > /etc/sudoers.d/gf-pwdeployer"
             + " && chmod 440 /etc/sudoers.d/gf-deployer /etc/sudoers.d/gf-pwdeployer"
             + " && chpasswd")
    testhosts.ssh(host, users, input=f"pwdeployer:{PASSWORD}\n")   # on stdin: in no command line
    for user in ("student", "deployer", "pwdeployer"):   # student logs in only in the last test
        root(host, f"install -d -m 700 -o {user} -g {user} /home/{user}/.ssh && printf '%s\\n' {shlex.quote(key.strip())}"
                   f" > /home/{user}/.ssh/authorized_keys && chown {user}: /home/{user}/.ssh/authorized_keys")
    yield host, inv, work, data
    print(f"[timing] test_hostlock_attack: {time.monotonic() - t0:.1f} s wall (one host)")


def as_student(host, cmd: str) -> subprocess.CompletedProcess:
    """`cmd` as the local user student (runuser from root: whichever users sshd lets in)."""
    return testhosts.ssh(host, "runuser -u student -- sh -c " + shlex.quote(cmd), check=False)


def test_a_planted_lock_folder_is_never_written_through(lab):
    host, inv, _, _ = lab
    before = canary(host)
    # student wins the race for the folder a user can create, and plants symlinks to the canary
    planted = as_student(host, f"mkdir -p {OLD} && chmod 777 {OLD} && for f in owner.new owner host.lock; do "
                               f"ln -s {CANARY} {OLD}/$f; done && ls -l {OLD}; mkdir {NEW} 2>&1; true")
    assert planted.returncode == 0, planted.stderr
    assert "Permission denied" in planted.stdout   # /run/gpufleet-lock: root's /run, no user can make it
    first = pyinfra(inv, "deploys/tuning.py")
    assert first.returncode == 0 and first.errors == 0, first.output[-5000:]
    assert first.changed > 0, first.output[-3000:]   # it changed the host: it took the lock first
    assert canary(host) == before
    # its own root-only lock: root's 0700 folder, the lock file there, the owner record gone with the release
    # (and the lock's generation count, which all.py reads before planning)
    assert root(host, f"stat -c '%U %a %F' {NEW} {NEW}/host.lock && ls -A {NEW}").split("\n")[:4] == [
        "root 700 directory", "root 600 regular empty file", "generation", "host.lock"]
    assert canary(host) == before
    # the planted folder is as student left it: never used, never touched
    assert root(host, f"stat -c '%U %N' {OLD}/owner.new {OLD}/owner {OLD}/host.lock").split("\n")[:3] == [
        f"student '{OLD}/{f}' -> '{CANARY}'" for f in ("owner.new", "owner", "host.lock")]
    again = pyinfra(inv, "deploys/tuning.py")
    assert again.returncode == 0 and again.changed == 0, again.output[-5000:]
    assert canary(host) == before


@pytest.mark.parametrize("make,seen", [
    (f"mkdir -m 700 {NEW} && chown student: {NEW}", "directory, owner student, mode 700"),
    (f"mkdir -m 755 {NEW}", "directory, owner root, mode 755"),
    (f"mkdir -m 700 /root/elsewhere; ln -s /root/elsewhere {NEW}", "symbolic link, owner root, mode 777"),
])
def test_a_lock_folder_of_the_wrong_owner_or_mode_is_refused_by_name(lab, make, seen):
    host, inv, _, _ = lab
    root(host, f"rm -rf {NEW} /root/elsewhere && {make} && rm -f {NCCL}")   # tuning would put NCCL back
    run = pyinfra(inv, "deploys/tuning.py")
    assert run.returncode != 0, run.output[-3000:]
    assert (f"refused the gpufleet lock folder {NEW}: not root's own 0700 folder ({seen}); another user may have "
            "made it") in run.output, run.output[-3000:]
    assert root(host, f"test -e {NCCL} && echo there || echo absent").strip() == "absent"   # not changed
    root(host, f"rm -rf {NEW} /root/elsewhere")
    fixed = pyinfra(inv, "deploys/tuning.py")
    assert fixed.returncode == 0 and fixed.changed > 0, fixed.output[-3000:]


def test_sudo_uploads_stage_in_the_login_user_s_private_folder_never_in_tmp(lab):
    host, inv, _, _ = lab
    assert host.ssh_user != "root"      # the run logs in as the sudo user gpufleet
    uid = root(host, f"id -u {host.ssh_user}").strip()
    stage = f"/var/lib/gpufleet-upload.{uid}"
    predictable = "/tmp/pyinfra-" + hashlib.sha1(NCCL.encode()).hexdigest()   # pyinfra's own name for it
    root(host, f"rm -rf {stage} {NCCL} {predictable}")                           # tuning puts NCCL back
    planted = as_student(host, f"mkdir {predictable} && chmod 777 {predictable} && stat -c '%U %F' {predictable}")
    assert planted.stdout.strip() == "student directory", planted.stdout + planted.stderr
    marker = "/run/gf-before-upload"
    root(host, f"touch {marker}")
    run = pyinfra(inv, "deploys/tuning.py")
    assert run.returncode == 0 and run.errors == 0, run.output[-5000:]
    assert root(host, f"stat -c '%U %a' {NCCL}").strip() == "root 644"       # uploaded through sudo
    assert "NCCL_" in root(host, f"cat {NCCL}")
    # staged in the login user's own 0700 folder, left empty; nothing of this run's in /tmp
    assert root(host, f"stat -c '%U %a %F' {stage}; ls -A {stage}").splitlines() == [f"{host.ssh_user} 700 directory"]
    assert root(host, f"find /tmp /var/tmp -newer {marker} -name 'pyinfra-*' ! -name 'pyinfra-sudo-askpass-*'; "
                      f"stat -c '%U %F' {predictable}").splitlines() == ["student directory"]
    # a staging folder that is not the login user's own 0700 one: refused by name, nothing uploaded
    root(host, f"rm -rf {stage} {NCCL} && mkdir -m 755 {stage} && chown {host.ssh_user} {stage}")
    refused = pyinfra(inv, "deploys/tuning.py")
    assert refused.returncode != 0, refused.output[-3000:]
    assert "refused the gpufleet staging folder /var/lib/gpufleet-upload.<uid>" in refused.output, refused.output[-3000:]
    assert f"directory, owner {host.ssh_user}, mode 755" in refused.output, refused.output[-3000:]
    assert root(host, f"test -e {NCCL} && echo there || echo absent").strip() == "absent"
    root(host, f"rm -rf {stage} {predictable}")
    fixed = pyinfra(inv, "deploys/tuning.py")
    assert fixed.returncode == 0 and fixed.changed > 0, fixed.output[-3000:]


def locker(work, inv, name: str, seconds: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOCKER, str(inv), name, seconds], cwd=work,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.PIPE,
                            stderr=open(work / "locker.err", "a"), text=True)


@pytest.mark.parametrize("user,extra", [
    ("deployer", {"_sudo": True}),
    ("pwdeployer", {"_sudo": True, "_sudo_password": PASSWORD}),
])
def test_the_lock_is_root_s_through_sudo_and_the_password_goes_nowhere(lab, user, extra):
    host, _, work, data = lab
    inv = write_inventory(work / f"{user}.py", [host],
                          data={host.name: {**data, "ssh_user": user, **extra}})
    holder = locker(work, inv, host.name, "30")
    try:
        line = holder.stdout.readline()
        assert line.startswith("TAKEN"), line + holder.stdout.read()
        held = root(host, f"stat -c '%U %a' {NEW}; cat {NEW}/owner; ps -eo user,args")
        owner = json.loads(held.splitlines()[1])
        assert held.splitlines()[0] == "root 700"
        assert owner["program"] == "e2e-locker" and owner["inventory"] == str(inv)
        assert PASSWORD not in held, [ln for ln in held.splitlines() if PASSWORD in ln]   # record, process arguments
        assert any(ln.startswith("root ") and "gpufleet-lock" in ln for ln in held.splitlines()), held
        assert root(host, f"flock -n {NEW}/host.lock true && echo free || echo held").strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    # the password on stdin, in no command line: sudo logs the harness's own commands
    found = testhosts.ssh(host, 'p=$(cat); grep -rlF -e "$p" /tmp /run /var/log /var/tmp /home /root 2>/dev/null; '
                                'journalctl --no-pager 2>/dev/null | grep -cF -e "$p"; true', input=PASSWORD).stdout
    assert found.split() == ["0"], found


def test_a_login_user_without_sudo_is_told_the_lock_needs_root(lab):
    host, _, work, data = lab
    inv = write_inventory(work / "student.py", [host], data={host.name: {**data, "ssh_user": "student", "_sudo": None}})
    holder = locker(work, inv, host.name, "0")
    out = holder.communicate(timeout=120)[0]
    assert out.startswith(f"REFUSED {host.name}: the gpufleet lock is taken as root, and this run logs in as student "
                          "without sudo"), out
