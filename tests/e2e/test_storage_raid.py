"""End-to-end (issues 33, 44): the scratch on a VM test host: what a site keeps at the scratch
path is never shadowed, md RAID0 across two blank NVMe drives, and a cloud's blank drives.

WHY A VM: the container test hosts (test_storage.py) share this machine's kernel, which has no
md and cannot serve or mount NFS; testing/vmhost.py boots Debian's kernel under qemu, with real
systemd, udev, sshd, mdadm, XFS and an NFS server. QEMU'S EMULATED NVMe DRIVES STAND IN FOR
AN HGX's: the guest sees /dev/nvme0n1 ... (TRAN nvme), so ``storage_scratch_devices: auto``
picks them as on real hardware. Four drives, raw image files made here: two blank, one
carrying ext4 (made on its file before boot), one on which the test makes, by hand in the guest,
an XFS labelled ``gpufleet-scr`` as gpufleet's is: gpufleet did not make it, so it must never
be adopted. THE SITE'S NFS IS A REAL NFS v4 EXPORT OF THE GUEST, MOUNTED FROM ITSELF
(nfs-kernel-server in the image): the kernel's nfs4 client, the mount table's `nfs4` line and
lsblk's blindness to it are those of a cluster's NFS /scratch.

ONE VM BOOT for the three tests, in file order (a VM under emulation costs minutes): the deploy
is the storage area alone (deploys/storage.py, behind validate_inventory), through sudo, tier hgx.
The test's own commands log in as root through one SSH connection (testing/vmhost.py): under
emulation a handshake and sudo's password check cost the guest seconds a command.

1. the site's filesystem at the path, with blank NVMe drives present: NFS mounted at /scratch;
   NFS mounted above the path (storage_scratch_path /scratch/nvme); a /scratch directory holding
   a user's file: each refused at planning naming storage_scratch_path, and the format script
   itself, run on the host as if the state changed after planning, refuses before formatting;
   /etc/fstab byte-identical, every drive's image byte-identical (sha256), no record;
2. ``auto``: the plan view names md RAID0 across the two blank drives and leaves the ext4 one
   and the look-alike alone, saying why; the run makes the array (/proc/mdstat and mdadm
   --detail: raid0, 2 devices) with XFS at /scratch, nosuid,nodev,noatime, in fstab by UUID with
   nofail, the UUID recorded, one ARRAY line in mdadm.conf, owned root:users mode 3770: a user
   in the group writes, a second local user outside it cannot, a set-user-ID copy of a shell
   left there does not run as its owner; a second run changes nothing; a real reboot (systemctl
   reboot; qemu resets the machine, the drives persist): the array is assembled again and
   /scratch mounted by systemd's fstab mount (udev runs here), with gpufleet-scratch.service
   after it finding it mounted; a run after it changes nothing. (With the unit ordered only
   after local-fs.target, as it was, the service won the race and systemd's own mount failed,
   status 32: this test failed on that, measured once.)
3. a cloud's stop/start: the VM powered off, the two scratch drives' images blanked while it is
   off, powered on: systemd waits fstab's 30 s for the lost drive (x-systemd.device-timeout, not
   its default 90 s), gpufleet-scratch.service fails saying why, /scratch is the root disk's sealed
   directory (not writable, even by root), the validation gate fails the scratch naming the lost
   UUID; a run makes it again on the blank drives: one ARRAY line, one fstab line for /scratch,
   the new UUID recorded; a second run changes nothing. The ext4 and look-alike drives'
   images are byte-identical at the end.
"""
from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.facts.storage import SCRATCH_RECORD
from gpufleet.operations import storage as storage_ops
from testing import testhosts, vmhost
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.test_storage import DEPLOY, OPTIONS
from tests.e2e.test_tuning import HGX

pytestmark = [pytest.mark.e2e]

SIZE = 320 << 20  # mkfs.xfs (xfsprogs 6) wants at least 300 MB; RAID0 of two: 640 MB
SERIALS = ("gfscratch0", "gfscratch1", "gfdata", "gflookalike")
MD = "/dev/md/gpufleet-scratch"


def root(host, command: str) -> subprocess.CompletedProcess:
    """`command` run by root's own login on the VM: what the test looks at (the deploys go through
    the deploy user's sudo); sudo's password check costs the emulated guest about a second."""
    return testhosts.ssh(host, command, check=False, user="root")


