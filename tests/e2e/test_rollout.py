"""End-to-end: tools/rollout and tools/rollback on 6 real test hosts (simulated A100s, stand-in
NVIDIA repository, real Slurm: slurmctld on a seventh host), as an operator runs them. The tests run in order on one fleet:

1. dry run; 2. canary + two batches, clean; 3. rollback one host, then the rest (fleet back to
the old driver); 4. canary failing validation stops everything; a batch failing beyond max_fail
stops; after the fix a re-run resumes without redoing finished hosts; a busy host is refused and
reported, skipped with --skip, upgraded with --force.
"""
from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from testing import slurm
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.gpusim_modules import fail_module_load
from testing import testhosts
from tests.e2e import rollout_fleet as rf
from tests.e2e.procwatch import watching

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
TIMINGS: dict[str, float] = {}
WATCHED: dict[str, object] = {}


@pytest.fixture(scope="module")
def slurmctl(hostpool):
    return hostpool.get("rollout-slurmctl", 1, release="bookworm")[0]


@pytest.fixture(scope="module")
def fleet(hostpool, aptrepo, slurmctl, tmp_path_factory):  # noqa: F811
    hosts = hostpool.get("rollout", 6, release="bookworm", gpu=rf.GPU)
    t = time.monotonic()
    rf.prepare_all(hosts, aptrepo, slurmctld=slurmctl)
    TIMINGS["prepare_s"] = time.monotonic() - t
    work = tmp_path_factory.mktemp("rollout")
    rf.inventory(work / "fleet.py", hosts, aptrepo)
    return hosts, work


def tool(work: Path, name: str, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "tools" / name), "-y", *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)
    print(proc.stdout, proc.stderr)
    return proc


def state(work: Path, name: str) -> dict:
    return json.loads((work / ".gpufleet/rollouts" / f"{name}.json").read_text())["hosts"]


def boots(host) -> int:
    return int((host.dir / "boots").read_text()) if (host.dir / "boots").exists() else 0


def test_dry_run_shows_batches_versions_reboots_and_gpu_jobs(fleet):
    hosts, work = fleet
    rf.sh(hosts[5], "gpusimctl add-process --gpu 0 --pid 4242 --name python3 --used-mib 2048")
    try:
        r = tool(work, "rollout", "fleet.py", "--driver-version", rf.NEW, "--canary", "1", "--batch-size", "3", "--dry-run")
    finally:
        rf.sh(hosts[5], "gpusimctl remove-process --pid 4242")
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"canary\s+" + hosts[0].name, r.stdout)
    for h in hosts[1:4]:
        assert re.search(r"batch 1\s+" + h.name, r.stdout)
    for h in hosts[4:]:
        assert re.search(r"batch 2\s+" + h.name, r.stdout)
    assert r.stdout.count(f"{rf.OLD}/{rf.OLD}") == 6 and r.stdout.count(rf.NEW) >= 6
    assert r.stdout.count("yes (if-idle)") == 6
    assert "4242 python3 -> drain waits" in r.stdout      # a Slurm node: its jobs end before the upgrade
    for h in hosts:   # nothing changed, nothing recorded
        assert rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}"
    assert not (work / ".gpufleet/manifests").exists()


@pytest.fixture(scope="module")
def rolled_out(fleet):
    """The canary rollout of the whole fleet to rf.NEW, once per module: the rollback test needs
    its manifests whether or not the canary test is selected (`-k rollback`)."""
    hosts, work = fleet
    t = time.monotonic()
    # the canary's local user watches /proc through the whole rollout, its reboot included
    with watching(hosts[0]) as seen:
        r = tool(work, "rollout", "fleet.py", "--driver-version", rf.NEW, "--canary", "1", "--batch-size", "3",
                 "--max-unavailable", "3")
    WATCHED["rollout"] = seen
    TIMINGS["rollout_6_hosts_s"] = time.monotonic() - t
    return r


