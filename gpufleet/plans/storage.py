"""What deploys/storage.py decides, as functions of the settings and the host's facts.

* scratch (``storage_scratch``): which drives become the local scratch filesystem. A drive is a
  candidate only when it is blank by every account read right before: a whole disk (or, named
  in ``storage_scratch_devices``, a loop device), writable, without partitions or anything
  stacked on it, not mounted, no filesystem or partition table in lsblk, and ``blkid -p`` found
  no signature on it. ``auto`` takes the local NVMe disks (lsblk TRAN nvme, or nvme<c>n<n>
  names; not a cloud's network volume presented as NVMe, such as EBS) that are blank and leaves
  every other one alone, saying so; a list takes exactly the
  drives listed and refuses the host, naming the drive, when one of them is not blank. One
  drive: XFS on it; several: md RAID0 across them, XFS on the array. The scratch already there
  is kept, never rebuilt: an XFS filesystem labelled SCRATCH_LABEL whose UUID is the one gpufleet
  recorded when it made it (facts.storage.SCRATCH_RECORD; a label alone is anyone's), on drives
  it would take (local PCIe NVMe for auto, the listed ones for a list).
* the path (``storage_scratch_path``): lsblk never lists NFS, Lustre, BeeGFS, GPFS, CephFS or
  autofs, so the mount table and /etc/fstab (the ScratchSite fact) are read too, and the host is
  refused, naming the key, when the scratch would hide or replace what a site keeps there:
  anything mounted at or below the path, a network filesystem the path lies on, another fstab
  line for it, a link, a directory that is not empty (path_refusal).
* /dev/shm (``storage_shm_size``): its size as tmpfs computes it, compared with what it is.
* validate_min_nvme_tb: the NVMe capacity the preflight counts.

A request the host cannot honour raises Refused(Refusal) (gpufleet.config.failures: key, problem,
allowed values).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from gpufleet.facts.storage import BLANK, BlockDevice, BlockDevicesData, ScratchSiteData, ShmData
from gpufleet.config.failures import Refusal as Refusal
from gpufleet.config.failures import Refused as Refused

#: the XFS label of gpufleet's scratch filesystem (XFS labels: at most 12 characters)
SCRATCH_LABEL = "gpufleet-scr"
#: the md array's name (mdadm --name; /dev/md/<name>)
MD_NAME = "gpufleet-scratch"
MD_DEVICE = f"/dev/md/{MD_NAME}"
#: how long systemd waits at boot for the scratch's device before giving its fstab mount up
#: (systemd's default: 90 s). A local NVMe drive is enumerated in the first seconds of the boot,
#: or it is not there at all (instance store blank after a cloud's stop/start, a dead drive):
#: waiting longer only holds the boot and gpufleet-scratch.service's loud failure back. 30 s is a
#: margin for a slow enumeration (many drives, a drive slow to get ready after a power loss); a
#: drive later than that is still mounted when it appears (systemd's device unit wants an fstab
#: mount without noauto), only gpufleet-scratch.service has said it failed by then. Not a
#: tunable: no operator gains from a longer wait for a disposable scratch.
DEVICE_TIMEOUT = "x-systemd.device-timeout=30s"
#: mount options of the scratch filesystem in /etc/fstab: no set-user-ID program or device node
#: that a user leaves on the scratch works from it; nofail and the device timeout: a lost drive
#: neither stops nor long holds the boot (mount(8) ignores x-* options)
MOUNT_OPTIONS = f"nosuid,nodev,noatime,nofail,{DEVICE_TIMEOUT}"
#: the options gpufleet's fstab line had before (a scratch it made then is its own; its line is
#: rewritten with MOUNT_OPTIONS): before nosuid,nodev, and before the device timeout
LEGACY_OPTIONS = ("noatime,nofail", "nosuid,nodev,noatime,nofail")
MOUNT_FLAGS = ("nosuid", "nodev")
PATH_ALLOWED = ("an empty or absent directory where nothing is mounted (not at it, below it, or a network "
                "filesystem above it) and that no other /etc/fstab line names; or storage_scratch: none")
#: mounts that make the disk under them a system disk: never counted as scratch capacity
SYSTEM_MOUNTS = ("/", "/boot", "/boot/efi", "/usr", "/var", "/home", "[SWAP]")

KEEP, MAKE, NOTHING = "keep", "make", "nothing"


def describe(node: BlockDevice) -> str:
    """Why a device is not blank, in words ('' when it is)."""
    why = []
    if node.ro:
        why.append("read-only")
    if node.type not in ("disk", "loop"):
        why.append(f"a {node.type or 'device of unknown type'}, not a whole disk")
    if node.seen("TYPE"):
        why.append(f"carries a signature ({node.seen('TYPE')})")
    if node.seen("PTTYPE"):
        why.append(f"has a partition table ({node.seen('PTTYPE')})")
    mounts = [m for n in node.walk() for m in n.mountpoints]
    if mounts:
        why.append("mounted at " + ", ".join(mounts))
    if node.children:
        why.append("holds " + ", ".join(f"{c.name} ({c.type})" for c in node.children))
    if not why and node.probe != BLANK:
        why.append({None: "not probed (no blkid -p verdict)", "absent": "no device node to probe",
                    "signature": "blkid -p found a signature"}.get(node.probe, "blkid -p could not read it"))
    return "; ".join(why)


def nvme_disks(devices: BlockDevicesData) -> list[BlockDevice]:
    """The local NVMe disks: a cloud's network volume presented as NVMe (EBS) is not one."""
    return [d for d in devices.devices if d.type == "disk" and d.nvme and not d.network_volume]


