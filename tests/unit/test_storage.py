"""gpufleet/plans/storage.py: which drives become the scratch, on recorded lsblk -J output of real hosts
(tests/fixtures/storage/README.md says where each comes from) and on the written HGX-shaped
layout; /dev/shm's size as tmpfs computes it; the preflight's NVMe capacity; the keys' grammar.

md RAID0 is not run end to end on this machine (its kernel has no md): the plan that picks
RAID0 and the exact command it sends are checked here; tests/e2e/test_storage.py runs the
one-drive XFS layout and the on-host refusal for real.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from gpufleet.plans import storage as s
from gpufleet.facts.storage import (BLANK, BlockDevicesData, Mount, ScratchSiteData, ShmData, parse_block_devices,
                                    parse_shm)
from gpufleet.config.schema import KEYS, BadValue
from gpufleet.config.failures import Refused

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "storage"


def recorded(name: str) -> BlockDevicesData:
    return parse_block_devices((FIXTURES / name).read_text().splitlines())


HGX = "lsblk-probe-hgx-shape-written.txt"
#: a path with nothing around it: the root filesystem at /, no fstab line, no record, absent
ROOT_ONLY = ScratchSiteData(mounts=(Mount("/", "ext4", "/dev/nvme1n1p2", ("rw", "relatime")),), path_state="absent")
MOUNTED_UUID = "0d485266-04d3-424a-8b42-bbb17499422c"  # lsblk-probe-nspawn-scratch-mounted.txt
LOOP_XFS_UUID = "301e838e-55de-4f2a-8d3b-a284eed19954"  # lsblk-probe-nspawn-loop-xfs.txt


def planned(setting, wanted, path, devices, site: ScratchSiteData = ROOT_ONLY) -> s.ScratchPlan:
    return s.plan_scratch(setting, wanted, path, devices, lambda: site)


def at(path: str, fstype: str, source: str, *options: str) -> Mount:
    return Mount(path, fstype, source, options or ("rw", "nosuid", "nodev", "noatime"))
DATA_DRIVES = tuple(f"/dev/nvme{n}n1" for n in range(2, 10))


def test_the_hgx_layout_makes_one_raid0_of_the_eight_blank_drives_and_leaves_the_system_alone():
    plan = planned("auto", "auto", "/scratch", recorded(HGX))
    assert (plan.action, plan.layout, plan.devices) == (s.MAKE, "raid0", DATA_DRIVES)
    assert plan.notes == (
        "/dev/nvme0n1 left alone: has a partition table (gpt); mounted at /boot/efi, /; "
        "holds nvme0n1p1 (part), nvme0n1p2 (part)",
        "/dev/nvme1n1 left alone: has a partition table (gpt); mounted at /; holds nvme1n1p1 (part), nvme1n1p2 (part)")
    assert plan.summary() == (f"md RAID0 (/dev/md/gpufleet-scratch) across {', '.join(DATA_DRIVES)}, XFS on it, "
                              "mounted at /scratch")


def test_a_blank_network_volume_presented_as_nvme_is_never_taken_by_auto():
    """EC2 presents EBS volumes as NVMe namespaces, model "Amazon Elastic Block Store" (its local
    instance store: "Amazon EC2 NVMe Instance Storage"; README.md here): a blank EBS volume
    attached for something else is left alone, named, and not counted as scratch capacity."""
    hgx = recorded(HGX)
    ebs = tuple(replace(d, model="Amazon Elastic Block Store") if d.path == "/dev/nvme9n1" else
                replace(d, model="Amazon EC2 NVMe Instance Storage") if d.path in DATA_DRIVES else d
                for d in hgx.devices)
    devices = replace(hgx, devices=ebs)
    plan = planned("auto", "auto", "/scratch", devices)
    assert plan.devices == DATA_DRIVES[:-1]
    assert "/dev/nvme9n1 left alone: a network volume (Amazon EBS), not a local drive" in plan.notes
    total, disks = s.data_nvme_bytes(devices)
    assert total == 7 * 3840755982336 and "nvme9n1" not in disks
    # lsblk's MODEL column reaches the fact (lsblk pads it: the padding is not part of it)
    parsed = parse_block_devices(['{"blockdevices": [{"name": "nvme1n1", "path": "/dev/nvme1n1", "type": "disk",'
                                  ' "tran": "nvme", "model": "Amazon Elastic Block Store              "}]}'])
    assert parsed.devices[0].network_volume == "Amazon EBS"
    for model, local in (("nvme_card-pd", False), ("nvme_card3", True), ("nvme_card", True),
                         ("MSFT NVMe Accelerator v1.0", False), ("Microsoft NVMe Direct Disk v2", True),
                         ("Amazon EC2 NVMe Instance Storage", True), ("SAMSUNG MZQL23T8HCLS-00A07", True)):
        assert (replace(parsed.devices[0], model=model).network_volume is None) is local, model


def test_one_listed_blank_drive_is_plain_xfs():
    plan = planned("auto", ("/dev/nvme5n1",), "/scratch", recorded(HGX))
    assert (plan.action, plan.layout, plan.devices, plan.notes) == (s.MAKE, "xfs", ("/dev/nvme5n1",), ())


def test_a_listed_drive_with_data_refuses_the_host_naming_it():
    with pytest.raises(Refused) as refused:
        planned("auto", ("/dev/nvme2n1", "/dev/nvme1n1"), "/scratch", recorded(HGX))
    assert refused.value.key == "storage_scratch_devices"
    assert refused.value.problem.startswith("/dev/nvme1n1 is not blank: has a partition table (gpt); mounted at /;")
    with pytest.raises(Refused, match="/dev/nvme12n1 is not a block device of this host"):
        planned("auto", ("/dev/nvme12n1",), "/scratch", recorded(HGX))


def test_a_drive_that_gained_a_filesystem_is_left_alone_and_reported():
    devices = recorded(HGX)
    gained = tuple(replace(d, probe="signature", found=(("TYPE", "ext4"),)) if d.path == "/dev/nvme4n1" else d
                   for d in devices.devices)
    plan = planned("auto", "auto", "/scratch", replace(devices, devices=gained))
    assert "/dev/nvme4n1" not in plan.devices and len(plan.devices) == 7
    assert "/dev/nvme4n1 left alone: carries a signature (ext4)" in plan.notes


def test_blank_by_lsblk_is_not_enough():
    """The recorded H200 VM: lsblk without udev shows no fstype on the disk mounted at /; a
    drive nothing probed is never blank (the plain lsblk -J output has no probe section)."""
    vm = recorded("lsblk-json-h200-vm.txt")
    vda = vm.find("/dev/vda")
    assert vda is not None and vda.fstype is None and vda.mountpoints == ("/",)
    assert s.describe(vda) == "mounted at /"
    zram = vm.find("/dev/zram0")
    assert zram is not None and s.describe(zram) == "not probed (no blkid -p verdict)"
    assert planned("auto", "auto", "/scratch", vm).action == s.NOTHING
    aws = recorded("lsblk-json-aws-instance-store.json")  # real: nvme1n1 blank, but nothing probed
    nvme1 = aws.find("/dev/nvme1n1")
    assert nvme1 is not None and nvme1.nvme and s.describe(nvme1).startswith("a device of unknown type")


def test_the_recorded_test_host_drive_with_xfs_is_not_blank_though_lsblk_shows_nothing():
    host = recorded("lsblk-probe-nspawn-loop-xfs.txt")
    loop = host.find("/dev/loop0")
    assert loop is not None and loop.fstype is None and loop.probe == "signature"
    assert loop.seen("TYPE") == "xfs"
    # the machine's own disks show through /sys, without a node in the host: never candidates
    vda = host.find("/dev/vda")
    assert vda is not None and vda.probe == "absent"


def test_the_existing_scratch_is_kept_mounted_or_not():
    mounted = recorded("lsblk-probe-nspawn-scratch-mounted.txt")
    ours = replace(ROOT_ONLY, recorded_uuid=MOUNTED_UUID, mounts=ROOT_ONLY.mounts + (at("/scratch", "xfs", "/dev/loop0"),))
    kept = planned("auto", ("/dev/loop0",), "/scratch", mounted, ours)
    assert (kept.action, kept.devices, kept.uuid, kept.mounted, kept.remount) == (
        s.KEEP, ("/dev/loop0",), MOUNTED_UUID, True, False)
    # mounted before gpufleet set nosuid,nodev: kept, remounted with them
    old = replace(ours, mounts=ROOT_ONLY.mounts + (at("/scratch", "xfs", "/dev/loop0", "rw", "noatime"),))
    assert planned("auto", ("/dev/loop0",), "/scratch", mounted, old).remount
    # the recorded XFS loop carries gpufleet's label and the recorded UUID, not mounted: kept, to be mounted
    xfs = recorded("lsblk-probe-nspawn-loop-xfs.txt")
    kept = planned("auto", ("/dev/loop0",), "/scratch", xfs, replace(ROOT_ONLY, recorded_uuid=LOOP_XFS_UUID))
    assert (kept.action, kept.mounted) == (s.KEEP, False)
    # storage_scratch_path changed: the same filesystem, kept, to be mounted at the new path;
    # the old mount stays (jobs may use it) and the plan says how it goes
    kept = planned("auto", ("/dev/loop0",), "/data", mounted, ours)
    assert (kept.action, kept.path, kept.uuid, kept.mounted) == (s.KEEP, "/data", MOUNTED_UUID, False)
    assert [n for n in kept.notes if "still mounted at /scratch too" in n and "moved to /data" in n]
    # without gpufleet's label, a filesystem mounted elsewhere is not ours: nothing is taken
    with pytest.raises(Refused, match="storage_scratch_devices"):
        planned("auto", ("/dev/loop0",), "/data", replace(mounted, devices=tuple(
            replace(d, found=tuple(kv for kv in d.found if kv[0] != "LABEL")) for d in mounted.devices)), ours)


@pytest.mark.parametrize("options", ["noatime,nofail", "nosuid,nodev,noatime,nofail",
                                     "nosuid,nodev,noatime,nofail,x-systemd.device-timeout=30s"])
def test_a_scratch_made_before_the_record_is_adopted_by_gpufleets_fstab_line(options):
    """Hosts gpufleet provisioned before it recorded the UUID: its own fstab line names it, with
    the options of any gpufleet version (before nosuid,nodev; before the device timeout)."""
    xfs = recorded("lsblk-probe-nspawn-loop-xfs.txt")
    line = ("UUID=" + LOOP_XFS_UUID, "/scratch", "xfs", options, "0", "0")
    kept = planned("auto", ("/dev/loop0",), "/scratch", xfs, replace(ROOT_ONLY, fstab=(line,)))
    assert (kept.action, kept.uuid) == (s.KEEP, LOOP_XFS_UUID)
    # an operator's own line for that filesystem (other options) is not gpufleet's: not adopted
    theirs = (line[:3] + ("defaults",) + line[4:],)
    with pytest.raises(Refused, match="storage_scratch_devices"):
        planned("auto", ("/dev/loop0",), "/scratch", xfs, replace(ROOT_ONLY, fstab=theirs))


def test_a_drive_labelled_like_the_scratch_that_gpufleet_did_not_make_is_never_adopted():
    """A USB stick (or any drive) anyone labelled gpufleet-scr: not the recorded UUID, or not
    on local PCIe NVMe; auto leaves it alone, says so, and makes the scratch on the blank drives."""
    hgx = recorded(HGX)
    stick = parse_block_devices(json.dumps({"blockdevices": [{
        "name": "sda", "path": "/dev/sda", "type": "disk", "tran": "usb", "size": 1 << 34, "label": s.SCRATCH_LABEL,
        "fstype": "xfs", "uuid": "5e1f0000-0000-4000-8000-00000000abcd"}]}).splitlines()).devices
    devices = replace(hgx, devices=hgx.devices + stick)
    made = planned("auto", "auto", "/scratch", devices)
    assert (made.action, made.devices) == (s.MAKE, DATA_DRIVES)
    assert made.notes[0].startswith(f"/dev/sda left alone: an XFS labelled {s.SCRATCH_LABEL} that gpufleet did not make")
    # even with its UUID recorded (the stick carries a copy): not local NVMe, so not adopted by auto
    recorded_stick = replace(ROOT_ONLY, recorded_uuid="5e1f0000-0000-4000-8000-00000000abcd")
    assert planned("auto", "auto", "/scratch", devices, recorded_stick).action == s.MAKE
    # NVMe over fabrics (lsblk TRAN tcp, rdma, fc) has local-looking names: never local
    fabric = tuple(replace(d, tran="tcp") if d.path in DATA_DRIVES else d for d in hgx.devices)
    assert planned("auto", "auto", "/scratch", replace(hgx, devices=fabric)).action == s.NOTHING


def test_something_else_mounted_at_the_path_refuses():
    mounted = recorded("lsblk-probe-nspawn-scratch-mounted.txt")
    foreign = replace(mounted, devices=tuple(replace(d, found=(("TYPE", "ext4"),)) if d.path == "/dev/loop0" else d
                                             for d in mounted.devices))
    with pytest.raises(Refused) as refused:
        planned("auto", "auto", "/scratch", foreign)
    assert refused.value.key == "storage_scratch_path"
    assert "is already the mount point of /dev/loop0 (ext4)" in refused.value.problem


NFS = at("/scratch", "nfs4", "nas01:/export/scratch", "rw", "relatime")


@pytest.mark.parametrize(("path", "site", "problem"), [
    # lsblk never lists these: the mount table does
    ("/scratch", replace(ROOT_ONLY, mounts=ROOT_ONLY.mounts + (NFS,), path_state="not-empty"),
     "/scratch is already the mount point of nas01:/export/scratch (nfs4)"),
    ("/scratch", replace(ROOT_ONLY, mounts=ROOT_ONLY.mounts + (at("/scratch", "autofs", "systemd-1"),), path_state="empty"),
     "/scratch is already the mount point of systemd-1 (autofs)"),
    ("/scratch", replace(ROOT_ONLY, mounts=ROOT_ONLY.mounts + (at("/scratch/projects", "lustre", "10.0.0.1@o2ib:/fs"),)),
     "/scratch has filesystems mounted below it (/scratch/projects): the scratch would hide them"),
    ("/mnt/scratch", replace(ROOT_ONLY, mounts=ROOT_ONLY.mounts + (at("/mnt", "beegfs", "beegfs_nodev"),)),
     "/mnt/scratch lies on beegfs (beegfs_nodev mounted at /mnt), a site's shared filesystem"),
    ("/data/scratch", replace(ROOT_ONLY, mounts=ROOT_ONLY.mounts + (at("/data", "fuse.ceph-fuse", "ceph-fuse"),)),
     "/data/scratch lies on fuse.ceph-fuse"),
    # an NFS at the path that is not mounted now (noauto, a failed mount): its fstab line
    ("/scratch", replace(ROOT_ONLY, fstab=(("nas01:/export/scratch", "/scratch", "nfs", "noauto", "0", "0"),)),
     "/etc/fstab already has a line for /scratch: nas01:/export/scratch /scratch nfs noauto 0 0"),
    ("/scratch", replace(ROOT_ONLY, path_state="link"), "/scratch is a symbolic link"),
    ("/scratch", replace(ROOT_ONLY, path_state="other"), "/scratch is not a directory"),
    ("/scratch", replace(ROOT_ONLY, path_state="not-empty"), "/scratch is a directory that is not empty"),
])
def test_a_path_where_the_site_keeps_something_refuses_the_host_naming_the_key(path, site, problem):
    with pytest.raises(Refused) as refused:
        planned("auto", "auto", path, recorded(HGX), site)
    assert refused.value.key == "storage_scratch_path"
    assert refused.value.problem.startswith(problem), refused.value.problem
    assert "never mounts the scratch over what is there" in refused.value.problem
    # the same path with no drive to take: nothing planned, nothing refused, only lsblk asked
    asked = []
    nothing = s.plan_scratch("auto", "auto", path, BlockDevicesData(),
                             lambda: asked.append(1) or site)
    assert (nothing.action, asked) == (s.NOTHING, [])


def test_a_scratch_on_drives_that_came_back_blank_is_made_again_and_said():
    """hgx-cloud: instance-store NVMe is blank after a stop/start; gpufleet's own fstab line (the
    recorded UUID) is the one line at the path it may replace, and the plan names what was lost."""
    lost = "1b2c3d4e-0000-4000-8000-00000000dead"
    site = replace(ROOT_ONLY, recorded_uuid=lost, path_state="empty",
                   fstab=((f"UUID={lost}", "/scratch", "xfs", s.MOUNT_OPTIONS, "0", "0"),))
    made = planned("auto", "auto", "/scratch", recorded(HGX), site)
    assert (made.action, made.devices, made.lost) == (s.MAKE, DATA_DRIVES, lost)
    assert made.notes[-1] == s.lost_note(lost)
    # without the record, that line is another one's
    with pytest.raises(Refused, match="/etc/fstab already has a line for /scratch"):
        planned("auto", "auto", "/scratch", recorded(HGX), replace(site, recorded_uuid=None))


def test_a_kept_raid0_reports_new_blank_drives_instead_of_growing():
    devices = recorded(HGX)
    array = parse_block_devices(json.dumps({"blockdevices": [{
        "name": "md127", "path": "/dev/md127", "type": "raid0", "size": 1, "label": s.SCRATCH_LABEL,
        "fstype": "xfs", "uuid": "1b2c3d4e-0000-4000-8000-000000000001", "mountpoint": "/scratch"}]}).splitlines())
    members = tuple(replace(d, fstype="linux_raid_member", probe="signature", children=array.devices)
                    if d.path in DATA_DRIVES[:7] else d for d in devices.devices)
    site = replace(ROOT_ONLY, recorded_uuid="1b2c3d4e-0000-4000-8000-000000000001",
                   mounts=ROOT_ONLY.mounts + (at("/scratch", "xfs", "/dev/md127"),))
    plan = planned("auto", "auto", "/scratch", replace(devices, devices=members), site)
    assert (plan.action, plan.devices, plan.mounted) == (s.KEEP, ("/dev/md127",), True)
    assert plan.notes[-1] == ("/dev/nvme9n1 is blank but not added: the scratch on /dev/md127 is kept as it is "
                              "(a RAID0 is not grown in place)")


def test_none_plans_nothing_whatever_the_drives():
    assert planned("none", "auto", "/scratch", recorded(HGX)) == s.ScratchPlan(s.NOTHING, "/scratch")


def test_probe_verdicts():
    data = parse_block_devices(["{\"blockdevices\": [{\"name\": \"sdb\", \"type\": \"disk\"}]}", "::gpufleet:: begin probe",
                                "/dev/sdb 2"])
    assert data.devices[0].probe == BLANK and data.probed
    assert parse_block_devices(["::gpufleet:: begin probe", "/dev/sdb 4"]).devices == ()


# --- /dev/shm -----------------------------------------------------------------------------------

def test_shm_size_is_computed_as_tmpfs_does():
    """The recorded test host: MemTotal 24683664 kB, size=50% gave 3085458 pages."""
    shm = parse_shm((FIXTURES / "shm-nspawn-50pct.txt").read_text().splitlines())
    assert shm == ShmData("tmpfs", 3085458 * 4096, ())
    assert s.shm_bytes("50%", 24683664) == shm.size_bytes
    assert s.plan_shm("50%", shm, 24683664) == s.ShmPlan("50%", "tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=50% 0 0",
                                                         False, f"/dev/shm is {shm.size_bytes} bytes, size=50% gives "
                                                         f"{shm.size_bytes}")
    assert s.plan_shm("64g", shm, 24683664).remount
    assert s.shm_bytes("64g", None) == 64 << 30 and s.shm_bytes("100000", None) == 102400
    assert s.plan_shm("unmanaged", ShmData(), None) == s.ShmPlan("unmanaged")
    # recorded on the VM test host (testing/vmhost.py) after a boot applied fstab's size=50%:
    # MemTotal 1498044 kB (374511 pages), findmnt size=749024k: tmpfs rounds the half page UP
    # (the kernel's default size, without size=, is 187255 pages: totalram / 2 rounded down)
    assert s.shm_bytes("50%", 1498044) == 749024 * 1024 == 187256 * 4096
    assert not s.plan_shm("50%", ShmData("tmpfs", 187256 * 4096, ()), 1498044).remount
    assert s.plan_shm("50%", ShmData("tmpfs", 187255 * 4096, ()), 1498044).remount
    with pytest.raises(Refused, match="not a tmpfs"):
        s.plan_shm("50%", ShmData(), 1)


# --- the preflight's NVMe capacity --------------------------------------------------------------

def test_nvme_capacity_counts_the_data_drives_only():
    total, disks = s.data_nvme_bytes(recorded(HGX))
    assert total == 8 * 3840755982336 and disks == [d.removeprefix("/dev/") for d in DATA_DRIVES]
    assert s.data_nvme_bytes(recorded("lsblk-json-h200-vm.txt")) == (0, [])


def test_the_gate_checks_the_tier_minimum():
    from types import SimpleNamespace

    from gpufleet.checks import validation as v
    from gpufleet.facts.storage import BlockDevices

    class Host:
        def get_fact(self, cls, *args, **kwargs):
            assert cls is BlockDevices
            return recorded(HGX)

    host = Host()

    def verdict(minimum: float, mismatch: str = "fail") -> tuple[str, str]:
        settings = SimpleNamespace(validate_min_nvme_tb=minimum, tier="hgx", tier_mismatch=mismatch)
        result = v.enough_nvme(SimpleNamespace(host=host, settings=settings))  # type: ignore[arg-type]
        return result.status, result.message

    assert verdict(30) == ("pass", "30.73 TB on 8 NVMe drives (validate_min_nvme_tb: 30)")
    status, message = verdict(40)
    assert status == "fail" and message.startswith("30.73 TB of local NVMe for data (nvme2n1, ")
    assert "tier hgx expects at least 40 TB (validate_min_nvme_tb; tier_mismatch: fail)" in message
    assert verdict(40, "warn")[0] == "warn"
    assert verdict(0)[0] == "skip"


# --- grammar --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("key", "value", "problem"), [
    ("storage_scratch", "raid5", "unknown value 'raid5'"),
    ("storage_scratch_devices", "/dev/nvme1n1", "expected auto or a non-empty list"),
    ("storage_scratch_devices", [], "expected auto or a non-empty list"),
    ("storage_scratch_devices", ["/dev/nvme1n1p1"], "is not a whole drive's device path"),
    ("storage_scratch_devices", ["/dev/nvme1n1", "/dev/nvme1n1"], "listed twice"),
    ("storage_scratch_devices", ["/dev/sda;rm"], "shell metacharacter ';'"),
    ("storage_scratch_path", "/", "is a system directory"),
    ("storage_scratch_path", "/usr/local", "is a system directory"),
    *(("storage_scratch_path", path, "is a system directory") for path in (
        "/var/lib/docker", "/var/scratch", "/lib64", "/lib", "/bin", "/sbin", "/root", "/home/alice", "/home",
        "/tmp/scratch", "/etc/x", "/opt", "/mnt", "/srv", "/boot/efi", "/run/scratch")),
    ("storage_scratch_path", "/scratch/../etc", "path traversal"),
    ("storage_scratch_path", "scratch", "is not an absolute path"),
    ("storage_scratch_group", "Team A", "bad group name"),
    ("storage_shm_size", "0%", "out of range"),
    ("storage_shm_size", "101%", "out of range"),
    ("storage_shm_size", "1m", "out of range"),
    ("storage_shm_size", "half", "malformed size"),
    ("validate_min_nvme_tb", -1, "out of range"),
    ("validate_min_nvme_tb", "30", "expected a number"),
])
def test_bad_values_are_refused_with_what_is_allowed(key, value, problem):
    with pytest.raises(BadValue) as bad:
        KEYS[key].validate(value)
    assert problem in bad.value.problem
    assert bad.value.allowed


@pytest.mark.parametrize(("key", "value"), [
    ("storage_scratch_devices", ["/dev/nvme1n1", "/dev/loop7", "/dev/sdb"]),
    ("storage_scratch_path", "/mnt/nvme"), ("storage_scratch_path", "/data"), ("storage_scratch_path", "/srv/scratch"),
    ("storage_scratch_path", "/library"), ("storage_shm_size", "50%"), ("storage_shm_size", "64g"),
    ("storage_shm_size", "unmanaged"), ("validate_min_nvme_tb", 3.84), ("storage_scratch_group", "ml-team"),
])
def test_good_values_pass(key, value):
    assert KEYS[key].validate(value) == (tuple(value) if isinstance(value, list) else value)


@pytest.mark.parametrize(("path", "unit"), [
    ("/scratch", "scratch.mount"),
    ("/mnt/fast-nvme", "mnt-fast\\x2dnvme.mount"),  # as `systemd-escape --path --suffix=mount` says
    ("/data/a+b@c/", "data-a\\x2bb\\x40c.mount"),
    ("/x.y", "x.y.mount"),
])
def test_mount_unit_is_systemds_name_for_the_path(path, unit):
    assert s.mount_unit(path) == unit


def test_the_boot_unit_runs_after_systemds_own_mount_of_the_scratch():
    """On a host with udev, systemd's fstab mount and gpufleet-scratch.service would otherwise
    race to mount the same path (tests/e2e/test_storage_raid.py boots one and checks)."""
    from gpufleet.rendering import render
    unit = render("etc/systemd/system/gpufleet-scratch.service.j2", tier="hgx", path="/mnt/fast-nvme",
                  md_name=s.MD_NAME, mount_unit=s.mount_unit("/mnt/fast-nvme"))
    assert "After=local-fs.target mnt-fast\\x2dnvme.mount\n" in unit
    script = render("usr/local/sbin/gpufleet-scratch-mount.j2", tier="hgx")
    assert 'mount "$path" || true\nmountpoint -q "$path" && exit 0\n' in script
    # not mounted: the unit fails, saying so (a cloud's blank instance store after a stop/start)
    assert script.rstrip().endswith("run deploys/all.py to make it again\" >&2\nexit 1")
