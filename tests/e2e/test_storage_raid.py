"""End-to-end (issue 33): md RAID0 scratch across two blank NVMe drives, on a VM test host.

WHY A VM: the container test hosts (test_storage.py) share this machine's kernel, which has no
md; the RAID0 layout needs a kernel of its own. testing/vmhost.py boots Debian's kernel under
qemu, with real systemd, udev, sshd, mdadm and XFS. QEMU'S EMULATED NVMe DRIVES STAND IN FOR
AN HGX's: the guest sees /dev/nvme0n1 ... (TRAN nvme), so ``storage_scratch_devices: auto``
picks them as on real hardware. Three drives, raw image files made here: two blank, one
carrying ext4 (made on its file before boot).

The deploy is the storage area alone (deploys/storage.py, behind validate_inventory), as the
operator runs it: through sudo, tier hgx. In order, on the same VM:

1. a blank drive and the ext4 one listed: refused at planning, naming the ext4 one; nothing
   changes (no array, the blank one still blank, the ext4 drive as it was);
2. ``auto``: the plan view names md RAID0 across the two blank drives and leaves the ext4 one
   alone, saying why; the run makes the array (/proc/mdstat and mdadm --detail: raid0, 2
   devices) with XFS at /scratch, noatime, in fstab by UUID with nofail, owned root:users mode
   3770: a user in the group writes, a second local user outside it cannot; a second run
   changes nothing;
3. a real reboot (systemctl reboot in the guest; qemu resets the machine, the drives persist):
   the array is assembled again and /scratch mounted from it by systemd's fstab mount (udev
   runs here), with gpufleet-scratch.service after it finding it mounted, not mounting it a
   second time; a run after it changes nothing. (With the unit ordered only after
   local-fs.target, as it was, the service won the race and systemd's own mount failed,
   status 32: this test failed on that, measured once.) After the VM stops, the ext4 drive's image
   file is byte-identical (sha256) to what it was before boot.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from testing import testhosts, vmhost
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.test_storage import DEPLOY, file_sha256
from tests.e2e.test_tuning import HGX, sh

pytestmark = [pytest.mark.e2e]

SIZE = 320 << 20  # mkfs.xfs (xfsprogs 6) wants at least 300 MB; RAID0 of two: 640 MB
SERIALS = ("gfscratch0", "gfscratch1", "gfdata")
MD = "/dev/md/gpufleet-scratch"


@pytest.fixture
def vm(hostpool, tmp_path):
    """(VM test host, its three drives); stopped (by its qemu PID) and its files removed at the end."""
    drives = []
    for serial in SERIALS:
        image = tmp_path / f"{serial}.img"
        with open(image, "wb") as fh:
            fh.truncate(SIZE)
        if serial == "gfdata":
            subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "somedata", str(image)], check=True)
        drives.append(vmhost.Drive(image, serial))
    with vmhost.running(hostpool.pool, drives) as host:
        yield host, drives


def test_raid0_scratch_on_two_blank_nvme_drives_survives_reboot(vm, tmp_path_factory):
    host, drives = vm
    t0 = time.monotonic()
    data_hash = file_sha256(drives[2].image)
    by_serial = dict(line.split() for line in sh(host, "lsblk -dn -o SERIAL,PATH").splitlines()
                     if len(line.split()) == 2)  # the root disk (virtio) has no serial
    blank0, blank1, data = (by_serial[s] for s in SERIALS)
    assert sh(host, f"lsblk -dn -o TRAN {blank0} {blank1} {data}").split() == ["nvme"] * 3
    deploy = tmp_path_factory.mktemp("deploy") / "storage_deploy.py"
    deploy.write_text(DEPLOY)
    sh(host, "useradd -m -G users alice && useradd -m bob")  # bob: a second user, not in the group

    def inventory(devices):
        return write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host],
                               data={host.name: {**HGX, "validate_os_release": "debian-12",
                                                 "storage_scratch_devices": devices}})

    def blank_now(device: str) -> bool:
        return testhosts.ssh(host, f"blkid -p {device}", check=False).returncode == 2

    def no_array() -> bool:
        return [line for line in sh(host, "cat /proc/mdstat").splitlines() if line.startswith("md")] == []

    # 1. the drive with data named: refused at planning, naming it; nothing changes
    run = pyinfra(inventory([blank0, data]), str(deploy))
    assert run.returncode != 0
    assert (f"[{host.name}] refused (storage_scratch_devices): {data} is not blank: carries a signature (ext4); "
            "gpufleet never formats a drive that holds data") in run.output, run.output
    assert blank_now(blank0) and blank_now(blank1) and no_array()
    assert not sh(host, "findmnt -n /scratch; true").strip()
    assert sh(host, f"sha256sum {data}").split()[0] == data_hash

    # 2. auto: md RAID0 across the two blank drives, the ext4 one left alone
    inv = inventory("auto")
    plan = pyinfra(inv, "deploys/plan.py")
    # both blank drives, in lsblk's order (whichever that is), the ext4 one left alone
    assert any(f"scratch: md RAID0 ({MD}) across {a}, {b}, XFS on it, mounted at /scratch" in plan.output
               for a, b in ((blank0, blank1), (blank1, blank0))), plan.output
    assert f"scratch: {data} left alone: carries a signature (ext4)" in plan.output, plan.output
    run = pyinfra(inv, str(deploy))
    assert run.returncode == 0, run.output
    uuid = sh(host, f"blkid -p -s UUID -o value {MD}").strip()
    assert uuid and sh(host, f"blkid -p -s TYPE -o value {MD}").strip() == "xfs"

    def check_mounted() -> None:
        array = sh(host, f"readlink -f {MD}").strip()
        name = array.rsplit("/", 1)[1]
        mdstat = {line.split(" : ")[0].strip(): line.split(" : ")[1] for line in sh(host, "cat /proc/mdstat").splitlines()
                  if line.startswith("md")}
        assert mdstat[name].split()[:2] == ["active", "raid0"], mdstat
        assert sorted(m.split("[")[0] for m in mdstat[name].split()[2:]) == sorted(
            [blank0.rsplit("/", 1)[1], blank1.rsplit("/", 1)[1]]), mdstat
        detail = dict(line.strip().split(" : ", 1) for line in sh(host, f"mdadm --detail {MD}").splitlines()
                      if " : " in line)
        assert (detail["Raid Level"], detail["Raid Devices"], detail["Active Devices"]) == ("raid0", "2", "2"), detail
        source, fstype, options = sh(host, "findmnt -n -o SOURCE,FSTYPE,OPTIONS /scratch").split()
        assert (source, fstype) == (array, "xfs") and "noatime" in options.split(",")
        assert len(sh(host, "findmnt -n /scratch").splitlines()) == 1  # mounted once, not twice
        assert sh(host, "stat -c '%U %G %a' /scratch").split() == ["root", "users", "3770"]
        fstab = [line.split() for line in sh(host, "cat /etc/fstab").splitlines() if line.strip()]
        assert ["UUID=" + uuid, "/scratch", "xfs", "noatime,nofail", "0", "0"] in fstab
        assert blank_now(data) is False and sh(host, f"blkid -p -s TYPE -o value {data}").strip() == "ext4"

    check_mounted()
    assert sh(host, "su alice -c 'echo x > /scratch/a && stat -c %G /scratch/a'").strip() == "users"
    assert testhosts.ssh(host, "su bob -c 'echo x > /scratch/b'", check=False).returncode != 0
    assert changed_operations(pyinfra(inv, str(deploy))) == []

    # 3. a real reboot: the array is back and systemd's fstab mount (udev runs in a VM) mounted
    # it; gpufleet-scratch.service ran after that mount and found it mounted
    t_reboot = time.monotonic()
    vmhost.reboot(host)
    print(f"test_storage_raid: reboot in {time.monotonic() - t_reboot:.1f} s")
    check_mounted()
    assert sh(host, "cat /scratch/a").strip() == "x"
    mount_unit = dict(line.split("=", 1) for line in sh(
        host, "systemctl show -p ActiveState -p FragmentPath -p ExecMount scratch.mount").splitlines())
    assert mount_unit["ActiveState"] == "active"
    assert mount_unit["FragmentPath"] == "/run/systemd/generator/scratch.mount"
    assert "status=0" in mount_unit["ExecMount"], mount_unit  # systemd ran mount(8) for it
    service = sorted(sh(host, "systemctl show -p ActiveState -p Result gpufleet-scratch.service").split())
    assert service == ["ActiveState=active", "Result=success"], service
    assert changed_operations(pyinfra(inv, str(deploy))) == []
    print(f"test_storage_raid: test body {time.monotonic() - t0:.0f} s")
    vmhost.stop(host)
    assert file_sha256(drives[2].image) == data_hash