def network_volumes(devices: BlockDevicesData) -> list[BlockDevice]:
    return [d for d in devices.devices if d.type == "disk" and d.nvme and d.network_volume]


def data_nvme_bytes(devices: BlockDevicesData) -> tuple[int, list[str]]:
    """The local NVMe capacity for data: every NVMe disk except those carrying the system
    (a mount of SYSTEM_MOUNTS anywhere below them); and the disks counted."""
    total, counted = 0, []
    for disk in nvme_disks(devices):
        if any(m in SYSTEM_MOUNTS for n in disk.walk() for m in n.mountpoints):
            continue
        total += disk.size or 0
        counted.append(disk.name)
    return total, counted


@dataclass(frozen=True)
class ScratchPlan:
    action: str  # KEEP | MAKE | NOTHING
    path: str
    devices: tuple[str, ...] = ()  # MAKE: the drives; KEEP: the filesystem's device
    uuid: str | None = None  # KEEP: the filesystem's UUID
    mounted: bool = False  # KEEP: mounted at path now
    notes: tuple[str, ...] = field(default_factory=tuple)  # drives left alone, and why
    also_mounted: tuple[str, ...] = ()  # KEEP: old mount points (storage_scratch_path changed), left mounted
    remount: bool = False  # KEEP: mounted at path without nosuid,nodev: remount with them
    lost: str | None = None  # MAKE: the recorded UUID of a scratch no drive holds any more

    @property
    def layout(self) -> str:
        if self.action != MAKE:
            return ""
        return "xfs" if len(self.devices) == 1 else "raid0"

    def summary(self) -> str:
        if self.action == MAKE:
            what = (f"XFS on {self.devices[0]}" if self.layout == "xfs"
                    else f"md RAID0 ({MD_DEVICE}) across {', '.join(self.devices)}, XFS on it")
            return f"{what}, mounted at {self.path}"
        if self.action == KEEP:
            return f"{self.path}: XFS {self.uuid} on {self.devices[0]} ({'mounted' if self.mounted else 'to mount'})"
        return "no scratch filesystem"


