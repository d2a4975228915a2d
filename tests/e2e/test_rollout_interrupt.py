"""End-to-end: a rollout interrupted in the middle of a host's package change loses nothing.

The new driver's stand-in DKMS package has a postinst that takes as long as the test wants (as a
real DKMS build takes minutes), so the controller can be killed while apt is at work on the host:

1. the controller (tools/rollout, and with it the SSH session) is killed: the package change,
   a transient systemd unit on the host, finishes on its own (versions, holds, dpkg --audit);
   a GPU job started meanwhile stops the resumed rollout right before the reboot (the idle
   check is repeated in the command that reboots); once it ends the resume finishes the host;
2. the package change itself is killed (as a power cut would): dpkg is left half configured
   with the holds released; the resumed rollout repairs dpkg, holds again and finishes;
3. the package change fails (a DKMS build that fails): the rollout reports the unit's result
   and the end of its log, the holds are back; once fixed, a re-run repairs and finishes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from testing import aptrepo as ar
from tests.e2e import rollout_fleet as rf

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
UNIT = "gpufleet-package-change.service"
HOLD = "/run/gpufleet-test-hold-postinst"        # while it exists the stand-in postinst waits
RUNNING = "/run/gpufleet-test-postinst-running"   # the stand-in postinst is at work
FAIL = "/run/gpufleet-test-fail-postinst"         # while it exists the stand-in postinst fails
SLOW_POSTINST = f"""#!/bin/sh
# gpufleet test stand-in: a DKMS build takes minutes; this waits while {HOLD} exists (at most 600 s)
if [ -e {FAIL} ]; then echo "gpufleet test stand-in: the DKMS build fails on purpose" >&2; exit 1; fi
touch {RUNNING}
i=0
while [ -e {HOLD} ] && [ $i -lt 600 ]; do sleep 1; i=$((i+1)); done
rm -f {RUNNING}
exit 0
"""


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory):
    if ar._missing_tools():
        pytest.skip("the stand-in apt repository needs dpkg-deb, apt-ftparchive, gpg")
    pkgs = [dataclasses.replace(p, postinst=SLOW_POSTINST)
            if p.name == "nvidia-kernel-open-dkms" and p.version == rf.NEW_DEB else p
            for p in ar.default_packages()]
    repo = ar.serve(tmp_path_factory.mktemp("slowrepo"), packages=pkgs)
    yield repo
    repo.stop()


@pytest.fixture(scope="module")
def fleet(hostpool, slow_repo, tmp_path_factory):
    hosts = hostpool.get("rollout-interrupt", 2, release="bookworm", gpu=rf.GPU)
    rf.prepare_all(hosts, slow_repo)
    work = tmp_path_factory.mktemp("interrupt")
    for h in hosts:
        rf.inventory(work / f"{h.name}.py", [h], slow_repo)
    return hosts, work


def rollout(work: Path, host, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "tools/rollout"), f"{host.name}.py", "--driver-version", rf.NEW, "-y", *extra],
                          cwd=work, capture_output=True, text=True, timeout=timeout)
    print(proc.stdout, proc.stderr)
    return proc


def start_and_kill_in_package_change(work: Path, host) -> str:
    """Start tools/rollout, wait until the stand-in postinst runs on `host`, kill -9 the rollout."""
    rf.sh(host, f"touch {HOLD}")
    log = open(work / f"{host.name}-killed.log", "w")
    proc = subprocess.Popen([str(REPO / "tools/rollout"), f"{host.name}.py", "--driver-version", rf.NEW, "-y"],
                            cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while rf.sh(host, f"test -e {RUNNING}", check=False).returncode != 0:
            assert proc.poll() is None, (work / f"{host.name}-killed.log").read_text()
            assert time.monotonic() < deadline, "the package change never reached the slow postinst"
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # the controller and its SSH session die
        proc.wait()
        log.close()
    return (work / f"{host.name}-killed.log").read_text()


def unit_state(host) -> dict[str, str]:
    out = rf.sh(host, f"systemctl show -p SubState -p Result -p ExecMainStatus {UNIT}").stdout
    return dict(line.split("=", 1) for line in out.split())


def boots(host) -> int:
    return int((host.dir / "boots").read_text()) if (host.dir / "boots").exists() else 0


def audit(host) -> str:
    return rf.sh(host, "dpkg --audit").stdout.strip()


def status(work: Path, host) -> dict:
    return json.loads((work / ".gpufleet/rollouts" / f"{host.name}.json").read_text())["hosts"][host.name]


def assert_at_new_driver(host):
    for pkg in ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager"):
        assert rf.version(host, pkg) == f"ii {rf.NEW_DEB}", (host.name, pkg)
    assert rf.holds(host) == set(rf.HELD), host.name
    assert audit(host) == ""


def test_controller_killed_mid_change_the_change_completes_and_the_resume_finishes(fleet):
    hosts, work = fleet
    h = hosts[0]
    start_and_kill_in_package_change(work, h)
    # the controller is gone; on the host the change goes on, with the holds released meanwhile
    assert unit_state(h)["SubState"] == "running"
    assert rf.holds(h) < set(rf.HELD)
    assert status(work, h)["status"] == "in-progress"
    rf.sh(h, f"rm -f {HOLD}")
    deadline = time.monotonic() + 300
    while unit_state(h)["SubState"] == "running":
        assert time.monotonic() < deadline
        time.sleep(1)
    # finished without the controller: exact versions, holds back, dpkg clean, the result kept
    assert unit_state(h)["Result"] == "success" and unit_state(h)["ExecMainStatus"] == "0"
    assert_at_new_driver(h)
    assert rf.loaded(h) == rf.OLD

    # a GPU job starts on the drained host before the resume reboots it; nvidia-smi cannot list
    # it (driver/library mismatch until the reboot), the device node it holds shows it
    rf.sh(h, "[ -e /dev/nvidia0 ] || touch /dev/nvidia0; "
             "systemd-run --unit=gpu-job --quiet sh -c 'exec sleep 600 < /dev/nvidia0'")
    try:
        boots_before = boots(h)
        r = rollout(work, h)
        assert r.returncode != 0, r.stdout
        assert "GPU work is running, not rebooting" in r.stdout, r.stdout
        assert rf.loaded(h) == rf.OLD and status(work, h)["status"] == "busy"   # pending, not failed
        assert boots(h) == boots_before
    finally:
        rf.sh(h, "systemctl stop gpu-job; rm -f /dev/nvidia0", check=False)
    r = rollout(work, h)
    assert r.returncode == 0, r.stdout
    assert status(work, h)["status"] == "done"
    assert_at_new_driver(h)
    assert rf.loaded(h) == rf.NEW


def test_package_change_killed_dpkg_is_repaired_and_holds_come_back_on_resume(fleet):
    hosts, work = fleet
    h = hosts[1]
    start_and_kill_in_package_change(work, h)
    # as a power cut would: apt, dpkg and the postinst die with the unit
    rf.sh(h, f"systemctl kill -s KILL {UNIT}; sleep 1; rm -f {HOLD} {RUNNING}")
    assert unit_state(h)["Result"] == "signal"
    assert audit(h) != "", "dpkg should be left half done"
    assert not set(rf.HELD) <= rf.holds(h), "the holds should be released mid-change"
    r = rollout(work, h)
    assert r.returncode == 0, r.stdout
    assert status(work, h)["status"] == "done"
    assert_at_new_driver(h)
    assert rf.loaded(h) == rf.NEW
    assert rf.version(h, f"nvidia-driver-pinning-{rf.NEW}") == f"ii {rf.NEW_DEB}"


def test_failed_change_reports_its_log_holds_come_back_rerun_repairs(fleet):
    hosts, work = fleet
    h = hosts[0]
    r = subprocess.run([str(REPO / "tools/rollback"), f"{h.name}.py", h.name, "--reboot", "-y"], cwd=work,
                       capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode == 0 and rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}" and rf.loaded(h) == rf.OLD
    args = ("--state", ".gpufleet/rollouts/failing.json")
    rf.sh(h, f"touch {FAIL}")
    try:
        r = rollout(work, h, *args)
        assert r.returncode == 1, r.stdout
        assert f"the package change ({UNIT}) ended: exit-code, exit status 100" in r.stdout, r.stdout
        # the end of the unit's log, read back: dpkg's own account of what failed
        assert "Errors were encountered while processing:" in r.stderr and " nvidia-kernel-open-dkms" in r.stderr
        assert "the DKMS build fails on purpose" in rf.sh(h, "cat /var/log/gpufleet/package-change.log").stdout
        # its outcome read back (above), the failed unit is not left behind
        assert unit_state(h).get("SubState") != "failed" and rf.sh(h, "systemctl is-failed gpufleet-package-change.service", check=False).stdout.strip() != "failed"
        assert rf.holds(h) == set(rf.HELD)                                    # held again after the failure
        assert "nvidia-kernel-open-dkms" in audit(h)                           # dpkg: half configured
        assert rf.loaded(h) == rf.OLD
    finally:
        rf.sh(h, f"rm -f {FAIL}")
    r = rollout(work, h, *args)
    assert r.returncode == 0, r.stdout
    assert_at_new_driver(h)
    assert rf.loaded(h) == rf.NEW
