"""The lvm snapshot provider on a real device-mapper: a VM test host (testing/vmhost.py, Debian's
own kernel; qemu emulates only the machine and an NVMe drive).

tests/e2e/test_rollout_snapshots.py runs the providers' commands on the controller against loop
devices, and skips LVM where the kernel has no device-mapper (this machine and CI's). Here the
snapshot is taken by gpufleet's own operation (operations/snapshot.py's disk_snapshot_taken, the
command the rollout's upgrade sends), through pyinfra, SSH and sudo, on a logical volume holding
a mounted filesystem; then the restore the manifest records for it (`lvconvert --merge`, then a
reboot) is followed as an operator would, and the volume is back to its state at the snapshot.
"""
from __future__ import annotations

import shlex
import textwrap
import time

import pytest

from gpufleet.rollout import snapshot as snap
from testing import vmhost
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.test_tuning import sh

pytestmark = [pytest.mark.e2e]

SERIAL = "gflvm0"
SIZE = 320 << 20
VG, LV = "gfvg", "root"
IDENT = "20261205T000000Z"
MOUNT = "/mnt/gflv"
DEPLOY = textwrap.dedent(f"""\
    from gpufleet.operations.snapshot import disk_snapshot_taken

    disk_snapshot_taken(name="Take the disk snapshot before the upgrade", provider="lvm",
                        target="{VG}/{LV}", ident="{IDENT}", size="64M", record={{}})
    """)


@pytest.fixture
def vm(hostpool, tmp_path):
    """A VM test host with one blank emulated NVMe drive; stopped by its qemu PID at the end."""
    image = tmp_path / f"{SERIAL}.img"
    with open(image, "wb") as fh:
        fh.truncate(SIZE)
    with vmhost.running(hostpool.pool, [vmhost.Drive(image, SERIAL)], name="vmlvm") as host:
        yield host


def lvs(host) -> dict[str, str]:
    """{LV name: its attributes} of the test's volume group."""
    rows = sh(host, f"lvs --noheadings -o lv_name,lv_attr {VG}").split()
    return dict(zip(rows[::2], rows[1::2]))


def test_lvm_snapshot_by_gpufleets_operation_and_its_restore_after_a_reboot(vm, tmp_path):
    host = vm
    t0 = time.monotonic()
    drive = dict(line.split() for line in sh(host, "lsblk -dn -o SERIAL,PATH").splitlines()
                 if len(line.split()) == 2)[SERIAL]
    assert sh(host, "dmsetup version").startswith("Library version")  # a real device-mapper
    sh(host, f"pvcreate -q {drive} && vgcreate -q {VG} {drive} && lvcreate -q -L 160M -n {LV} {VG} "
             f"&& mkfs.ext4 -q /dev/{VG}/{LV} && mkdir -p {MOUNT} && mount /dev/{VG}/{LV} {MOUNT} "
             f"&& echo 'before the upgrade' > {MOUNT}/marker && sync")

    # 1. the snapshot, as the rollout's upgrade takes it: gpufleet's operation, through pyinfra
    # (SSH, then sudo as the test hosts' deploy user)
    deploy = tmp_path / "snapshot_deploy.py"
    deploy.write_text(DEPLOY)
    inventory = write_inventory(tmp_path / "inventory.py", [host])
    run = pyinfra(inventory, str(deploy))
    assert run.returncode == 0, run.output
    assert changed_operations(run) == ["Take the disk snapshot before the upgrade"], run.output
    name = snap.snapshot_name(IDENT)
    volumes = lvs(host)
    assert set(volumes) == {LV, name}, volumes
    assert volumes[name].startswith("s"), volumes  # a snapshot (lv_attr's first letter)
    assert sh(host, f"lvs --noheadings -o origin {VG}/{name}").strip() == LV

    # 2. the upgrade changes the volume
    sh(host, f"echo 'after the upgrade' > {MOUNT}/marker && sync")

    # 3. the restore the manifest records for it, followed by hand: the merge waits for the
    # origin to be closed, so at the next activation, after the reboot
    restore = snap.host_snapshot("lvm", f"{VG}/{LV}", IDENT, "64M").restore
    command, _, then = restore.partition("#")
    assert "then reboot" in then
    assert shlex.split(command) == ["lvconvert", "--merge", f"{VG}/{name}"]
    sh(host, command)
    assert sh(host, f"cat {MOUNT}/marker").strip() == "after the upgrade"  # not yet: the origin is open
    vmhost.reboot(host)
    sh(host, f"vgchange -q -ay {VG} >/dev/null")  # activated at boot already, or now: the merge runs
    deadline = time.monotonic() + 120
    while name in lvs(host) and time.monotonic() < deadline:
        time.sleep(1)
    assert set(lvs(host)) == {LV}, "the snapshot was not merged into its origin"
    sh(host, f"mkdir -p {MOUNT} && mount /dev/{VG}/{LV} {MOUNT}")
    assert sh(host, f"cat {MOUNT}/marker").strip() == "before the upgrade"
    sh(host, f"umount {MOUNT}")
    print(f"test_rollout_lvm_vm: test body {time.monotonic() - t0:.0f} s")