def mount_unit(path: str) -> str:
    """systemd's name for the mount unit of `path` (as `systemd-escape --path --suffix=mount`):
    /scratch -> scratch.mount, /mnt/fast-nvme -> mnt-fast\\x2dnvme.mount."""
    text = "/".join(part for part in path.split("/") if part)
    out = []
    for i, char in enumerate(text):
        if char == "/":
            out.append("-")
        elif char.isascii() and (char.isalnum() or char in ":_.") and not (i == 0 and char == "."):
            out.append(char)
        else:
            out.append(f"\\x{ord(char):02x}")
    return "".join(out) + ".mount"


def _labelled(devices: BlockDevicesData) -> list[BlockDevice]:
    """Every XFS filesystem labelled SCRATCH_LABEL: gpufleet's scratch, or one that only looks
    like it (anyone can label a USB stick so); the record tells which."""
    return [node for top in devices.devices for node in top.walk()
            if node.seen("LABEL") == SCRATCH_LABEL and node.seen("TYPE") == "xfs"]


def _mounted_at(devices: BlockDevicesData, path: str) -> BlockDevice | None:
    found = None
    for top in devices.devices:
        for node in top.walk():
            if path in node.mountpoints:
                found = node
    return found


def _gpufleet_line(line: tuple[str, ...], uuid: str) -> bool:
    """An /etc/fstab line gpufleet wrote for the filesystem `uuid` (at any path)."""
    return len(line) >= 4 and line[0] == f"UUID={uuid}" and line[2] == "xfs" and line[3] in (MOUNT_OPTIONS, *LEGACY_OPTIONS)


def _made_by_gpufleet(node: BlockDevice, site: ScratchSiteData) -> bool:
    """gpufleet made it: its UUID is the one recorded when it was made; or, on a host whose
    scratch predates the record, no record exists and /etc/fstab has the line gpufleet wrote for
    that UUID (the run records it then)."""
    uuid = node.seen("UUID")
    if not uuid:
        return False
    if site.recorded_uuid is not None:
        return uuid == site.recorded_uuid
    return any(_gpufleet_line(line, uuid) for line in site.fstab)


def _where_allowed(devices: BlockDevicesData, wanted: Any, node: BlockDevice) -> bool:
    """The filesystem lies only on drives gpufleet would take: local PCIe NVMe for auto (never
    NVMe over fabrics, a network volume, USB), the listed drives for a list."""
    tops = [top for top in devices.devices if any(n.path == node.path for n in top.walk())]
    if not tops:
        return False
    if wanted == "auto":
        return all(top.type == "disk" and top.nvme and not top.network_volume for top in tops)
    return all(top.path in wanted for top in tops)


def _below(path: str, target: str) -> bool:
    return target.startswith(path.rstrip("/") + "/")


def path_refusal(path: str, site: ScratchSiteData, own_uuid: str | None) -> str:
    """Why the scratch may not be mounted at `path` now ('' when it may): something else is
    mounted there or below it, the path lies on a site's network filesystem, /etc/fstab has
    another line for it, or the directory is a link, not a directory, or not empty. The format
    script checks the same on the host right before it formats and again before it mounts."""
    at = [m for m in site.mounts if m.target == path]
    if at:
        return f"{path} is already the mount point of {at[-1].source} ({at[-1].fstype})"
    below = [m.target for m in site.mounts if _below(path, m.target)]
    if below:
        return f"{path} has filesystems mounted below it ({', '.join(below)}): the scratch would hide them"
    above = [m for m in site.mounts if _below(m.target, path) or m.target == "/"]
    if above:
        nearest = max(above, key=lambda m: len(m.target))
        if nearest.network:
            return (f"{path} lies on {nearest.fstype} ({nearest.source} mounted at {nearest.target}), "
                    "a site's shared filesystem")
    other = [line for line in site.fstab if len(line) >= 2 and line[1] == path
             and not (own_uuid and line[0] == f"UUID={own_uuid}")]
    if other:
        return f"/etc/fstab already has a line for {path}: {' '.join(other[0])}"
    why = {"link": "is a symbolic link (to a site's storage?)", "other": "is not a directory",
           "not-empty": "is a directory that is not empty: its files would be hidden under the scratch"}
    if site.path_state in why:
        return f"{path} {why[site.path_state]}"
    return ""


