"""Storage operations: the local scratch filesystem (storage_scratch) and /dev/shm's size
(storage_shm_size), as planned by gpufleet/storage.py from facts read right before.

``scratch_filesystem`` formats drives: the one destructive step gpufleet has. The plan took
only drives blank by lsblk and by a blkid -p probe; the command is a fixed script given the
drives as arguments that probes each again on the host, in the same command, right before
mdadm and mkfs, and refuses all of them (exit 65, naming the drive) when one gained a
signature, a partition, a holder or a mount since planning: nothing is formatted then.

The array is recorded in /etc/mdadm/mdadm.conf; the initramfs is not rebuilt for it (nothing
in early boot needs the scratch: udev's incremental assembly, or gpufleet-scratch.service,
assembles it from the root filesystem).
"""
from __future__ import annotations

from collections.abc import Generator

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

#: exit status of a refused format (EX_DATAERR), and how its line starts
REFUSED_EXIT = 65
REFUSED_MARK = "gpufleet: REFUSED:"

# $1 mount point, $2 XFS label, $3 md array name, $4 fstab options, then the drives.
_MAKE_SCRATCH = r"""
path=$1 label=$2 md=$3 opts=$4; shift 4
refuse() { echo "gpufleet: REFUSED: $1: nothing formatted" >&2; exit 65; }
for dev in "$@"; do
  [ -b "$dev" ] || refuse "$dev is not a block device"
  blkid -p -o export "$dev" >/dev/null 2>&1; rc=$?
  [ $rc -eq 2 ] || refuse "$dev is not blank now (blkid -p exit $rc: $(blkid -p -o export "$dev" 2>&1 | tr '\n' ' '))"
  [ -z "$(wipefs -n "$dev" 2>&1)" ] || refuse "$dev is not blank now (wipefs -n: $(wipefs -n "$dev" 2>&1 | tr '\n' ' '))"
  [ "$(lsblk -nr -o NAME "$dev" | wc -l)" -eq 1 ] || refuse "$dev now holds $(lsblk -nr -o NAME "$dev" | tail -n +2 | tr '\n' ' ')"
  [ -z "$(lsblk -nr -o MOUNTPOINT "$dev" | tr -d '\n')" ] || refuse "$dev is mounted"
done
set -e
if [ $# -eq 1 ]; then
  target=$1
else
  mkdir -p /etc/mdadm
  mdadm --create "/dev/md/$md" --run --level=0 --metadata=1.2 --homehost=any --name="$md" --raid-devices=$# "$@"
  target=/dev/md/$md
  mdadm --detail --brief "$target" >> /etc/mdadm/mdadm.conf
fi
mkfs.xfs -q -L "$label" "$target"
uuid=$(blkid -p -s UUID -o value "$target")
[ -n "$uuid" ]
mkdir -p "$path"
tmp=$(mktemp /etc/fstab.gpufleet.XXXXXX)
awk -v p="$path" '$2 != p' /etc/fstab > "$tmp"
echo "UUID=$uuid $path xfs $opts 0 0" >> "$tmp"
chmod 644 "$tmp"
mv "$tmp" /etc/fstab
mount "$path"
echo "scratch: $target (UUID $uuid) mounted at $path"
"""


@operation(is_idempotent=False)
def scratch_filesystem(path: str, label: str, md_name: str, options: str,
                       devices: list[str]) -> Generator[StringCommand, None, None]:
    """Make the scratch filesystem on blank drives: XFS on one, md RAID0 + XFS on several; in
    /etc/fstab by UUID, mounted at `path`. Planned only on drives found blank right before.

    + path: the mount point; label, md_name, options: see gpufleet/storage.py
    + devices: the drives (each probed again on the host; any not blank: nothing is done)
    """
    if not devices:
        host.noop("no drive for the scratch filesystem")
        return
    yield StringCommand("sh", "-c", QuoteString(_MAKE_SCRATCH), "gpufleet-scratch", QuoteString(path),
                        QuoteString(label), QuoteString(md_name), QuoteString(options),
                        *(QuoteString(d) for d in devices))


@operation()
def mounted(path: str, is_mounted: bool) -> Generator[StringCommand, None, None]:
    """Mount `path` as /etc/fstab says, unless it was mounted when planned. The mount point is
    made first: after storage_scratch_path changed, the new path does not exist yet."""
    if is_mounted:
        host.noop(f"{path} is mounted")
        return
    yield StringCommand("mkdir", "-p", "--", QuoteString(path), "&&", "mount", "--", QuoteString(path))


@operation()
def shm_size(setting: str, remount: bool, why: str) -> Generator[StringCommand, None, None]:
    """Remount /dev/shm with `size=setting` when its size differs (a tmpfs keeps its content)."""
    if not remount:
        host.noop(f"/dev/shm already has the size size={setting} gives ({why})")
        return
    yield StringCommand("mount", "-o", QuoteString(f"remount,size={setting}"), "/dev/shm")