def sh(host, command: str) -> str:
    result = root(host, command)
    assert result.returncode == 0, f"{command}: {result.stdout}{result.stderr}"
    return result.stdout


@dataclasses.dataclass
class Vm:
    host: testhosts.Host
    drives: list[vmhost.Drive]
    deploy: Path
    folder: Path

    def devices(self) -> dict[str, str]:
        """serial -> device path in the guest (the names may change from one boot to the next)."""
        return dict(line.split() for line in sh(self.host, "lsblk -dn -o SERIAL,PATH").splitlines()
                    if len(line.split()) == 2)  # the root disk (virtio) has no serial

    def inventory(self, devices, path="/scratch") -> Path:
        folder = self.folder / f"inv{time.monotonic_ns()}"
        folder.mkdir()
        return write_inventory(folder / "inventory.py", [self.host],
                               data={self.host.name: {**HGX, "validate_os_release": "debian-12",
                                                      "storage_scratch_devices": devices, "storage_scratch_path": path}})

    def images(self) -> dict[str, str]:
        """Each drive's image file's content digest, read on this machine after the guest synced."""
        sh(self.host, "sync")
        return {drive.serial: image_digest(drive.image) for drive in self.drives}


PIECE = 1 << 16


def image_digest(path: Path) -> str:
    """sha256 of the size and of every piece (64 KiB at a multiple of 64 KiB) of a sparse image
    file that is not all zeros, with its offset: equal exactly when the contents are byte for byte
    (a hole and written zeros read the same), and only the image's data is read (SEEK_DATA), not
    its 320 MB of holes (file_sha256 read them all: seconds an image, a dozen times)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        fd, size, pos = fh.fileno(), os.fstat(fh.fileno()).st_size, 0
        digest.update(f"{size}\n".encode())
        while pos < size:
            try:
                data = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as error:
                if error.errno == errno.ENXIO:  # nothing but a hole after pos
                    break
                raise
            start = max(pos, data // PIECE * PIECE)  # pos: a multiple of PIECE, read already below it
            end = min(size, -(-os.lseek(fd, data, os.SEEK_HOLE) // PIECE) * PIECE)
            for offset in range(start, end, PIECE):
                piece = os.pread(fd, PIECE, offset)
                if piece.count(0) != len(piece):
                    digest.update(f"{offset}\n".encode() + piece)
            pos = end
    return digest.hexdigest()


@pytest.fixture(scope="module")
def vm(hostpool, tmp_path_factory):
    """The VM test host with its four drives, for the file's tests; stopped by its qemu PID at the end."""
    folder = tmp_path_factory.mktemp("raid")
    drives = []
    for serial in SERIALS:
        image = folder / f"{serial}.img"
        with open(image, "wb") as fh:
            fh.truncate(SIZE)
        if serial == "gfdata":
            subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "somedata", str(image)], check=True)
        drives.append(vmhost.Drive(image, serial))
    with vmhost.running(hostpool.pool, drives) as host:
        deploy = folder / "storage_deploy.py"
        deploy.write_text(DEPLOY)
        sh(host, "useradd -m -G users alice && useradd -m bob")  # bob: a second user, not in the group
        # the look-alike: gpufleet's label on a drive gpufleet never made
        sh(host, f"mkfs.xfs -q -L gpufleet-scr {dict(line.split() for line in sh(host, 'lsblk -dn -o SERIAL,PATH').splitlines() if len(line.split()) == 2)['gflookalike']}")
        yield Vm(host, drives, deploy, folder)


def blank_now(host, device: str) -> bool:
    return root(host, f"blkid -p {device}").returncode == 2


def make_script(path: str, *devices: str) -> str:
    """The format command as the deploy sends it (operations/storage.py), for the host itself."""
    return shlex.join(["sh", "-c", storage_ops._MAKE_SCRATCH, "gpufleet-scratch", path, "gpufleet-scr",
                       "gpufleet-scratch", OPTIONS, "", SCRATCH_RECORD, *devices])


