"""Storage operations: the local scratch filesystem (storage_scratch) and /dev/shm's size
(storage_shm_size), as planned by gpufleet/plans/storage.py from facts read right before.

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

from gpufleet.facts.storage import NETWORK_FSTYPE_PREFIX, NETWORK_FSTYPES

#: exit status of a refused format (EX_DATAERR), and how its line starts
REFUSED_EXIT = 65
REFUSED_MARK = "gpufleet: REFUSED:"

# $1 mount point, $2 XFS label, $3 md array name, $4 fstab options, $5 the UUID gpufleet recorded
# for its scratch before ("" if none: its fstab line is the one line for the path it may
# replace), $6 where it records the new one; then the drives.
_MAKE_SCRATCH = r"""
path=$1 label=$2 md=$3 opts=$4 own=$5 record=$6; shift 6
refuse() { echo "gpufleet: REFUSED: $1" >&2; exit 65; }
# the path as planning saw it (gpufleet/plans/storage.py path_refusal): checked before anything is
# formatted and again right before the mount, since the site may mount something meanwhile
check_path() {
  why=
  if [ -n "$(findmnt -rn -o TARGET --mountpoint "$path" 2>/dev/null)" ]; then
    why="$path is already a mount point ($(findmnt -rn -o SOURCE,FSTYPE --mountpoint "$path" | head -n 1))"
  elif [ -n "$(findmnt -rn -o TARGET | awk -v p="$path/" 'index($0, p) == 1')" ]; then
    why="$path has filesystems mounted below it"
  else
    d=$path; while [ ! -e "$d" ] && [ "$d" != / ]; do d=$(dirname "$d"); done
    t=$(findmnt -n -o FSTYPE -T "$d" 2>/dev/null)
    case $t in
      NETWORK_TYPES)
        why="$path lies on $t ($(findmnt -n -o SOURCE,TARGET -T "$d"))";;
    esac
  fi
  line=$(awk -v p="$path" -v u="UUID=$own" '$1 !~ /^#/ && $2 == p && ($1 != u || u == "UUID=")' /etc/fstab)
  [ -n "$why" ] || [ -z "$line" ] || why="/etc/fstab already has a line for $path: $line"
  if [ -z "$why" ] && [ -L "$path" ]; then why="$path is a symbolic link"
  elif [ -z "$why" ] && [ -e "$path" ] && [ ! -d "$path" ]; then why="$path is not a directory"
  elif [ -z "$why" ] && [ -d "$path" ] && [ -n "$(find "$path" -mindepth 1 -maxdepth 1 -print -quit | head -c 1)" ]; then why="$path is not empty"
  fi
  [ -z "$why" ] || refuse "$why (storage_scratch_path): $1"
}
for dev in "$@"; do
  [ -b "$dev" ] || refuse "$dev is not a block device: nothing formatted"
  blkid -p -o export "$dev" >/dev/null 2>&1; rc=$?
  [ $rc -eq 2 ] || refuse "$dev is not blank now (blkid -p exit $rc: $(blkid -p -o export "$dev" 2>&1 | tr '\n' ' ')): nothing formatted"
  [ -z "$(wipefs -n "$dev" 2>&1)" ] || refuse "$dev is not blank now (wipefs -n: $(wipefs -n "$dev" 2>&1 | tr '\n' ' ')): nothing formatted"
  [ "$(lsblk -nr -o NAME "$dev" | wc -l)" -eq 1 ] || refuse "$dev now holds $(lsblk -nr -o NAME "$dev" | tail -n +2 | tr '\n' ' '): nothing formatted"
  [ -z "$(lsblk -nr -o MOUNTPOINT "$dev" | tr -d '\n')" ] || refuse "$dev is mounted: nothing formatted"
  # a process holding the drive open (a benchmark, dd, another tool's format) is using it
  real=$(readlink -f "$dev")
  holder=$(find /proc/[0-9]*/fd -lname "$real" 2>/dev/null | head -n 1)
  [ -z "$holder" ] || refuse "$dev is held open by process ${holder#/proc/} : nothing formatted"