def test_canary_plus_two_batches(fleet, slurmctl, rolled_out):
    hosts, work = fleet
    r = rolled_out
    assert r.returncode == 0, r.stdout + r.stderr
    # the order of the batches, as printed while running
    starts = [line for line in r.stdout.splitlines() if "starting" in line]
    assert [s.split("] ")[1].split(" starting")[0][1:] for s in starts] == ["canary", "batch 1", "batch 2"]
    # progress with an estimate of the time left, after each wave (issue 20)
    assert "; progress: 1/6 done, 3 in flight, 0 failed, about " in starts[1], starts
    assert re.search(r"\] progress: 6/6 done, 0 in flight, 0 failed$", r.stdout, re.M), r.stdout
    # an override: the run names the inventory line that makes the inventory say so (issue 14)
    for h in hosts:
        assert f'fleet.py: host {h.name}: set driver_version: "{rf.NEW}" (now \'auto\')' in r.stdout, r.stdout
    st = state(work, "fleet")
    for h in hosts:
        assert st[h.name]["status"] == "done"
        for pkg in ("nvidia-open", "nvidia-driver-cuda", "nvidia-fabricmanager", "nvidia-kernel-open-dkms"):
            assert rf.version(h, pkg) == f"ii {rf.NEW_DEB}", (h.name, pkg)
        assert rf.version(h, f"nvidia-driver-pinning-{rf.NEW}") == f"ii {rf.NEW_DEB}"
        assert rf.version(h, "libcudnn9-cuda-13").startswith("ii 9.")           # not a driver package: untouched
        assert rf.holds(h) == set(rf.HELD), h.name                                # holds re-applied
        assert rf.loaded(h) == rf.NEW
        smi = rf.sh(h, "nvidia-smi --query-gpu=driver_version,persistence_mode,clocks.applications.graphics "
                       "--format=csv,noheader,nounits").stdout.split("\n")[0]
        assert smi.split(", ")[:2] == [rf.NEW, "Enabled"]                          # persistence re-applied
        assert int(smi.split(", ")[2]) == rf.supported_pair(h)[1]                   # clocks re-applied
        # the manifest: before the first package change, and it records the old state
        manifest = json.loads(Path(work / st[h.name]["manifest"]).read_text())
        assert manifest["packages"]["nvidia-open"] == rf.OLD_DEB
        assert set(manifest["holds"]) == set(rf.HELD)
        assert "/etc/apt/sources.list.d/cuda-debian12-x86_64.list" in manifest["etc_files"]
        assert "/etc/apt/preferences.d/nvidia-driver-pinning" in manifest["etc_files"]
        on_host = rf.sh(h, f"stat -c %.9Y /var/lib/gpufleet/manifests/{manifest['id']}.json").stdout.strip()
        first_change = rf.sh(h, f"grep -m1 ' upgrade nvidia-.* {rf.OLD_DEB} {rf.NEW_DEB}' /var/log/dpkg.log").stdout
        changed_at = datetime.strptime(first_change[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
        apt_start = rf.sh(h, "grep '^Start-Date' /var/log/apt/history.log | tail -1").stdout.split(": ", 1)[1].strip()
        print(f"{h.name}: manifest written {float(on_host):.3f}, first dpkg upgrade line {first_change.strip()}, "
              f"apt Start-Date {apt_start}")
        assert float(on_host) < changed_at + 1            # dpkg.log has second resolution
        assert st[h.name]["steps"]["snapshot"]["finished"] < st[h.name]["steps"]["upgrade"]["started"]
        # Slurm (slurmctld's log): drained before the package change, resumed after validation
        updates = rf.slurm_updates(slurmctl, h.name)
        drain = [t for t, text in updates if text.endswith(f"reason set to: gpufleet driver upgrade to {rf.NEW}")]
        resume = [t for t, text in updates if text.endswith("state set to IDLE")]
        assert drain and resume and resume[-1] > drain[-1], updates
        assert int(drain[-1]) <= changed_at
        assert slurm.settled_state(slurmctl, h.name) == ("idle", "")
    TIMINGS.update({f"step_{s}_s": max(st[h.name]["steps"][s]["seconds"] for h in hosts)
                    for s in ("drain", "snapshot", "upgrade", "reboot", "tune", "validate", "undrain")})
    print("TIMINGS", TIMINGS)
    # a finished rollout re-run changes nothing
    before = [boots(h) for h in hosts]
    r = tool(work, "rollout", "fleet.py", "--driver-version", rf.NEW, "--canary", "1", "--batch-size", "3")
    assert r.returncode == 0 and r.stdout.count("done already, not redone") == 6
    assert [boots(h) for h in hosts] == before


def test_rollback_one_host_restores_versions_and_holds(fleet, rolled_out):
    hosts, work = fleet
    assert rolled_out.returncode == 0, rolled_out.stdout + rolled_out.stderr  # what there is to roll back
    h = hosts[0]
    rf.sh(h, "apt-mark unhold libcudnn9-cuda-13")   # drift since the manifest: must come back too
    with watching(h) as seen:
        r = tool(work, "rollback", "fleet.py", h.name, "--reboot")
    assert r.returncode == 0, r.stdout + r.stderr
    # the deploy user's sudo password: never in what a local user read in /proc (issue 44),
    # during the rollout nor the rollback, while sudo did ask for it
    for watched in (WATCHED["rollout"], seen):
        assert any("SUDO_ASKPASS=" in text and "sudo -H -A -k" in text for text in watched.cmdlines)
        assert watched.holding(str(testhosts.sudo_password())) == []
    manifest = json.loads(sorted((work / ".gpufleet/manifests" / h.name).glob("*.json"))[-1].read_text())
    for pkg, ver in manifest["packages"].items():
        assert rf.version(h, pkg) == f"ii {ver}", pkg
    assert not rf.version(h, f"nvidia-driver-pinning-{rf.NEW}").startswith("ii")
    assert rf.holds(h) == set(manifest["holds"]) == set(rf.HELD)
    assert f"{rf.OLD}-*" in rf.sh(h, "cat /etc/apt/preferences.d/nvidia-driver-pinning").stdout
    assert rf.loaded(h) == rf.OLD
    assert "no disk snapshot was configured" in r.stdout
    # the others too, in one call: the fleet is back at the old driver for the next test
    r = tool(work, "rollback", "fleet.py", *[x.name for x in hosts[1:]], "--reboot")
    assert r.returncode == 0, r.stdout + r.stderr
    for x in hosts:
        assert rf.version(x, "nvidia-open") == f"ii {rf.OLD_DEB}" and rf.loaded(x) == rf.OLD


def test_canary_failure_max_fail_resume_busy_skip_force(fleet, slurmctl):
    hosts, work = fleet
    h1, h2, h3, h4, h5, h6 = hosts
    args = ["fleet.py", "--driver-version", rf.NEW, "--canary", "1", "--batch-size", "3", "--max-unavailable", "3",
            "--max-fail", "1", "--state", ".gpufleet/rollouts/second.json"]
    apt_before = {h.name: rf.sh(h, "grep -c Start-Date /var/log/apt/history.log").stdout.strip() for h in hosts}
    # Slurm changes as slurmctld records them; the survey's sinfo is a read
    calls_before = {h.name: len(rf.slurm_updates(slurmctl, h.name)) for h in hosts}

    # 1. the canary's new module does not load: validation fails, nobody else is touched
    fail_module_load(h1)
    r = tool(work, "rollout", *args)
    assert r.returncode == 1 and "STOPPED: the canary failed" in r.stdout, r.stdout
    st = state(work, "second")
    assert st[h1.name]["status"] == "failed" and "validate" in st[h1.name]["message"]
    assert f"loaded driver module is {rf.OLD}, not {rf.NEW}" in st[h1.name]["message"]
    for h in (h2, h3, h4, h5, h6):
        assert st[h.name]["status"] == "pending" and not st[h.name]["steps"]
        assert rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}"
        assert rf.sh(h, "grep -c Start-Date /var/log/apt/history.log").stdout.strip() == apt_before[h.name]
        assert len(rf.slurm_updates(slurmctl, h.name)) == calls_before[h.name]

    # 2. fixed canary; two of batch 1 fail: 2 > max_fail 1 stops before batch 2
    fail_module_load(h1, False)
    fail_module_load(h2)
    fail_module_load(h3)
    manifests_h1 = len(list((work / ".gpufleet/manifests" / h1.name).glob("*.json")))
    r = tool(work, "rollout", *args)
    assert r.returncode == 1 and "more than --max-fail 1" in r.stdout, r.stdout
    st = state(work, "second")
    assert st[h1.name]["status"] == "done" and st[h4.name]["status"] == "done"
    assert st[h2.name]["status"] == st[h3.name]["status"] == "failed"
    assert len(list((work / ".gpufleet/manifests" / h1.name).glob("*.json"))) == manifests_h1  # no second snapshot
    for h in (h5, h6):
        assert st[h.name]["status"] == "pending" and rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}"

    # 3. fixed; h6 runs a GPU job outside Slurm: the re-run resumes h2, h3, does not redo h1/h4;
    #    h6 is drained, still busy once DRAINED (not a Slurm job), refused and given back
    fail_module_load(h2, False)
    fail_module_load(h3, False)
    rf.sh(h6, "gpusimctl add-process --gpu 1 --pid 777 --name train.py --used-mib 40000")
    done_before = {h.name: (boots(h), rf.sh(h, "grep -c Start-Date /var/log/apt/history.log").stdout.strip())
                   for h in (h1, h4)}
    r = tool(work, "rollout", *args)
    assert r.returncode == 3, r.stdout
    assert re.search(rf"{h6.name}: drain BUSY .*GPU processes still running after 0 s: 777, train.py", r.stdout)
    assert f"{h6.name}: nothing changed, back in service" in r.stdout
    assert slurm.settled_state(slurmctl, h6.name) == ("idle", ""), rf.sh(slurmctl, f"tail -20 {rf.SLURMCTLD_LOG}").stdout
    st = state(work, "second")
    assert [st[h.name]["status"] for h in hosts] == ["done"] * 5 + ["busy"]
    assert rf.version(h6, "nvidia-open") == f"ii {rf.OLD_DEB}"
    for h in (h1, h4):
        assert (boots(h), rf.sh(h, "grep -c Start-Date /var/log/apt/history.log").stdout.strip()) == done_before[h.name]
        assert f"{h.name}: done already, not redone" in r.stdout

    # 4. marked to skip: left alone; then forced while the job runs
    r = tool(work, "rollout", *args, "--skip", h6.name)
    assert r.returncode == 0 and f"{h6.name}: skipped (--skip)" in r.stdout
    assert state(work, "second")[h6.name]["status"] == "skipped"
    r = tool(work, "rollout", *args, "--force")
    assert r.returncode == 0, r.stdout
    assert state(work, "second")[h6.name]["status"] == "done"
    assert rf.version(h6, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(h6) == rf.NEW
    assert rf.holds(h6) == set(rf.HELD)