def test_a_site_filesystem_or_files_at_the_path_refuse_the_host_and_nothing_changes(vm):
    host, t0 = vm.host, time.monotonic()
    dev = vm.devices()
    blank0, blank1 = dev["gfscratch0"], dev["gfscratch1"]
    assert sh(host, f"lsblk -dn -o TRAN {blank0} {blank1}").split() == ["nvme", "nvme"]
    # the site's NFS: a real export of the guest's, mounted at /scratch from the guest itself
    sh(host, "mkdir -p /srv/site && echo 'the site dataset' > /srv/site/dataset && "
             "echo '/srv/site 127.0.0.1(rw,no_root_squash,no_subtree_check,fsid=1)' > /etc/exports && "
             "systemctl start nfs-server && mkdir -p /scratch && mount -t nfs4 127.0.0.1:/srv/site /scratch")
    assert sh(host, "findmnt -n -o FSTYPE,SOURCE /scratch").split() == ["nfs4", "127.0.0.1:/srv/site"]
    assert "/scratch" not in sh(host, "lsblk -n -o MOUNTPOINT")  # what gpufleet planned from before
    fstab, images = sh(host, "sha256sum /etc/fstab"), vm.images()

    def unchanged() -> None:
        assert sh(host, "sha256sum /etc/fstab") == fstab
        assert vm.images() == images
        assert blank_now(host, blank0) and blank_now(host, blank1)
        assert sh(host, f"test -e {SCRATCH_RECORD} || echo none").strip() == "none"
        assert sh(host, "cat /scratch/dataset; true").strip() in ("the site dataset", "")

    def refused(path: str, problem: str) -> None:
        run = pyinfra(vm.inventory("auto", path), str(vm.deploy))
        assert run.returncode != 0
        assert f"[{host.name}] refused (storage_scratch_path): {path}{problem}" in run.output, run.output
        unchanged()

    # 1. NFS at the path
    refused("/scratch", " is already the mount point of 127.0.0.1:/srv/site (nfs4); gpufleet never mounts the "
                        "scratch over what is there")
    # ... and the format script on the host, as if the NFS had been mounted after planning
    script = root(host, make_script("/scratch", blank0, blank1))
    assert script.returncode == storage_ops.REFUSED_EXIT, script
    assert script.stderr.startswith(f"{storage_ops.REFUSED_MARK} /scratch is already a mount point "
                                    "(127.0.0.1:/srv/site nfs4) (storage_scratch_path): nothing formatted"), script
    unchanged()
    # 2. NFS above the path: /scratch/nvme would be a directory of the site's NFS
    refused("/scratch/nvme", " lies on nfs4 (127.0.0.1:/srv/site mounted at /scratch), a site's shared filesystem")
    script = root(host, make_script("/scratch/nvme", blank0, blank1))
    assert (script.returncode, script.stderr.split(" (storage_scratch_path)")[0]) == (
        storage_ops.REFUSED_EXIT, f"{storage_ops.REFUSED_MARK} /scratch/nvme lies on nfs4 (127.0.0.1:/srv/site /scratch)")
    unchanged()
    # 3. no NFS: /scratch is the root disk's directory, and a user keeps a file there
    sh(host, "umount /scratch && systemctl stop nfs-server && : > /etc/exports && "
             "echo results > /scratch/old-results.txt")
    refused("/scratch", " is a directory that is not empty: its files would be hidden under the scratch")
    script = root(host, make_script("/scratch", blank0, blank1))
    assert script.returncode == storage_ops.REFUSED_EXIT, script
    assert "/scratch is not empty (storage_scratch_path): nothing formatted" in script.stderr, script
    unchanged()
    assert sh(host, "cat /scratch/old-results.txt").strip() == "results"
    sh(host, "rm -r /scratch")  # the operator moves the file away: the next test starts from a host without /scratch
    print(f"test_storage_raid: site refusals in {time.monotonic() - t0:.0f} s")


