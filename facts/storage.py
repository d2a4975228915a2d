"""
Storage facts: the host's block devices (lsblk -J) with a signature probe of each whole device,
and the size of /dev/shm.

Why a probe beside lsblk: lsblk takes FSTYPE and PTTYPE from udev's database and probes the
device itself only where it can open it. Without udev (a container, an early boot) or without
the device node, a disk full of data shows ``"fstype": null`` (recorded on a live H200 VM:
its root disk vda, mounted at /, has no fstype in lsblk -J). So "blank" is never decided from
lsblk alone: ``blkid -p`` (low-level probe, no cache) must also have found nothing on the device
(exit status 2), read by this very command.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import MARK, JsonMixin, fail, split_sections, with_values

#: lsblk's columns; -b: sizes in bytes. Older util-linux (< 2.37) has no MOUNTPOINTS: MOUNTPOINT
#: (one of them) is asked instead and read the same way.
LSBLK_COLUMNS = "NAME,PATH,TYPE,TRAN,MODEL,SIZE,RO,FSTYPE,PTTYPE,LABEL,UUID,MOUNTPOINT"

#: NVMe models of network volumes (model prefix, what it is): never local scratch drives
NETWORK_VOLUME_MODELS = (("Amazon Elastic Block Store", "Amazon EBS"),
                         ("nvme_card-pd", "Google Cloud Persistent Disk / Hyperdisk"),
                         ("MSFT NVMe Accelerator", "Azure remote disk"))

#: The probe verdicts: nothing found (blkid -p exit 2), a signature found (exit 0), no device
#: node to open here, or blkid could not tell (any other exit: unreadable, I/O error).
BLANK, SIGNATURE, ABSENT, UNKNOWN = "blank", "signature", "absent", "unknown"

BLOCK_DEVICES_COMMAND = (
    "lsblk -J -b -o " + LSBLK_COLUMNS + " 2>/dev/null\n"
    "echo '" + MARK + " begin probe'\n"
    # every disk, loop device and md array lsblk lists (an array once, though it shows under
    # each member): the path and blkid's exit status, then what it found, indented
    "lsblk -nrp -o PATH,TYPE 2>/dev/null | sort -u | while read -r dev type; do\n"
    "  case $type in disk|loop|raid*) ;; *) continue;; esac\n"
    "  if [ ! -b \"$dev\" ]; then echo \"$dev absent\"; continue; fi\n"
    "  found=$(blkid -p -o export \"$dev\" 2>/dev/null); rc=$?\n"
    "  echo \"$dev $rc\"; [ -z \"$found\" ] || printf '%s\\n' \"$found\" | sed 's/^/  /'\n"
    "done\n"
    "true"
)


@dataclass(frozen=True)
class BlockDevice(JsonMixin):
    """One node of lsblk's tree. None = the column was not printed or had no value."""

    name: str
    path: str
    type: str | None = None  # disk | part | loop | raid0 | lvm | crypt | rom ...
    tran: str | None = None  # nvme | sata | usb | virtio ...
    model: str | None = None  # the drive's model ("Amazon Elastic Block Store": a network volume)
    size: int | None = None  # bytes
    ro: bool = False
    fstype: str | None = None  # xfs | linux_raid_member | LVM2_member ...
    pttype: str | None = None  # gpt | dos
    label: str | None = None
    uuid: str | None = None
    mountpoints: tuple[str, ...] = ()
    children: tuple[BlockDevice, ...] = ()
    probe: str | None = None  # disks, loops, arrays: BLANK | SIGNATURE | ABSENT | UNKNOWN; None = not probed
    #: what blkid -p found on it (TYPE, UUID, LABEL, PTTYPE...): udev-less hosts' lsblk has no fstype
    found: tuple[tuple[str, str], ...] = ()

    def seen(self, key: str) -> str | None:
        """lsblk's column, else what the probe found (key as blkid names it: TYPE, UUID...)."""
        column = {"TYPE": self.fstype, "UUID": self.uuid, "LABEL": self.label, "PTTYPE": self.pttype}[key]
        return column or dict(self.found).get(key)

    def walk(self) -> list[BlockDevice]:
        """This node and every node below it."""
        return [self] + [node for child in self.children for node in child.walk()]

    @property
    def nvme(self) -> bool:
        """A local (PCIe) NVMe namespace: lsblk's transport nvme, or the kernel's nvme<ctrl>n<ns>
        name where no transport was printed. NVMe over fabrics has a name of the same shape and
        lsblk's transport tcp, rdma, fc or loop: never local."""
        if self.tran is not None:
            return self.tran == "nvme"
        return bool(re.fullmatch(r"nvme\d+n\d+", self.name.rsplit("/", 1)[-1]))

    @property
    def network_volume(self) -> str | None:
        """The cloud's name for it when this NVMe namespace is a network volume, not a local drive,
        by its model (tests/fixtures/storage/README.md cites each): EC2's EBS "Amazon Elastic
        Block Store" (instance store: "Amazon EC2 NVMe Instance Storage"), Google Cloud's
        Persistent Disk and Hyperdisk "nvme_card-pd" (Local SSD: "nvme_card", "nvme_cardN"),
        Azure's remote disks "MSFT NVMe Accelerator v1.0" (local: "Microsoft NVMe Direct Disk")."""
        model = (self.model or "").strip()
        for prefix, name in NETWORK_VOLUME_MODELS:
            if model.startswith(prefix):
                return name
        return None