def _refused(key: str, problem: str, allowed: str) -> Refused:
    return Refused(Refusal("storage", key, problem, allowed=allowed))


def _refuse_path(path: str, problem: str) -> Refused:
    return _refused("storage_scratch_path", f"{problem}; gpufleet never mounts the scratch over what is there",
                    PATH_ALLOWED)


def moved_note(device: str, old: str, path: str) -> str:
    """storage_scratch_path changed under a mounted scratch: the old mount is left to the operator,
    since jobs may hold files there (unmounted, their writes would land on the root disk)."""
    return (f"{device} is still mounted at {old} too: the scratch moved to {path} (storage_scratch_path); "
            f"unmount {old} once nothing uses it, or reboot: from the next boot it is mounted at {path} only")


def plan_scratch(setting: str, wanted: Any, path: str, devices: BlockDevicesData,
                 site: Callable[[], ScratchSiteData]) -> ScratchPlan:
    """The scratch plan for one host (see the module's docstring). `wanted`: storage_scratch_devices
    (``auto`` or a tuple of device paths); `site`: the ScratchSite fact for `path`, asked only
    when there is a scratch to keep or drives to make one on (a host with neither asks nothing
    more than lsblk)."""
    if setting == "none":
        return ScratchPlan(NOTHING, path)
    mounted = _mounted_at(devices, path)
    labelled = _labelled(devices)
    facts = site() if labelled else None
    ours = None
    alone: list[str] = []
    for node in labelled:
        assert facts is not None
        if _made_by_gpufleet(node, facts) and _where_allowed(devices, wanted, node):
            ours = node
        else:
            alone.append(f"{node.path} left alone: an XFS labelled {SCRATCH_LABEL} that gpufleet did not make "
                         "here (not the UUID it recorded, or not on a drive storage_scratch_devices takes)")
    if mounted is not None and (ours is None or mounted.path != ours.path):
        raise _refuse_path(path, f"{path} is already the mount point of {mounted.path} "
                                 f"({mounted.seen('TYPE') or 'unknown filesystem'}), not of gpufleet's scratch filesystem")
    if ours is not None:
        assert facts is not None
        uuid = ours.seen("UUID")
        assert uuid
        if mounted is None and (problem := path_refusal(path, facts, uuid)):
            raise _refuse_path(path, problem)
        also = tuple(old for old in ours.mountpoints if old != path)
        notes = tuple(alone) + _beside(devices, wanted, ours) + tuple(moved_note(ours.path, old, path) for old in also)
        options = next((m.options for m in reversed(facts.mounts) if m.target == path), ())
        remount = mounted is not None and not set(MOUNT_FLAGS) <= set(options)
        return ScratchPlan(KEEP, path, (ours.path,), uuid, mounted is not None, notes, also, remount=remount)
    chosen, notes = _candidates(devices, wanted)
    notes = tuple(alone) + notes
    if not chosen:
        return ScratchPlan(NOTHING, path, notes=notes + ("no blank local NVMe drive: no scratch filesystem made",))
    facts = facts or site()
    if problem := path_refusal(path, facts, facts.recorded_uuid):
        raise _refuse_path(path, problem)
    lost = facts.recorded_uuid
    if lost and any(node.seen("UUID") == lost for top in devices.devices for node in top.walk()):
        lost = None
    if lost:
        notes += (lost_note(lost),)
    return ScratchPlan(MAKE, path, tuple(d.path for d in chosen), notes=notes, lost=lost)


def lost_note(uuid: str) -> str:
    return (f"gpufleet's scratch (UUID {uuid}, recorded when it was made) is on no drive now: its drives "
            "came back blank (a cloud instance's stop/start blanks instance-store NVMe) or were replaced")