def test_raid0_scratch_on_two_blank_nvme_drives_survives_reboot(vm):
    host, t0 = vm.host, time.monotonic()
    dev = vm.devices()
    blank0, blank1, data, lookalike = (dev[s] for s in SERIALS)
    kept = {s: h for s, h in vm.images().items() if s in ("gfdata", "gflookalike")}
    lookalike_uuid = sh(host, f"blkid -p -s UUID -o value {lookalike}").strip()

    def no_array() -> bool:
        return [line for line in sh(host, "cat /proc/mdstat").splitlines() if line.startswith("md")] == []

    # 1. the drive with data named: refused at planning, naming it; nothing changes
    run = pyinfra(vm.inventory([blank0, data]), str(vm.deploy))
    assert run.returncode != 0
    assert (f"[{host.name}] refused (storage_scratch_devices): {data} is not blank: carries a signature (ext4); "
            "gpufleet never formats a drive that holds data") in run.output, run.output
    assert blank_now(host, blank0) and blank_now(host, blank1) and no_array()
    assert not sh(host, "findmnt -n /scratch; true").strip()

    # 2. auto: md RAID0 across the two blank drives; the ext4 one and the look-alike left alone
    inv = vm.inventory("auto")
    plan = pyinfra(inv, "deploys/plan.py")
    # both blank drives, in lsblk's order (whichever that is), the others left alone
    assert any(f"scratch: md RAID0 ({MD}) across {a}, {b}, XFS on it, mounted at /scratch" in plan.output
               for a, b in ((blank0, blank1), (blank1, blank0))), plan.output
    assert f"scratch: {data} left alone: carries a signature (ext4)" in plan.output, plan.output
    assert f"scratch: {lookalike} left alone: an XFS labelled gpufleet-scr that gpufleet did not make" in plan.output
    run = pyinfra(inv, str(vm.deploy))
    assert run.returncode == 0, run.output
    uuid = sh(host, f"blkid -p -s UUID -o value {MD}").strip()
    assert uuid and sh(host, f"blkid -p -s TYPE -o value {MD}").strip() == "xfs"
    assert sh(host, f"blkid -p -s UUID -o value {lookalike}").strip() == lookalike_uuid

    def check_mounted() -> None:
        array = sh(host, f"readlink -f {MD}").strip()
        name = array.rsplit("/", 1)[1]
        mdstat = {line.split(" : ")[0].strip(): line.split(" : ")[1] for line in sh(host, "cat /proc/mdstat").splitlines()
                  if line.startswith("md")}
        assert mdstat[name].split()[:2] == ["active", "raid0"], mdstat
        members = [vm.devices()[s].rsplit("/", 1)[1] for s in ("gfscratch0", "gfscratch1")]
        assert sorted(m.split("[")[0] for m in mdstat[name].split()[2:]) == sorted(members), mdstat
        detail = dict(line.strip().split(" : ", 1) for line in sh(host, f"mdadm --detail {MD}").splitlines()
                      if " : " in line)
        assert (detail["Raid Level"], detail["Raid Devices"], detail["Active Devices"]) == ("raid0", "2", "2"), detail
        source, fstype, options = sh(host, "findmnt -n -o SOURCE,FSTYPE,OPTIONS /scratch").split()
        assert (source, fstype) == (array, "xfs") and {"nosuid", "nodev", "noatime"} <= set(options.split(","))
        assert len(sh(host, "findmnt -n /scratch").splitlines()) == 1  # mounted once, not twice
        assert sh(host, "stat -c '%U %G %a' /scratch").split() == ["root", "users", "3770"]
        fstab = [line.split() for line in sh(host, "cat /etc/fstab").splitlines() if line.strip()]
        assert [line for line in fstab if line[1] == "/scratch"] == [["UUID=" + scratch_uuid(), "/scratch", "xfs",
                                                                      OPTIONS, "0", "0"]]
        assert sh(host, f"cat {SCRATCH_RECORD}").strip() == scratch_uuid()
        arrays = [line for line in sh(host, "cat /etc/mdadm/mdadm.conf").splitlines() if line.startswith("ARRAY")]
        assert len(arrays) == 1 and arrays[0].split()[1] == MD, arrays
        assert sh(host, f"blkid -p -s TYPE -o value {vm.devices()['gfdata']}").strip() == "ext4"

    def scratch_uuid() -> str:
        return sh(host, f"blkid -p -s UUID -o value {MD}").strip()

    check_mounted()
    assert sh(host, "su alice -c 'echo x > /scratch/a && stat -c %G /scratch/a'").strip() == "users"
    assert root(host, "su bob -c 'echo x > /scratch/b'").returncode != 0
    # nosuid: a set-user-ID root shell left on the scratch gives a user no root
    sh(host, "cp /bin/bash /scratch/rootsh && chmod 4755 /scratch/rootsh")
    assert sh(host, "su alice -c '/scratch/rootsh -p -c id\\ -u'").strip() != "0"
    sh(host, "rm /scratch/rootsh")
    assert changed_operations(pyinfra(inv, str(vm.deploy))) == []

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
    assert changed_operations(pyinfra(inv, str(vm.deploy))) == []
    assert {s: h for s, h in vm.images().items() if s in kept} == kept
    print(f"test_storage_raid: test body {time.monotonic() - t0:.0f} s")