@dataclass(frozen=True)
class BlockDevicesData(JsonMixin):
    devices: tuple[BlockDevice, ...] = ()
    probed: bool = False  # the probe section was printed (a recorded plain `lsblk -J` has none)

    def find(self, path: str) -> BlockDevice | None:
        for top in self.devices:
            for node in top.walk():
                if node.path == path:
                    return node
        return None


def _bool(value: Any) -> bool:
    # lsblk < 2.33 prints "0"/"1" as strings, newer versions booleans
    return value in (True, 1, "1", "true")


def _size(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():  # lsblk < 2.33 prints numbers as strings
        return int(value)
    return None  # "7T": not asked with -b


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


Probes = dict[str, tuple[str, tuple[tuple[str, str], ...]]]


def _node(raw: Any, probes: Probes) -> BlockDevice:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise fail("expected a block device object with a name", json.dumps(raw)[:200])
    name = raw["name"]
    path = _text(raw.get("path")) or (name if name.startswith("/") else f"/dev/{name}")
    if "mountpoints" in raw:
        mounts = raw.get("mountpoints") or []
    else:
        mounts = [raw.get("mountpoint")]
    children = raw.get("children") or []
    if not isinstance(mounts, list) or not isinstance(children, list):
        raise fail("expected lists for mountpoints and children", name)
    return BlockDevice(
        name=name,
        path=path,
        type=_text(raw.get("type")),
        tran=_text(raw.get("tran")),
        model=_text(raw.get("model")),
        size=_size(raw.get("size")),
        ro=_bool(raw.get("ro")),
        fstype=_text(raw.get("fstype")),
        pttype=_text(raw.get("pttype")),
        label=_text(raw.get("label")),
        uuid=_text(raw.get("uuid")),
        mountpoints=tuple(m for m in mounts if isinstance(m, str) and m),
        children=tuple(_node(child, probes) for child in children),
        probe=probes[path][0] if path in probes else None,
        found=probes[path][1] if path in probes else (),
    )


_PROBE = re.compile(r"(/dev/\S+) (absent|\d+)")


def parse_block_devices(lines: Sequence[str]) -> BlockDevicesData:
    """lsblk -J's tree, each whole device with its probe verdict (see the module's docstring)."""
    sections, _ = split_sections(lines)
    text = "\n".join(sections[""]).strip()
    probes: Probes = {}
    device = ""
    for line in sections.get("probe", []):
        if line.startswith("  ") and device:
            key, sep, value = line.strip().partition("=")
            if sep and re.fullmatch(r"[A-Z_]+", key):
                verdict, found = probes[device]
                probes[device] = (verdict, found + ((key, value),))
                continue
        match = _PROBE.fullmatch(line.strip())
        if not match:
            raise fail("expected '<device> <blkid exit status>' in the probe", line)
        device, status = match[1], match[2]
        probes[device] = (ABSENT if status == "absent" else BLANK if status == "2"
                          else SIGNATURE if status == "0" else UNKNOWN, ())
    if not text:  # no lsblk: nothing known, so nothing is blank
        return BlockDevicesData((), "probe" in sections)
    try:
        data = json.loads(text)
    except ValueError as error:
        raise fail(f"lsblk -J printed no JSON ({error})", text[:200]) from error
    devices = data.get("blockdevices") if isinstance(data, dict) else None
    if not isinstance(devices, list):
        raise fail("expected {\"blockdevices\": [...]} from lsblk -J", text[:200])
    return BlockDevicesData(tuple(_node(raw, probes) for raw in devices), "probe" in sections)


class BlockDevices(FactBase[BlockDevicesData]):
    """
    Every block device lsblk lists (a tree: disks, their partitions, arrays and volumes on
    them), each whole disk or loop device probed for a signature with ``blkid -p``:

    .. code:: python

        BlockDevicesData(devices=(BlockDevice(name="nvme1n1", path="/dev/nvme1n1", type="disk",
                         tran="nvme", size=3840755982336, probe="blank"), ...), probed=True)
    """

    @override
    @staticmethod
    def default() -> BlockDevicesData:
        return BlockDevicesData()

    @override
    def command(self) -> str:
        return BLOCK_DEVICES_COMMAND

    @override
    def process(self, output: list[str]) -> BlockDevicesData:
        return parse_block_devices(output)


@dataclass(frozen=True)
class ShmData(JsonMixin):
    fstype: str | None = None  # "tmpfs" where /dev/shm is one
    size_bytes: int | None = None  # its size limit (statfs blocks x block size); None = not read
    fstab: tuple[str, ...] = field(default_factory=tuple)  # /etc/fstab lines for /dev/shm


SHM_COMMAND = (
    "stat -f -c '%T %b %S' /dev/shm 2>/dev/null\n"
    "echo '" + MARK + " begin fstab'\n"
    "awk '$1 !~ /^#/ && $2 == \"/dev/shm\"' /etc/fstab 2>/dev/null\n"
    "true"
)


def parse_shm(lines: Sequence[str]) -> ShmData:
    sections, _ = split_sections(lines)
    stat = [line.split() for line in sections[""] if line.strip()]
    fstab = tuple(line.strip() for line in sections.get("fstab", []) if line.strip())
    if not stat:
        return ShmData(fstab=fstab)
    words = stat[0]
    if len(words) != 3 or not words[1].isdigit() or not words[2].isdigit():
        raise fail("expected '<fs type> <blocks> <block size>' from stat -f", " ".join(words))
    return ShmData(words[0], int(words[1]) * int(words[2]), fstab)


class ShmSize(FactBase[ShmData]):
    """
    /dev/shm's filesystem type and size limit (``stat -f``), and its /etc/fstab lines:

    .. code:: python

        ShmData(fstype="tmpfs", size_bytes=135089487872, fstab=("tmpfs /dev/shm tmpfs ...",))
    """

    @override
    @staticmethod
    def default() -> ShmData:
        return ShmData()

    @override
    def command(self) -> str:
        return SHM_COMMAND

    @override
    def process(self, output: list[str]) -> ShmData:
        return parse_shm(output)


# --- the scratch path: what is mounted around it, fstab, gpufleet's record, the directory --------

#: where gpufleet records the UUID of the scratch filesystem it made (adopted by that UUID only)
SCRATCH_RECORD = "/etc/gpufleet/scratch-uuid"

#: filesystem types that are a site's shared storage (or a stand-in for one, an automounter):
#: a scratch is never mounted over, under or instead of one
NETWORK_FSTYPES = frozenset((
    "nfs", "nfs4", "lustre", "beegfs", "gpfs", "ceph", "cifs", "smb3", "smbfs", "glusterfs", "afs", "9p",
    "virtiofs", "ocfs2", "gfs2", "pvfs2", "orangefs", "wekafs", "panfs", "davfs", "autofs", "fuse"))
#: and every FUSE filesystem (fuse.sshfs, fuse.ceph-fuse, fuse.juicefs, fuse.s3fs ...)
NETWORK_FSTYPE_PREFIX = "fuse."

# $path: the scratch path (A-Z a-z 0-9 . _ + @ - / only: schema). The mount table's lines whose
# mount point is the path, above it or below it (mountinfo escapes blanks and newlines as \ooo:
# one mount a line whatever its name); fstab's lines that are not comments; the record; what the
# path is, and whether the directory has any entry (a count, no name: users may name files).
SCRATCH_SITE_SCRIPT = (
    "echo '" + MARK + " begin mounts'\n"
    "awk -v p=\"$path\" '{ m = $5 } m == p || m == \"/\" || index(p \"/\", m \"/\") == 1 || index(m, p \"/\") == 1'"
    " /proc/self/mountinfo 2>/dev/null\n"
    "echo '" + MARK + " begin fstab'\n"
    "grep -v '^[[:space:]]*#' /etc/fstab 2>/dev/null\n"
    "echo '" + MARK + " begin record'\n"
    "head -c 200 " + SCRATCH_RECORD + " 2>/dev/null; echo\n"
    "if awk -v p=\"$path\" '$5 == p { found = 1 } END { exit !found }' /proc/self/mountinfo 2>/dev/null; then\n"
    "  echo '" + MARK + " path mounted'\n"  # not looked into: a network filesystem may not answer
    "elif [ -L \"$path\" ]; then echo '" + MARK + " path link'\n"
    "elif [ -d \"$path\" ]; then\n"
    "  if [ -n \"$(find \"$path\" -mindepth 1 -maxdepth 1 -print -quit 2>/dev/null | head -c 1)\" ]; then\n"
    "    echo '" + MARK + " path dir-1'; else echo '" + MARK + " path dir-0'; fi\n"
    "elif [ -e \"$path\" ]; then echo '" + MARK + " path other'\n"
    "else echo '" + MARK + " path absent'; fi\n"
    "true"
)


@dataclass(frozen=True)
class Mount(JsonMixin):
    """One line of /proc/self/mountinfo: where, what type, from what, with which options."""

    target: str
    fstype: str
    source: str
    options: tuple[str, ...] = ()  # the mount's own (nosuid, nodev, ro...), not the filesystem's

    @property
    def network(self) -> bool:
        return self.fstype in NETWORK_FSTYPES or self.fstype.startswith(NETWORK_FSTYPE_PREFIX)


@dataclass(frozen=True)
class ScratchSiteData(JsonMixin):
    """What surrounds the scratch path: the mounts at, above and below it (in mount order), fstab's
    lines (fields), the UUID gpufleet recorded, and the path itself: absent | mounted (a mount
    point: not looked into) | link | other (not a directory) | empty | not-empty; None = not read."""

    mounts: tuple[Mount, ...] = ()
    fstab: tuple[tuple[str, ...], ...] = ()
    recorded_uuid: str | None = None
    path_state: str | None = None


_OCTAL = re.compile(r"\\([0-7]{3})")
_UUID = re.compile(r"[0-9A-Fa-f-]{8,64}")


def _unescape(text: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m[1], 8)), text)


