"""End-to-end (issue 33): local scratch and /dev/shm from the tier, on ONE test host.

LOOP DEVICES STAND IN FOR NVMe DRIVES: the test makes two loop devices on files in a temp
folder of this machine and binds exactly those two nodes into a host of its own
(testhosts.up(devices=...)); nothing else of the machine's block devices has a node there. One
is blank; the other carries an ext4 filesystem made on its file before. They are named in
``storage_scratch_devices`` (auto takes NVMe disks only). The test host is a systemd-nspawn
container: it shares this machine's kernel, which has no md, so the md RAID0 layout (two
drives) runs in test_storage_raid.py, on a VM test host with a kernel of its own; and without
udev, systemd's fstab generator ignores device entries in a container, so at boot
gpufleet-scratch.service mounts what fstab lists (on a host with udev, as in the VM, systemd's
fstab mount does it and the service, ordered after it, finds it mounted).

The deploy is the storage area alone (deploys/storage.py, behind validate_inventory), as the
operator runs it: through sudo, tier hgx. In order, on the same host:

1. both drives listed: refused at planning, naming the ext4 one; nothing changes (the blank
   one is still blank, the other byte-identical); the format command itself, run on the host
   with both drives (as if the ext4 had appeared after planning), refuses naming it, touching
   neither; nor, with the blank drive alone, while a process holds that drive open;
2. the blank drive only (the plan view names it first): XFS on it, mounted at /scratch with
   nosuid,nodev,noatime, in fstab by UUID with nofail, its UUID recorded, owned by root:users (hgx's group) mode 3770: a user in the group writes there, a
   second local user outside it cannot; /dev/shm at half of RAM (hgx's storage_shm_size), now
   and in fstab; a second run changes nothing;
3. a real reboot of the test host: /scratch and the /dev/shm size are back; a run after it
   changes nothing. The ext4 drive is byte-identical at the end. The validation gate passes the
   scratch and /dev/shm, and fails the scratch once it is unmounted; the root disk's /scratch
   under it is then sealed (mode 0: a user cannot write there).
"""
from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import textwrap
import time

import pytest

from testing import testhosts
from gpufleet.facts.storage import SCRATCH_RECORD
from gpufleet.operations import storage as storage_ops
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.test_tuning import HGX, sh

pytestmark = [pytest.mark.e2e]

DEPLOY = textwrap.dedent("""\
    from pyinfra import state
    from gpufleet.deploys.storage import storage
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    storage()
    """)
SIZE = 320 << 20  # mkfs.xfs (xfsprogs 6) wants at least 300 MB
OPTIONS = "nosuid,nodev,noatime,nofail,x-systemd.device-timeout=30s"  # fstab's options of the scratch


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file or a block device, read whole (a drive must come out byte-identical)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def drives(tmp_path):
    """(blank loop device, loop device with ext4); detached at the end, each by its name."""
    made: list[str] = []
    try:
        for name, fs in (("blank.img", None), ("ext4.img", "ext4")):
            backing = tmp_path / name
            with open(backing, "wb") as fh:
                fh.truncate(SIZE)
            if fs:
                subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "somedata", str(backing)], check=True)
            made.append(subprocess.run(["losetup", "--find", "--show", str(backing)], check=True,
                                       capture_output=True, text=True).stdout.strip())
        yield made[0], made[1]
    finally:
        for device in made:
            subprocess.run(["losetup", "-d", device], check=False)


