"""End-to-end: tools/rollout takes a real btrfs snapshot before the package change, tools/rollback
--disk-snapshot puts the subvolume back from it, and a snapshot that fails stops its host before
any package changes.

The test hosts are containers on an overlay root, so the btrfs file system is a loop device of
the machine, mounted into the first host's root before it boots (the harness reboots it once,
and every later boot sees the mount); its subvolume /srv/gpufleet-disk/data is that host's
rollout_snapshot_target. The second host's target is a plain directory, not a btrfs subvolume:
its snapshot fails, as a misconfigured one would.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from tests.e2e import rollout_fleet as rf

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
MOUNT = "/srv/gpufleet-disk"
TARGET = f"{MOUNT}/data"


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def fleet(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    if os.geteuid() != 0 or not shutil.which("losetup") or not shutil.which("mkfs.btrfs"):
        pytest.skip("needs root, losetup and mkfs.btrfs (apt-get install btrfs-progs)")
    snapped, plain = hosts = hostpool.get("rollout-btrfs", 2, release="bookworm", gpu=rf.GPU)
    work = tmp_path_factory.mktemp("disk")
    image = work / "disk.img"
    with open(image, "wb") as f:
        f.truncate(400 * 1024 * 1024)
    mnt = snapped.root / MOUNT.lstrip("/")
    try:
        run("mkfs.btrfs", "-q", "-f", str(image))
        mnt.mkdir(parents=True, exist_ok=True)
        # mount -o loop: the loop device goes with the mount (autoclear), also when the harness
        # tears the host down after a killed run (it unmounts everything under the host)
        run("mount", "-o", "loop", str(image), str(mnt))
        run("btrfs", "subvolume", "create", str(mnt / "data"))
        (mnt / "data/marker").write_text("before the upgrade\n")
        for h in hosts:   # the hosts' own btrfs tools (before the driver's preparation narrows apt's lists)
            rf.sh(h, "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends btrfs-progs >/dev/null")
        rf.sh(plain, f"mkdir -p {TARGET} && echo 'not a subvolume' > {TARGET}/marker")
        rf.prepare_all(hosts, aptrepo)        # reboots: the first host now sees the btrfs mount
        assert rf.sh(snapped, f"findmnt -n -o FSTYPE {MOUNT}").stdout.strip() == "btrfs"
        rf.inventory(work / "disk.py", hosts, aptrepo, extra={
            h.name: {"rollout_snapshot": "btrfs", "rollout_snapshot_target": TARGET} for h in hosts})
        yield snapped, plain, work, mnt
    finally:
        run("umount", str(mnt), check=False)
        image.unlink(missing_ok=True)


def tool(work: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "tools" / name), "-y", *args], cwd=work, capture_output=True, text=True, timeout=900)
    print(proc.stdout, proc.stderr)
    return proc


def test_snapshot_before_the_upgrade_failed_snapshot_stops_its_host(fleet):
    snapped, plain, work, mnt = fleet
    apt_before = rf.sh(plain, "grep -c Start-Date /var/log/apt/history.log").stdout
    holds_before = rf.holds(plain)
    r = tool(work, "rollout", "disk.py", "--driver-version", rf.NEW, "--canary", "1", "--batch-size", "1")
    st = json.loads((work / ".gpufleet/rollouts/disk.json").read_text())["hosts"]

    # the first host: a real read-only btrfs snapshot, taken before its packages changed
    assert st[snapped.name]["status"] == "done", r.stdout
    manifest = json.loads((work / st[snapped.name]["manifest"]).read_text())
    disk = manifest["disk_snapshot"]
    assert disk["provider"] == "btrfs" and disk["target"] == TARGET
    assert disk["name"] == f"{TARGET}/.gpufleet-snapshots/gpufleet-{manifest['id']}"
    assert rf.sh(snapped, f"cat {disk['name']}/marker").stdout == "before the upgrade\n"
    assert rf.sh(snapped, f"btrfs property get -ts {disk['name']} ro").stdout.strip() == "ro=true"
    listed = run("btrfs", "subvolume", "list", str(mnt)).stdout      # seen from the machine too
    assert f"data/.gpufleet-snapshots/gpufleet-{manifest['id']}" in listed
    assert rf.version(snapped, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(snapped) == rf.NEW

    # the second host: its snapshot failed, so nothing of its packages changed
    assert st[plain.name]["status"] == "failed" and "snapshot failed" in st[plain.name]["message"], r.stdout
    assert "upgrade" not in st[plain.name]["steps"]
    assert r.returncode == 1 and "STOPPED" in r.stdout
    for pkg in ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager"):
        assert rf.version(plain, pkg) == f"ii {rf.OLD_DEB}", pkg
    assert rf.version(plain, f"nvidia-driver-pinning-{rf.OLD}") == f"ii {rf.OLD_DEB}"
    assert rf.sh(plain, "grep -c Start-Date /var/log/apt/history.log").stdout == apt_before
    assert rf.holds(plain) == holds_before == set(rf.HELD)
    assert rf.loaded(plain) == rf.OLD


def test_rollback_from_the_disk_snapshot(fleet):
    snapped, plain, work, mnt = fleet
    rf.sh(snapped, f"echo 'after the upgrade' > {TARGET}/marker")
    r = tool(work, "rollback", "disk.py", snapped.name, "--disk-snapshot", "--reboot")
    assert r.returncode == 0, r.stdout + r.stderr
    # the subvolume is the snapshot's content again; what it was is kept next to it
    assert rf.sh(snapped, f"cat {TARGET}/marker").stdout == "before the upgrade\n"
    replaced = rf.sh(snapped, f"ls -d {TARGET}.gpufleet-replaced-*").stdout.split()
    assert len(replaced) == 1
    assert rf.sh(snapped, f"cat {replaced[0]}/marker").stdout == "after the upgrade\n"
    assert rf.sh(snapped, f"btrfs property get -ts {TARGET} ro").stdout.strip() == "ro=false"
    # and the packages are back too
    assert rf.version(snapped, "nvidia-open") == f"ii {rf.OLD_DEB}" and rf.loaded(snapped) == rf.OLD
    assert rf.holds(snapped) == set(rf.HELD)