def parse_scratch_site(lines: Sequence[str]) -> ScratchSiteData:
    sections, values = split_sections(lines)
    mounts = []
    for line in sections.get("mounts", []):
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            raise fail("expected a /proc/self/mountinfo line", line)
        mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), tuple(fields[5].split(","))))
    fstab = tuple(tuple(line.split()) for line in sections.get("fstab", []) if len(line.split()) >= 2)
    record = " ".join(sections.get("record", [])).strip()
    state = values.get("path")
    if state is not None and state.startswith("dir-"):
        state = "empty" if state == "dir-0" else "not-empty"
    return ScratchSiteData(tuple(mounts), fstab, record if _UUID.fullmatch(record) else None, state)


class ScratchSite(FactBase[ScratchSiteData]):
    """
    The scratch path's surroundings: mounts at, above and below it (the mount table lists what
    lsblk never does: NFS, Lustre, BeeGFS, GPFS, CephFS, autofs), /etc/fstab, the UUID of the
    scratch gpufleet made (SCRATCH_RECORD), and whether the directory is empty:

    .. code:: python

        ScratchSiteData(mounts=(Mount(target="/", fstype="ext4", source="/dev/vda"),
                        Mount(target="/scratch", fstype="nfs4", source="nas:/scratch")),
                        fstab=(("/dev/vda", "/", "ext4", "rw", "0", "1"),), recorded_uuid=None,
                        path_state="not-empty")
    """

    @override
    @staticmethod
    def default() -> ScratchSiteData:
        return ScratchSiteData()

    @override
    def command(self, path: str) -> str:
        return with_values(SCRATCH_SITE_SCRIPT, path=path)

    @override
    def process(self, output: list[str]) -> ScratchSiteData:
        return parse_scratch_site(output)
