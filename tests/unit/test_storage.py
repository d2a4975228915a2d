"""gpufleet/storage.py: which drives become the scratch, on recorded lsblk -J output of real hosts
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

from gpufleet import storage as s
from gpufleet.facts.storage import BLANK, BlockDevicesData, ShmData, parse_block_devices, parse_shm
from gpufleet.schema import KEYS, BadValue
from gpufleet.tuning import Refusal

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "storage"


def recorded(name: str) -> BlockDevicesData:
    return parse_block_devices((FIXTURES / name).read_text().splitlines())


HGX = "lsblk-probe-hgx-shape-written.txt"
DATA_DRIVES = tuple(f"/dev/nvme{n}n1" for n in range(2, 10))


def test_the_hgx_layout_makes_one_raid0_of_the_eight_blank_drives_and_leaves_the_system_alone():
    plan = s.plan_scratch("auto", "auto", "/scratch", recorded(HGX))
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
    plan = s.plan_scratch("auto", "auto", "/scratch", devices)
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
    plan = s.plan_scratch("auto", ("/dev/nvme5n1",), "/scratch", recorded(HGX))
    assert (plan.action, plan.layout, plan.devices, plan.notes) == (s.MAKE, "xfs", ("/dev/nvme5n1",), ())


def test_a_listed_drive_with_data_refuses_the_host_naming_it():
    with pytest.raises(Refusal) as refused:
        s.plan_scratch("auto", ("/dev/nvme2n1", "/dev/nvme1n1"), "/scratch", recorded(HGX))
    assert refused.value.key == "storage_scratch_devices"
    assert refused.value.problem.startswith("/dev/nvme1n1 is not blank: has a partition table (gpt); mounted at /;")
    with pytest.raises(Refusal, match="/dev/nvme12n1 is not a block device of this host"):
        s.plan_scratch("auto", ("/dev/nvme12n1",), "/scratch", recorded(HGX))


def test_a_drive_that_gained_a_filesystem_is_left_alone_and_reported():
    devices = recorded(HGX)
    gained = tuple(replace(d, probe="signature", found=(("TYPE", "ext4"),)) if d.path == "/dev/nvme4n1" else d
                   for d in devices.devices)
    plan = s.plan_scratch("auto", "auto", "/scratch", replace(devices, devices=gained))
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
    assert s.plan_scratch("auto", "auto", "/scratch", vm).action == s.NOTHING
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
    plan = s.plan_scratch("auto", ("/dev/loop0",), "/scratch", mounted)
    assert (plan.action, plan.devices, plan.uuid, plan.mounted) == (
        s.KEEP, ("/dev/loop0",), "0d485266-04d3-424a-8b42-bbb17499422c", True)
    # the recorded XFS loop carries gpufleet's label too, not mounted: kept, to be mounted
    plan = s.plan_scratch("auto", "auto", "/scratch", recorded("lsblk-probe-nspawn-loop-xfs.txt"))
    assert (plan.action, plan.mounted) == (s.KEEP, False)
    # storage_scratch_path changed: the same filesystem, kept, to be mounted at the new path;
    # the old mount stays (jobs may use it) and the plan says how it goes
    plan = s.plan_scratch("auto", ("/dev/loop0",), "/data", mounted)
    assert (plan.action, plan.path, plan.uuid, plan.mounted) == (
        s.KEEP, "/data", "0d485266-04d3-424a-8b42-bbb17499422c", False)
    assert [n for n in plan.notes if "still mounted at /scratch too" in n and "moved to /data" in n]
    # without gpufleet's label, a filesystem mounted elsewhere is not ours: nothing is taken
    with pytest.raises(Refusal, match="storage_scratch_devices"):
        s.plan_scratch("auto", ("/dev/loop0",), "/data", replace(mounted, devices=tuple(
            replace(d, found=tuple(kv for kv in d.found if kv[0] != "LABEL")) for d in mounted.devices)))


def test_something_else_mounted_at_the_path_refuses():
    mounted = recorded("lsblk-probe-nspawn-scratch-mounted.txt")
    foreign = replace(mounted, devices=tuple(replace(d, found=(("TYPE", "ext4"),)) if d.path == "/dev/loop0" else d
                                             for d in mounted.devices))
    with pytest.raises(Refusal) as refused:
        s.plan_scratch("auto", "auto", "/scratch", foreign)
    assert refused.value.key == "storage_scratch_path"
    assert "is already the mount point of /dev/loop0 (ext4)" in refused.value.problem


def test_a_kept_raid0_reports_new_blank_drives_instead_of_growing():
    devices = recorded(HGX)
    array = parse_block_devices(json.dumps({"blockdevices": [{
        "name": "md127", "path": "/dev/md127", "type": "raid0", "size": 1, "label": s.SCRATCH_LABEL,
        "fstype": "xfs", "uuid": "1b2c3d4e-0000-4000-8000-000000000001", "mountpoint": "/scratch"}]}).splitlines())
    members = tuple(replace(d, fstype="linux_raid_member", probe="signature", children=array.devices)
                    if d.path in DATA_DRIVES[:7] else d for d in devices.devices)
    plan = s.plan_scratch("auto", "auto", "/scratch", replace(devices, devices=members))
    assert (plan.action, plan.devices, plan.mounted) == (s.KEEP, ("/dev/md127",), True)
    assert plan.notes[-1] == ("/dev/nvme9n1 is blank but not added: the scratch on /dev/md127 is kept as it is "
                              "(a RAID0 is not grown in place)")


def test_none_plans_nothing_whatever_the_drives():
    assert s.plan_scratch("none", "auto", "/scratch", recorded(HGX)) == s.ScratchPlan(s.NOTHING, "/scratch")


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
    with pytest.raises(Refusal, match="not a tmpfs"):
        s.plan_shm("50%", ShmData(), 1)


# --- the preflight's NVMe capacity --------------------------------------------------------------

def test_nvme_capacity_counts_the_data_drives_only():
    total, disks = s.data_nvme_bytes(recorded(HGX))
    assert total == 8 * 3840755982336 and disks == [d.removeprefix("/dev/") for d in DATA_DRIVES]
    assert s.data_nvme_bytes(recorded("lsblk-json-h200-vm.txt")) == (0, [])


def test_the_gate_checks_the_tier_minimum():
    from types import SimpleNamespace

    from gpufleet import validation as v
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
    ("storage_scratch_path", "/mnt/nvme"), ("storage_shm_size", "50%"), ("storage_shm_size", "64g"),
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
    assert script.rstrip().endswith('mount "$path" && exit 0\n'
                                     '# mounted meanwhile by another path (systemd\'s fstab mount): not an error, '
                                     'and not mounted twice\nmountpoint -q "$path"')