def _beside(devices: BlockDevicesData, wanted: Any, ours: BlockDevice) -> tuple[str, ...]:
    """What becomes of the other drives while the scratch exists: nothing, said."""
    members = {top.path for top in devices.devices if any(n.path == ours.path for n in top.walk())}
    others = nvme_disks(devices) if wanted == "auto" else [devices.find(p) for p in wanted]
    notes = []
    for disk in others:
        if disk is None or disk.path in members:
            continue
        why = describe(disk)
        notes.append(f"{disk.path} left alone: {why}" if why else
                     f"{disk.path} is blank but not added: the scratch on {ours.path} is kept as it is "
                     "(a RAID0 is not grown in place)")
    return tuple(notes)


def _candidates(devices: BlockDevicesData, wanted: Any) -> tuple[list[BlockDevice], tuple[str, ...]]:
    if wanted == "auto":
        chosen, notes = [], []
        for volume in network_volumes(devices):
            notes.append(f"{volume.path} left alone: a network volume ({volume.network_volume}), not a local drive")
        for disk in nvme_disks(devices):
            why = describe(disk)
            if why:
                notes.append(f"{disk.path} left alone: {why}")
            else:
                chosen.append(disk)
        return chosen, tuple(notes)
    listed = []
    for path in wanted:
        node = devices.find(path)
        if node is None:
            raise _refused("storage_scratch_devices", f"{path} is not a block device of this host (lsblk)",
                           "auto, or a list of blank drives of the host")
        why = describe(node)
        if why:
            raise _refused("storage_scratch_devices", f"{path} is not blank: {why}; gpufleet never formats a drive "
                           "that holds data", "auto, or a list of blank drives (no filesystem, no partition "
                           "table, not mounted, no md member)")
        listed.append(node)
    return listed, ()


# --- /dev/shm -----------------------------------------------------------------------------------

PAGE = 4096
_FACTOR = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def shm_bytes(setting: str, memory_kib: int | None) -> int | None:
    """The size tmpfs gives /dev/shm for `size=<setting>` (whole pages, rounded UP as mm/shmem.c
    does; a percentage of RAM as the kernel counts it: N x PAGE x MemTotal in pages / 100 bytes,
    then rounded up to pages); None when it cannot be known. Rounded down, a host whose page
    count x N is not a multiple of 100 (the VM test host: 374511 pages, 50% = 187255.5)
    remounted /dev/shm at every run after a boot had applied fstab's size."""
    percent = re.fullmatch(r"(\d{1,3})%", setting)
    if percent:
        if memory_kib is None:
            return None
        size = int(percent[1]) * PAGE * (memory_kib * 1024 // PAGE) // 100
        return -(-size // PAGE) * PAGE
    match = re.fullmatch(r"(\d+)([kmgtKMGT]?)", setting)
    if not match:
        raise ValueError(f"not a tmpfs size: {setting!r}")
    size = int(match[1]) * _FACTOR[match[2].lower()]
    return -(-size // PAGE) * PAGE


def shm_fstab_line(setting: str) -> str:
    return f"tmpfs /dev/shm tmpfs rw,nosuid,nodev,size={setting} 0 0"


@dataclass(frozen=True)
class ShmPlan:
    setting: str
    line: str = ""  # the /etc/fstab line ("" = unmanaged)
    remount: bool = False  # the size differs now: remount
    note: str = ""


def plan_shm(setting: str, shm: ShmData, memory_kib: int | None) -> ShmPlan:
    if setting == "unmanaged":
        return ShmPlan(setting)
    line = shm_fstab_line(setting)
    if shm.fstype != "tmpfs":
        raise _refused("storage_shm_size", f"/dev/shm is {shm.fstype or 'not mounted'}, not a tmpfs",
                       "unmanaged on this host")
    wanted = shm_bytes(setting, memory_kib)
    if wanted is None:
        return ShmPlan(setting, line, True, "MemTotal unknown: /dev/shm remounted to be sure")
    return ShmPlan(setting, line, wanted != shm.size_bytes,
                   f"/dev/shm is {shm.size_bytes} bytes, size={setting} gives {wanted}")
