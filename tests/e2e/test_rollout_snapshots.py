"""The lvm and btrfs snapshot providers' exact commands, run for real on the controller against
loop devices (the test hosts are containers: no block devices). LVM needs the kernel's
device-mapper; where it is missing (as in the CI container) that test is skipped with the reason
and the commands are covered by tests/unit/test_rollout_snapshot.py.
tests/e2e/test_rollout_lvm_vm.py proves LVM on a VM test host, whose Debian kernel has it."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from gpufleet.rollout import snapshot as snap

pytestmark = pytest.mark.e2e


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


@pytest.fixture
def loopdev(tmp_path):
    if os.geteuid() != 0 or not shutil.which("losetup"):
        pytest.skip("needs root and losetup")
    image = tmp_path / "disk.img"
    with open(image, "wb") as f:
        f.truncate(300 * 1024 * 1024)
    dev = run("losetup", "--find", "--show", str(image)).stdout.strip()
    yield dev
    run("losetup", "-d", dev, check=False)


def test_btrfs_provider_snapshots_a_subvolume(loopdev, tmp_path):
    if not shutil.which("mkfs.btrfs"):
        pytest.skip("btrfs-progs is not installed (apt-get install btrfs-progs)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    run("mkfs.btrfs", "-q", "-f", loopdev)
    run("mount", loopdev, str(mnt))
    try:
        run("btrfs", "subvolume", "create", str(mnt / "root"))
        (mnt / "root/etc").mkdir()
        (mnt / "root/etc/marker").write_text("before the upgrade\n")
        plan = snap.host_snapshot("btrfs", str(mnt / "root"), "20260101T000000Z")
        for argv in plan.commands:            # exactly what the operation runs on a host
            run(*argv)
        (mnt / "root/etc/marker").write_text("after the upgrade\n")
        snapped = Path(plan.name)
        assert snapped == mnt / "root/.gpufleet-snapshots/gpufleet-20260101T000000Z"
        assert (snapped / "etc/marker").read_text() == "before the upgrade\n"
        assert "readonly" in run("btrfs", "property", "get", str(snapped), "ro").stdout.replace("ro=true", "readonly")
        listed = run("btrfs", "subvolume", "list", str(mnt)).stdout
        assert "gpufleet-20260101T000000Z" in listed
    finally:
        run("umount", str(mnt), check=False)


def test_lvm_provider_snapshots_a_logical_volume(loopdev):
    if not shutil.which("lvcreate"):
        pytest.skip("lvm2 is not installed (apt-get install lvm2)")
    if run("dmsetup", "version", check=False).returncode != 0:
        pytest.skip("the kernel has no device-mapper here (/dev/mapper/control): LVM snapshots cannot be made; "
                    "the exact commands are checked in tests/unit/test_rollout_snapshot.py, and run on a VM test host "
                    "in tests/e2e/test_rollout_lvm_vm.py")
    vg = f"gftest{os.getpid()}"
    run("pvcreate", "-q", loopdev)
    try:
        run("vgcreate", "-q", vg, loopdev)
        run("lvcreate", "-q", "-L", "100M", "-n", "root", vg)
        plan = snap.host_snapshot("lvm", f"{vg}/root", "20260101T000000Z", "40M")
        for argv in plan.commands:
            run(*argv)
        lvs = run("lvs", "--noheadings", "-o", "lv_name,origin", vg).stdout
        assert "gpufleet-20260101T000000Z" in lvs and "root" in lvs
    finally:
        run("vgremove", "-f", "-q", vg, check=False)
        run("pvremove", "-q", loopdev, check=False)