def test_drives_blanked_by_a_cloud_stop_start_fail_loudly_then_a_run_makes_the_scratch_again(vm):
    host, t0 = vm.host, time.monotonic()
    inv = vm.inventory("auto")
    if not sh(host, "findmnt -n /scratch; true").strip():  # the test above did not run: make the scratch
        assert pyinfra(inv, str(vm.deploy)).returncode == 0
    old_uuid = sh(host, f"cat {SCRATCH_RECORD}").strip()
    kept = {s: h for s, h in vm.images().items() if s in ("gfdata", "gflookalike")}

    def blank_the_instance_store() -> None:
        for drive in vm.drives[:2]:
            with open(drive.image, "r+b") as fh:
                fh.truncate(0)
                fh.truncate(SIZE)

    vmhost.power_cycle(host, vm.drives, blank_the_instance_store)
    print(f"test_storage_raid: stop/start in {time.monotonic() - t0:.0f} s")
    dev = vm.devices()
    assert blank_now(host, dev["gfscratch0"]) and blank_now(host, dev["gfscratch1"])
    # the unit failed, saying why; nothing is mounted and the root disk's /scratch takes no file
    deadline = time.monotonic() + 180  # systemd's fstab mount waits for the device first (30 s)
    while sh(host, "systemctl show -p ActiveState --value gpufleet-scratch.service").strip() not in ("failed", "active"):
        assert time.monotonic() < deadline, sh(host, "systemctl status gpufleet-scratch.service; true")
        time.sleep(2)
    assert sh(host, "systemctl show -p ActiveState --value gpufleet-scratch.service").strip() == "failed"
    journal = sh(host, "journalctl -b -u gpufleet-scratch.service --no-pager")
    assert "gpufleet-scratch-mount: FAILED: nothing mounted at /scratch" in journal, journal
    # systemd gave the lost drive fstab's 30 s (x-systemd.device-timeout), not its default 90 s
    device = sh(host, f"systemd-escape --path --suffix=device /dev/disk/by-uuid/{old_uuid}").strip()
    assert sh(host, f"systemctl show -p JobRunningTimeoutUSec --value {shlex.quote(device)}").strip() == "30s"
    assert "Timed out waiting for device" in sh(host, f"journalctl -b --no-pager -u {shlex.quote(device)}"), device
    assert not sh(host, "findmnt -n /scratch; true").strip()
    assert sh(host, "stat -c '%U %a' /scratch").split() == ["root", "0"]
    assert root(host, "su alice -c 'touch /scratch/x'").returncode != 0
    assert root(host, "touch /scratch/x").returncode != 0  # immutable: not even root
    # the gate says so
    gate = pyinfra(inv, "deploys/validate.py")  # other areas fail here (no driver): read storage's
    lines = [line for line in gate.output.splitlines() if "] storage: the local scratch is mounted" in line]
    assert len(lines) == 1 and "[FAIL]" in lines[0], gate.output
    assert f"gpufleet's scratch (UUID {old_uuid}, recorded when it was made) is on no drive now" in lines[0]
    assert "gpufleet-scratch.service failed at boot" in lines[0]
    # a run makes it again on the blank drives: one ARRAY line, one fstab line, the new UUID recorded
    run = pyinfra(inv, str(vm.deploy))
    assert run.returncode == 0, run.output
    uuid = sh(host, f"blkid -p -s UUID -o value {MD}").strip()
    assert uuid and uuid != old_uuid and sh(host, f"cat {SCRATCH_RECORD}").strip() == uuid
    options = sh(host, "findmnt -n -o OPTIONS /scratch").strip().split(",")
    assert {"nosuid", "nodev", "noatime"} <= set(options)
    fstab = [line.split() for line in sh(host, "cat /etc/fstab").splitlines() if line.strip()]
    assert [line for line in fstab if line[1] == "/scratch"] == [["UUID=" + uuid, "/scratch", "xfs", OPTIONS, "0", "0"]]
    arrays = [line for line in sh(host, "cat /etc/mdadm/mdadm.conf").splitlines() if line.startswith("ARRAY")]
    assert len(arrays) == 1 and arrays[0].split()[1] == MD, arrays
    assert sh(host, "stat -c '%U %G %a' /scratch").split() == ["root", "users", "3770"]
    assert changed_operations(pyinfra(inv, str(vm.deploy))) == []
    assert {s: h for s, h in vm.images().items() if s in kept} == kept
    print(f"test_storage_raid: cloud stop/start test {time.monotonic() - t0:.0f} s")