done
check_path "nothing formatted"
set -e
if [ $# -eq 1 ]; then
  target=$1
else
  mkdir -p /etc/mdadm
  mdadm --create "/dev/md/$md" --run --level=0 --metadata=1.2 --homehost=any --name="$md" --raid-devices=$# "$@"
  target=/dev/md/$md
  # one ARRAY line for the array however often it is made again (a cloud's blank drives)
  conf=$(mktemp /etc/mdadm/mdadm.conf.gpufleet.XXXXXX)
  [ ! -f /etc/mdadm/mdadm.conf ] || awk -v d="/dev/md/$md" -v m="$md" '{ keep = 1 }
    $1 == "ARRAY" { if ($2 == d) keep = 0; for (i = 2; i <= NF; i++) if ($i == "name=" m || $i ~ ("^name=[^:]*:" m "$")) keep = 0 }
    keep' /etc/mdadm/mdadm.conf > "$conf"
  mdadm --detail --brief "$target" >> "$conf"
  chmod 644 "$conf"
  mv "$conf" /etc/mdadm/mdadm.conf
fi
mkfs.xfs -q -L "$label" "$target"
uuid=$(blkid -p -s UUID -o value "$target")
[ -n "$uuid" ]
mkdir -p "${record%/*}"
tmp=$(mktemp "$record.XXXXXX")
echo "$uuid" > "$tmp"
chmod 644 "$tmp"
mv "$tmp" "$record"
set +e
check_path "the filesystem $uuid is made on $target but not mounted, /etc/fstab unchanged"
set -e
mkdir -p "$path"
# the root disk's directory under the scratch: sealed, so that while the scratch is not mounted
# (a drive lost, instance-store NVMe blank after a stop/start) no job writes there by mistake
chattr -i "$path" 2>/dev/null || true
chmod a=,ug-s,-t "$path"
chattr +i "$path" 2>/dev/null || true
mount -t xfs -o "$(echo "$opts" | sed 's/,*nofail//')" "$target" "$path"
# only once the mount worked: fstab's line (the old one of gpufleet's scratch at this path, if
# any, is replaced; check_path refused any other)
tmp=$(mktemp /etc/fstab.gpufleet.XXXXXX)
awk -v p="$path" -v u="UUID=$own" '!($1 !~ /^#/ && $2 == p && $1 == u)' /etc/fstab > "$tmp"
echo "UUID=$uuid $path xfs $opts 0 0" >> "$tmp"
chmod 644 "$tmp"
mv "$tmp" /etc/fstab
echo "scratch: $target (UUID $uuid) mounted at $path"
""".replace("NETWORK_TYPES", "|".join(sorted(NETWORK_FSTYPES)) + "|" + NETWORK_FSTYPE_PREFIX + "*")


@operation(is_idempotent=False)
def scratch_filesystem(path: str, label: str, md_name: str, options: str, own_uuid: str, record: str,
                       devices: list[str]) -> Generator[StringCommand, None, None]:
    """Make the scratch filesystem on blank drives: XFS on one, md RAID0 + XFS on several; in
    /etc/fstab by UUID, mounted at `path`. Planned only on drives found blank right before.

    + path: the mount point; label, md_name, options: see gpufleet/plans/storage.py
    + own_uuid: the UUID recorded for gpufleet's previous scratch ("" if none); record: where the new one is recorded
    + devices: the drives (each probed again on the host; any not blank: nothing is done)
    """
    if not devices:
        host.noop("no drive for the scratch filesystem")
        return
    yield StringCommand("sh", "-c", QuoteString(_MAKE_SCRATCH), "gpufleet-scratch", QuoteString(path),
                        QuoteString(label), QuoteString(md_name), QuoteString(options),
                        QuoteString(own_uuid), QuoteString(record),
                        *(QuoteString(d) for d in devices))


#: $1 the mount point, $2 the filesystem's UUID, $3 the mount options: the root disk's directory
#: under it sealed first (see _MAKE_SCRATCH), then mounted
_MOUNT_SCRATCH = r"""
path=$1 uuid=$2 opts=$3
set -e
mkdir -p "$path"
chattr -i "$path" 2>/dev/null || true
chmod a=,ug-s,-t "$path"
chattr +i "$path" 2>/dev/null || true
mount -t xfs -o "$opts" "UUID=$uuid" "$path"
"""


@operation()
def mounted(path: str, is_mounted: bool, uuid: str, options: str,
            remount: bool = False) -> Generator[StringCommand, None, None]:
    """Mount the scratch `uuid` at `path` with `options` (fstab's, without nofail), unless it was
    mounted when planned; mounted without nosuid,nodev (made before they were set): remounted
    with them. The mount point is made first: after storage_scratch_path changed, the new path
    does not exist yet."""
    options = ",".join(o for o in options.split(",") if o != "nofail")
    if is_mounted and remount:
        yield StringCommand("mount", "-o", QuoteString(f"remount,{options}"), "--", QuoteString(path))
        return
    if is_mounted:
        host.noop(f"{path} is mounted")
        return
    yield StringCommand("sh", "-c", QuoteString(_MOUNT_SCRATCH), "gpufleet-scratch-mount", QuoteString(path),
                        QuoteString(uuid), QuoteString(options))


@operation()
def shm_size(setting: str, remount: bool, why: str) -> Generator[StringCommand, None, None]:
    """Remount /dev/shm with `size=setting` when its size differs (a tmpfs keeps its content)."""
    if not remount:
        host.noop(f"/dev/shm already has the size size={setting} gives ({why})")
        return
    yield StringCommand("mount", "-o", QuoteString(f"remount,size={setting}"), "/dev/shm")
