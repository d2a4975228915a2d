"""End-to-end: driver changes only through the gate (issue 14, items 1-3), on real test hosts
(simulated A100s, the stand-in NVIDIA repository with two driver versions), as an operator
lives it. The tests run in order on one fleet:

1. deploys/all.py provisions 3 hosts on the older driver; the inventory then says the newer one:
   all.py changes no driver (dpkg, holds, loaded module as before), names each host and
   tools/rollout, exits 0; with `driver_upgrade_pending: fail` it exits non-zero.
2. an override the GPUs do not take (R595 on a V100 in the same inventory) is refused before
   any host is touched, naming the host.
3. `tools/rollout INVENTORY` (no version given): canary, then a batch; while it runs a second
   tools/rollout on the same state stops naming the first, and all.py stops on a host the
   rollout holds, naming the holder, without changing it; afterwards a plain all.py changes
   nothing.
4. the host lock dies with its run: a holder killed with -9 leaves the lock free, and the next
   run reports the stale record.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import environment_data, write_inventory
from tests.e2e import rollout_fleet as rf
from tests.e2e.pyinfra_cli import PYINFRA, REPO, changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
OLD, NEW = rf.OLD, rf.NEW
DRIVER = ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms")


def data(host, aptrepo, **extra) -> dict:  # noqa: F811
    return {**environment_data(host, "research", aptrepo), "tier_mismatch": "warn", **extra}


@pytest.fixture(scope="module")
def fleet(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    hosts = hostpool.get("gate", 3, release="bookworm", gpu=f"a100x2@{OLD}")
    work = tmp_path_factory.mktemp("gate")
    inv = write_inventory(work / "fleet.py", hosts, data={h.name: data(h, aptrepo, driver_version=OLD) for h in hosts},
                          groups={"gpu_fleet": [h.name for h in hosts]})
    t = time.monotonic()
    first = pyinfra(inv)
    print(f"[timing] all.py provisioning 3 hosts on {OLD}: {time.monotonic() - t:.1f} s")
    assert first.returncode == 0, first.output
    for h in hosts:
        assert rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}" and rf.loaded(h) == OLD
    return hosts, work


def newer(fleet, aptrepo, **extra) -> Path:  # noqa: F811
    hosts, work = fleet
    return write_inventory(work / "fleet.py", hosts, data={h.name: data(h, aptrepo, **extra) for h in hosts},
                           groups={"gpu_fleet": [h.name for h in hosts]})


def driver_state(h) -> dict:
    return {"versions": {p: rf.version(h, p) for p in DRIVER},
            "pin": rf.version(h, f"nvidia-driver-pinning-{OLD}"), "holds": rf.holds(h), "loaded": rf.loaded(h),
            "apt": rf.sh(h, "grep -c Start-Date /var/log/apt/history.log || true").stdout.strip()}


def tool(work: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "tools" / "rollout"), "-y", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)
    print(proc.stdout, proc.stderr)
    return proc


def test_all_py_changes_no_driver_and_names_each_host_and_tools_rollout(fleet, aptrepo):  # noqa: F811
    hosts, work = fleet
    before = {h.name: driver_state(h) for h in hosts}
    assert all(s["versions"]["nvidia-open"] == f"ii {rf.OLD_DEB}" for s in before.values())
    assert all({"nvidia-open", f"nvidia-driver-pinning-{OLD}"} <= s["holds"] for s in before.values())
    inv = newer(fleet, aptrepo, driver_version=NEW)
    run = pyinfra(inv)
    assert run.returncode == 0, run.output     # reported, not failed: the operator did not ask for that
    for h in hosts:
        assert driver_state(h) == before[h.name], h.name    # dpkg versions, holds, pin, module, no apt run
        assert re.search(rf"\[{h.name}\].*driver upgrade pending: {re.escape(OLD)} -> {re.escape(NEW)}, "
                         r"run tools/rollout", run.output), h.name
        assert re.search(rf"\[{h.name}\]\s+\[WARN\] driver: .*driver upgrade pending: {re.escape(OLD)} -> "
                         rf"{re.escape(NEW)}", run.output), h.name            # the validation gate says it too
    assert "3 host(s) with a DRIVER UPGRADE PENDING" in run.output and "tools/rollout INVENTORY" in run.output
    assert not any("Install driver" in op for op in changed_operations(run)), run.output
    assert changed_operations(run) == [], run.output     # the rest converged already: nothing else moved

    # asked to fail on a pending upgrade: non-zero, each host named; still no driver change
    inv = newer(fleet, aptrepo, driver_version=NEW, driver_upgrade_pending="fail")
    run = pyinfra(inv)
    assert run.returncode != 0, run.output
    for h in hosts:
        assert re.search(rf"\[{h.name}\]\s+\[FAIL\] driver: .*driver upgrade pending: {re.escape(OLD)} -> "
                         rf"{re.escape(NEW)}, run tools/rollout", run.output), h.name
        assert driver_state(h) == before[h.name], h.name


def test_override_that_does_not_fit_the_gpus_is_refused_naming_the_host(fleet, hostpool, aptrepo):  # noqa: F811
    hosts, work = fleet
    (volta,) = hostpool.get("gate-volta", 1, release="bookworm", gpu="v100")
    write_inventory(work / "mixed.py", [*hosts, volta], data={
        **{h.name: data(h, aptrepo, driver_version=NEW) for h in hosts},
        volta.name: data(volta, aptrepo, driver_version=NEW, cuda_version="none", cudnn_version="none")})
    before = {h.name: driver_state(h) for h in hosts}
    r = tool(work, "mixed.py", "--driver-version", "595.45.04", "--canary", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"error: host {volta.name}: --driver-version 595.45.04 (as driver_branch): Tesla V100-SXM2-16GB (volta) "
            "is not supported by driver branch R595; the last branch for volta is R580; the newest stack for "
            "Tesla V100-SXM2-16GB (volta, compute capability 7.0) is R580 (") in r.stdout
    assert "; allowed: R470, " in r.stdout
    assert "nothing changed" in r.stdout
    assert not any(f"host {h.name}:" in r.stdout for h in hosts)    # the A100s take R595: only the V100 is named
    for h in hosts:
        assert driver_state(h) == before[h.name], h.name
    assert not (work / ".gpufleet/manifests").exists()
    state = work / ".gpufleet/rollouts/mixed.json"
    assert not state.exists() or not json.loads(state.read_text())["hosts"]


def test_rollout_from_the_inventory_with_a_second_run_and_all_py_stopped(fleet, aptrepo):  # noqa: F811
    hosts, work = fleet
    h1, h2, h3 = hosts
    inv = newer(fleet, aptrepo, driver_version=NEW)
    profile = "/etc/profile.d/gpufleet-cuda.sh"
    rf.sh(h3, f"mv {profile} /root/cuda-profile.saved")   # something all.py would want to change on h3
    log = open(work / "rollout.log", "w")
    first = subprocess.Popen([str(REPO / "tools" / "rollout"), "-y", "fleet.py", "--canary", "1", "--batch-size", "2"],
                             cwd=work, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while "starting" not in (work / "rollout.log").read_text():
            assert first.poll() is None and time.monotonic() < deadline, (work / "rollout.log").read_text()
            time.sleep(0.5)
        # a second tools/rollout on the same inventory (and state): stops at once, naming the first
        second = tool(work, "fleet.py")
        assert second.returncode == 1, second.stdout
        assert "is in use by another tools/rollout" in second.stdout and f'"pid": {first.pid}' in second.stdout
        # all.py during the rollout: h3 is held by it (batch 1, not started yet) -> stopped, unchanged
        during = pyinfra(inv, "deploys/all.py", "--limit", h3.name)
        assert first.poll() is None, "the rollout ended before all.py reached h3: the check proved nothing"
        assert during.returncode != 0, during.output
        assert f"{h3.name} is locked by another gpufleet run: pid {first.pid} on " in during.output
        assert "(tools/rollout fleet.py) since" in during.output   # program and inventory only (issue 27)
        assert rf.sh(h3, f"test -e {profile}", check=False).returncode != 0    # all.py did not change h3
        assert first.wait(timeout=1800) == 0, (work / "rollout.log").read_text()
    finally:
        if first.poll() is None:
            first.kill()
        log.close()
    out = (work / "rollout.log").read_text()
    print(out)
    starts = [line.split("] ")[1].split(" starting")[0][1:] for line in out.splitlines() if " starting " in line]
    assert starts == ["canary", "batch 1"], out
    assert re.search(rf"canary\s+{h1.name}\s+{OLD}/{OLD}\s+{NEW}", out), out     # from the inventory
    st = json.loads((work / ".gpufleet/rollouts/fleet.json").read_text())
    assert st["target"] == "inventory"
    for h in hosts:
        assert st["hosts"][h.name]["status"] == "done" and st["hosts"][h.name]["target"] == NEW
        for pkg in DRIVER:
            assert rf.version(h, pkg) == f"ii {rf.NEW_DEB}", (h.name, pkg)
        assert rf.version(h, f"nvidia-driver-pinning-{NEW}") == f"ii {rf.NEW_DEB}"
        assert {"nvidia-open", f"nvidia-driver-pinning-{NEW}", "libcudnn9-cuda-13"} <= rf.holds(h), h.name
        assert f"nvidia-driver-pinning-{OLD}" not in rf.holds(h)
        assert rf.loaded(h) == NEW
    assert st["hosts"][h1.name]["steps"]["undrain"]["finished"] < st["hosts"][h2.name]["steps"]["drain"]["started"]
    # the lock went with the rollout: free, and its record removed (released, not crashed)
    for h in hosts:
        assert rf.sh(h, "flock -n /run/gpufleet-lock/host.lock true && ! test -e /run/gpufleet-lock/owner",
                     check=False).returncode == 0, h.name
    files = [work / ".gpufleet", work / ".gpufleet/rollouts", work / ".gpufleet/rollouts/fleet.json"]
    assert [oct(p.stat().st_mode & 0o777) for p in files] == ["0o700", "0o700", "0o600"]

    # the inventory and the hosts agree: a following all.py changes nothing (h3's file put back as it was)
    rf.sh(h3, f"mv /root/cuda-profile.saved {profile}")
    after = pyinfra(inv)
    assert after.returncode == 0, after.output
    assert changed_operations(after) == [], after.output
    assert "driver upgrade pending" not in after.output
    # and a re-run of the rollout has nothing left to do
    again = tool(work, "fleet.py")
    assert again.returncode == 0 and again.stdout.count("done already, not redone") == 3, again.stdout


LOCKER = r"""
import sys, time
from gpufleet.controller import hostlock
name = sys.argv[2]
locks = hostlock.FleetLocks(sys.argv[1], hostlock.owner_record("e2e-locker"))
taken, refused = locks.take([name], wait=int(sys.argv[4]) if len(sys.argv) > 4 else 0)
print(f"TAKEN {taken[name].stale or ''}" if taken else f"REFUSED {refused[name]}", flush=True)
time.sleep(float(sys.argv[3]))
locks.close()
"""


def test_host_lock_dies_with_a_killed_run_and_is_reported_stale(fleet):
    hosts, work = fleet
    h = hosts[0]
    cmd = [sys.executable, "-c", LOCKER, "fleet.py", h.name]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([*cmd, "600"], cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().startswith("TAKEN")
    owner = json.loads(rf.sh(h, "cat /run/gpufleet-lock/owner").stdout)
    assert owner["pid"] == holder.pid and owner["program"] == "e2e-locker"
    blocked = subprocess.run([*cmd, "0"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert blocked.stdout.startswith(f"REFUSED {h.name} is locked by another gpufleet run: pid {holder.pid} on "), \
        blocked.stdout + blocked.stderr
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    deadline = time.monotonic() + 30
    while rf.sh(h, "flock -n /run/gpufleet-lock/host.lock true", check=False).returncode != 0:
        assert time.monotonic() < deadline, "the lock outlived its killed holder"
        time.sleep(0.5)
    nxt = subprocess.run([*cmd, "0"], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    first_line = nxt.stdout.splitlines()[0]
    assert first_line.startswith("TAKEN") and f'"pid": {holder.pid}' in first_line, nxt.stdout + nxt.stderr
    assert rf.sh(h, "test -e /run/gpufleet-lock/owner", check=False).returncode != 0   # released cleanly this time

    # rollout_lock_wait: a second run waits for the first to finish instead of stopping
    holder = subprocess.Popen([*cmd, "5"], cwd=work, env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().startswith("TAKEN")
    t = time.monotonic()
    waited = subprocess.run([*cmd, "0", "120"], cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert waited.stdout.splitlines()[0].strip() == "TAKEN", waited.stdout + waited.stderr   # no stale record
    assert time.monotonic() - t >= 3 and holder.wait(timeout=60) == 0


def test_override_then_the_inventory_line_it_names_then_all_py_changes_nothing(hostpool, aptrepo, tmp_path):  # noqa: F811
    """The other way in: the inventory says the old driver, the operator rolls out the new one
    with --driver-version. all.py does not move the host back; the rollout names the inventory
    line to set; once set, all.py changes nothing."""
    (h,) = hostpool.get("gate-override", 1, release="bookworm", gpu=f"a100x2@{OLD}")
    inv = write_inventory(tmp_path / "one.py", [h], data={h.name: data(h, aptrepo, driver_version=OLD)})
    first = pyinfra(inv)
    assert first.returncode == 0 and rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}", first.output
    r = tool(tmp_path, "one.py", "--driver-version", NEW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rf.version(h, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(h) == NEW
    line = f'one.py: host {h.name}: set driver_version: "{NEW}" (now \'{OLD}\')'
    assert line in r.stdout, r.stdout
    # not set yet: all.py reports the difference and leaves the driver alone (no quiet way back)
    behind = pyinfra(inv)
    assert behind.returncode == 0, behind.output
    assert f"driver upgrade pending: {NEW} -> {OLD}, run tools/rollout" in behind.output
    assert rf.version(h, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(h) == NEW
    assert changed_operations(behind) == [], behind.output
    # set as told: the inventory and the host agree, all.py changes nothing and reports nothing
    inv = write_inventory(tmp_path / "one.py", [h], data={h.name: data(h, aptrepo, driver_version=NEW)})
    agreed = pyinfra(inv)
    assert agreed.returncode == 0 and changed_operations(agreed) == [], agreed.output
    assert "driver upgrade pending" not in agreed.output
    again = tool(tmp_path, "one.py")     # no override: the inventory's driver, there already
    assert again.returncode == 0 and f"{h.name}" in again.stdout and f"at {NEW} already" in again.stdout, again.stdout


def test_two_all_py_runs_started_together_the_second_never_applies_a_stale_plan(fleet, aptrepo):  # noqa: F811
    """Issue 50 item 8: two all.py runs started together on a host with a pending change (a file
    all.py puts back) both read the host before either changes it. The one that takes the lock
    first applies the change; the other, waiting for the lock (rollout_lock_wait), is refused
    once it gets it, because the lock moved since it read the host: nothing of its plan is
    applied (before: it applied the plan it made on the old state, a second time)."""
    hosts, work = fleet
    h = hosts[0]
    inv = newer(fleet, aptrepo, driver_version=NEW, rollout_lock_wait=300)
    profile = "/etc/profile.d/gpufleet-cuda.sh"
    rf.sh(h, f"rm {profile}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    runs = [subprocess.Popen([str(PYINFRA), "-y", "--limit", h.name, str(inv), "deploys/all.py"],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]
    outs = [r.communicate(timeout=900)[0] for r in runs]
    codes = [r.returncode for r in runs]
    print(*outs, sep="\n----\n")
    assert sorted(codes)[0] == 0, outs
    first, second = (0, 1) if codes[0] == 0 else (1, 0)
    assert rf.sh(h, f"test -s {profile}", check=False).returncode == 0   # the change the first planned, made
    assert any("profile" in op.lower() or "cuda" in op.lower() for op in changed_operations(outs[first])), outs[first]
    # the second: refused at its first change, naming why, with nothing applied
    assert codes[second] != 0, outs[second]
    assert "another gpufleet run held its lock after this run read the host's facts" in outs[second]
    # stopped before its first command: pyinfra prints no results table for a run whose hosts all failed
    assert f"[{h.name}] Error: executed 0 commands" in outs[second] and f"[{h.name}] Success" not in outs[second]
    again = pyinfra(inv, "deploys/all.py", "--limit", h.name)
    assert again.returncode == 0 and changed_operations(again) == [], again.output