def test_scratch_on_a_blank_drive_refuses_one_with_data_survives_reboot(hostpool, drives, tmp_path_factory,
                                                                         monkeypatch):
    blank, data = drives
    monkeypatch.setenv("GPUFLEET_VALIDATE_PROBE", "0")  # the gate below: no DCGM or performance probe
    data_hash = file_sha256(data)
    t0 = time.monotonic()
    (host,) = testhosts.up(1, pool=hostpool.pool, devices=[blank, data])
    try:
        deploy = tmp_path_factory.mktemp("deploy") / "storage_deploy.py"
        deploy.write_text(DEPLOY)
        sh(host, "useradd -m -G users alice && useradd -m bob")  # bob: a second user, not in the group

        def inventory(devices, path="/scratch"):
            return write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host],
                                   data={host.name: {**HGX, "validate_os_release": "debian-12",
                                                     "storage_scratch_devices": devices,
                                                     "storage_scratch_path": path}})

        def blank_now(device: str) -> bool:
            return testhosts.ssh(host, f"blkid -p {device}", check=False).returncode == 2

        # 1. the drive with data named: refused at planning, naming it; nothing changes
        run = pyinfra(inventory([blank, data]), str(deploy))
        assert run.returncode != 0
        assert (f"[{host.name}] refused (storage_scratch_devices): {data} is not blank: carries a signature (ext4); "
                "gpufleet never formats a drive that holds data") in run.output, run.output
        assert blank_now(blank) and not sh(host, "findmnt -n /scratch; true").strip()
        assert file_sha256(data) == data_hash
        # ... and the format command itself, given the drive as if it gained ext4 after planning
        # (with the blank one first), refuses on the host, naming it, before touching either
        sh(host, "apt-get install -y -q --no-install-recommends xfsprogs >/dev/null")
        script = shlex.join(["sh", "-c", storage_ops._MAKE_SCRATCH, "gpufleet-scratch", "/scratch", "gpufleet-scr",
                             "gpufleet-scratch", OPTIONS, "", SCRATCH_RECORD, blank, data])
        refused = testhosts.ssh(host, script, check=False)
        assert refused.returncode == storage_ops.REFUSED_EXIT, refused
        assert refused.stderr.startswith(f"{storage_ops.REFUSED_MARK} {data} is not blank now (blkid -p exit 0: "), refused
        assert blank_now(blank) and file_sha256(data) == data_hash
        # ... and a drive a process holds open (a benchmark reading it) is not formatted either
        holder = sh(host, f"setsid sh -c 'exec 3<{blank}; exec sleep 300' >/dev/null 2>&1 & echo $!").strip()
        only_blank = shlex.join(["sh", "-c", storage_ops._MAKE_SCRATCH, "gpufleet-scratch", "/scratch", "gpufleet-scr",
                                 "gpufleet-scratch", OPTIONS, "", SCRATCH_RECORD, blank])
        refused = testhosts.ssh(host, only_blank, check=False)
        sh(host, f"kill {holder}")
        assert refused.returncode == storage_ops.REFUSED_EXIT, refused
        assert refused.stderr.startswith(f"{storage_ops.REFUSED_MARK} {blank} is held open by process {holder}/"), refused
        assert blank_now(blank) and sh(host, f"test -e {SCRATCH_RECORD} || echo none").strip() == "none"

        # 2. the blank drive: XFS at /scratch, group users, fstab by UUID; /dev/shm half of RAM.
        # The mount point was made by hand already, with the right owner: the new filesystem's
        # root (root:root 755 from mkfs) must get the group and mode all the same
        sh(host, "mkdir /scratch && chown root:users /scratch && chmod 3770 /scratch")
        inv = inventory([blank])
        plan = pyinfra(inv, "deploys/plan.py")  # what the operator reads before a drive is formatted
        assert f"scratch: XFS on {blank}, mounted at /scratch" in plan.output, plan.output
        assert "shm: /dev/shm size=50%, now and at boot" in plan.output, plan.output
        run = pyinfra(inv, str(deploy))
        assert run.returncode == 0, run.output
        uuid = sh(host, f"blkid -p -s UUID -o value {blank}").strip()
        assert sh(host, f"blkid -p -s TYPE -o value {blank}").strip() == "xfs"

        def pages_now() -> int:  # bytes; tmpfs rounds 50% of RAM UP to whole pages
            pages = int(sh(host, "awk '/^MemTotal:/ {print $2}' /proc/meminfo")) // 4
            return -(-pages * 50 * 4096 // 100 // 4096) * 4096

        def check_mounted() -> None:
            source, fstype, options = sh(host, "findmnt -n -o SOURCE,FSTYPE,OPTIONS /scratch").split()
            assert (source, fstype) == (blank, "xfs") and {"nosuid", "nodev", "noatime"} <= set(options.split(","))
            assert sh(host, "stat -c '%U %G %a' /scratch").split() == ["root", "users", "3770"]
            fstab = [line.split() for line in sh(host, "cat /etc/fstab").splitlines() if line.strip()]
            assert ["UUID=" + uuid, "/scratch", "xfs", OPTIONS, "0", "0"] in fstab
            assert ["tmpfs", "/dev/shm", "tmpfs", "rw,nosuid,nodev,size=50%", "0", "0"] in fstab
            pages = pages_now() // 4096
            assert sh(host, "stat -f -c '%T %b %S' /dev/shm").split() == ["tmpfs", str(pages), "4096"]

        check_mounted()
        assert sh(host, "su alice -c 'echo x > /scratch/a && stat -c %G /scratch/a'").strip() == "users"
        assert testhosts.ssh(host, "su bob -c 'echo x > /scratch/b'", check=False).returncode != 0
        assert changed_operations(pyinfra(inv, str(deploy))) == []

        # 3. a real reboot: mounted again, /dev/shm sized again; then a run changes nothing
        testhosts.reboot(host)
        check_mounted()
        assert sh(host, "cat /scratch/a").strip() == "x"
        assert changed_operations(pyinfra(inv, str(deploy))) == []
        assert file_sha256(data) == data_hash

        # the gate reads the same plan from the host as it is: passes, then fails once unmounted
        def storage_lines() -> list[str]:
            gate = pyinfra(inv, "deploys/validate.py")  # other areas fail here (no driver): read storage's
            return [line.split(f"[{host.name}] ", 1)[1] for line in gate.output.splitlines()
                    if f"[{host.name}] [" in line and "] storage: " in line]

        assert storage_lines() == [
            f"[PASS] storage: the local scratch is mounted where the tier says: /scratch: XFS {uuid} on {blank} (mounted)",
            f"[PASS] storage: /dev/shm has the size the tier sets: size=50%: /dev/shm is {pages_now()} bytes, "
            f"size=50% gives {pages_now()}"]
        sh(host, "umount /scratch")
        # the root disk's directory under it is sealed: no job writes there while it is not mounted
        assert sh(host, "stat -c '%U %a' /scratch").split() == ["root", "0"]
        assert testhosts.ssh(host, "su alice -c 'touch /scratch/x'", check=False).returncode != 0
        assert sh(host, f"cat {SCRATCH_RECORD}").strip() == uuid  # the UUID gpufleet adopts
        assert storage_lines()[0] == (f"[FAIL] storage: the local scratch is mounted where the tier says: gpufleet's "
                                      f"scratch on {blank} is not mounted at /scratch -> fix: run deploys/all.py "
                                      f"(it mounts it); if a drive failed, see dmesg and mdadm --detail {blank}")

        # 4. storage_scratch_path changed while /scratch is mounted (and may be in use): mounted at
        # /data now, fstab's line moved (not a second one), /scratch left mounted and said; from
        # the next boot /data only; each second run changes nothing
        sh(host, "mount /scratch")
        moved = inventory([blank], "/data")
        run = pyinfra(moved, str(deploy), "-v")  # -v: what is said besides the warnings
        assert run.returncode == 0, run.output
        assert run.output.count(f"{blank} is still mounted at /scratch too: the scratch moved to /data") == 1, run.output

        def mounts() -> dict[str, str]:
            return dict(line.split() for line in sh(host, "findmnt -n -l -o TARGET,SOURCE -t xfs").splitlines())

        def scratch_fstab() -> list[list[str]]:
            return [line.split() for line in sh(host, "cat /etc/fstab").splitlines() if line.startswith("UUID=" + uuid)]

        assert mounts() == {"/scratch": blank, "/data": blank}
        assert scratch_fstab() == [["UUID=" + uuid, "/data", "xfs", OPTIONS, "0", "0"]]
        assert sh(host, "stat -c '%U %G %a' /data").split() == ["root", "users", "3770"]
        assert sh(host, "cat /data/a").strip() == "x"
        assert changed_operations(pyinfra(moved, str(deploy))) == []
        testhosts.reboot(host)
        assert mounts() == {"/data": blank}
        assert scratch_fstab() == [["UUID=" + uuid, "/data", "xfs", OPTIONS, "0", "0"]]
        assert changed_operations(pyinfra(moved, str(deploy))) == []
        assert file_sha256(data) == data_hash
    finally:
        testhosts.stop(host)
    print(f"test_storage: {time.monotonic() - t0:.0f} s")
