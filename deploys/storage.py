"""The data path: local NVMe scratch and /dev/shm, sized from the tier.

Story of a host, part 6: training reads its datasets from local NVMe and shares tensors
between DataLoader workers through /dev/shm.

1. scratch (``storage_scratch``: none | auto): the blank local drives become one XFS
   filesystem at ``storage_scratch_path`` (default /scratch): XFS on a single drive, md RAID0
   (``/dev/md/gpufleet-scratch``) then XFS on several. Which drives: ``storage_scratch_devices``
   (``auto`` = every blank NVMe disk; or a list). A drive with anything on it (filesystem,
   partition table, md or LVM member, a mount) is never formatted: ``auto`` leaves it alone and
   says so, a list naming it refuses the host at planning. The format command probes each
   drive again right before mkfs and refuses, naming it, one that gained a signature since.
   Never at a path where the site keeps something (a mount at, below or a network filesystem
   above it, another fstab line, a link, a non-empty directory: refused, naming
   storage_scratch_path; gpufleet/plans/storage.py path_refusal). Adopted only by the UUID gpufleet
   recorded when it made it (SCRATCH_RECORD), never by its label alone.
   Mounted with nosuid,nodev,noatime, in /etc/fstab by UUID with nofail and a 30 s device
   timeout (gpufleet/plans/storage.py DEVICE_TIMEOUT; written once the mount worked), the root disk's directory under it sealed; owned by root and the tier's group
   (``storage_scratch_group``), mode 3770 (the group writes, files keep the group, only their
   owner deletes them). At boot systemd's fstab mount mounts it (udev assembles the array);
   ``gpufleet-scratch.service``, ordered after that mount, assembles and mounts it only where
   it did not happen (a container without udev, an array udev did not assemble), and fails,
   saying so, where no drive holds it (a cloud's instance store is blank after a stop/start:
   the next run makes it again). An existing scratch is kept as it is, never rebuilt or grown.
   A changed ``storage_scratch_path`` moves it: mounted at the new path, fstab's line moved (not
   a second one); the old path stays mounted, since jobs may hold files there, until the
   operator unmounts it or the host reboots, which the run says at its end.
2. /dev/shm (``storage_shm_size``: a size such as 64g, a share of RAM such as 50%, or
   unmanaged): remounted now when its size differs, and in /etc/fstab for every boot
   (systemd-remount-fs applies it). Containers get their own /dev/shm (docker_shm_size).

Formatting blank drives interrupts nothing running, so it does not wait for idle GPUs; what
protects data is that only blank drives are ever touched.
"""
from __future__ import annotations

import re
from io import StringIO
from typing import TYPE_CHECKING

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.server import Groups
from pyinfra.operations import apt, files, server, systemd

from gpufleet.explain import explained
from gpufleet.plans import storage as s
from gpufleet.facts.storage import SCRATCH_RECORD, ScratchSite, ShmSize
from gpufleet.config.failures import Refused
from gpufleet.config.hostfacts import block_devices, resources
from gpufleet.rendering import render
from gpufleet.controller.run_summary import outcome
from gpufleet.config.settings import host_settings
from gpufleet.operations import storage as ops
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.notice import say

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

SCRATCH_SERVICE = "gpufleet-scratch.service"
SCRATCH_UNIT = "/etc/systemd/system/gpufleet-scratch.service"
SCRATCH_SCRIPT = "/usr/local/sbin/gpufleet-scratch-mount"
SCRATCH_MODE = "3770"


def _fstab_regex(path: str) -> str:
    return "^[^#[:space:]]+[[:space:]]+" + re.escape(path) + "[[:space:]]"


def _scratch_fstab_regex(path: str, uuid: str) -> str:
    """fstab's line for the scratch: the one at `path`, or the one of its UUID at another path
    (storage_scratch_path changed), which then becomes the line at `path`, not a second one."""
    return f"^(UUID={re.escape(uuid)}[[:space:]]|[^#[:space:]]+[[:space:]]+{re.escape(path)}[[:space:]])"


def _scratch(settings: Settings, plan: s.ScratchPlan) -> None:
    moved = tuple(s.moved_note(plan.devices[0], old, plan.path) for old in plan.also_mounted)
    for note in plan.notes:
        if note not in moved:  # those are warnings (below), not said a second time under -v
            say(f"storage_scratch: {note}")
    if plan.also_mounted:  # said now and at the end of the run: the operator has a step to take
        outcome(host).scratch_moved = f"still mounted at {', '.join(plan.also_mounted)} (now {plan.path})"
        for note in moved:
            logger.warning(f"{host.print_prefix}storage_scratch: {note}")
    if plan.action == s.NOTHING:
        if settings.storage_scratch == "none":
            host.noop("storage_scratch: none: no scratch filesystem")
        return
    raid = plan.layout == "raid0" or plan.devices[0].startswith("/dev/md")
    apt.packages(name=explained("Install xfsprogs" + (" and mdadm" if raid else ""), "The tools to make the scratch filesystem (XFS), and md RAID0 over several drives"),
                 packages=["xfsprogs", "mdadm"] if raid else ["xfsprogs"], no_recommends=True)
    group = settings.storage_scratch_group
    if group not in host.get_fact(Groups):
        server.group(name=explained(f"Add group {group}", f"Make the group {group} that owns the scratch"), group=group)
    if plan.action == s.MAKE:
        ops.scratch_filesystem(name=explained("Make the scratch filesystem", f"Make the scratch filesystem: {plan.summary()}; each drive probed blank again "
                                                                          "right before mdadm and mkfs"), path=plan.path,
                               label=s.SCRATCH_LABEL, md_name=s.MD_NAME, options=s.MOUNT_OPTIONS,
                               own_uuid=plan.lost or "", record=SCRATCH_RECORD, devices=list(plan.devices))
    else:
        assert plan.uuid
        ops.mounted(name=explained(f"Mount {plan.path}", f"Mount the scratch at {plan.path} (nosuid,nodev,noatime)"), path=plan.path, is_mounted=plan.mounted,
                    uuid=plan.uuid, options=s.MOUNT_OPTIONS, remount=plan.remount)
        # after the mount worked: a line that does not mount leaves the boot to nofail's mercy
        files.line(name=explained(f"Add {plan.path} to /etc/fstab", f"Mount the scratch at {plan.path} by UUID at every boot "
                                                                  "(/etc/fstab, nofail), written once the mount worked"), path="/etc/fstab",
                   line=_scratch_fstab_regex(plan.path, plan.uuid), extended_regex=True,
                   replace=f"UUID={plan.uuid} {plan.path} xfs {s.MOUNT_OPTIONS} 0 0")
        files.put(name=explained("Record the scratch UUID", "Record the scratch filesystem's UUID (gpufleet adopts that filesystem only)"),
                  src=StringIO(plan.uuid + "\n"), dest=SCRATCH_RECORD, mode="644")
    files.directory(name=explained(f"Set {plan.path} owner and mode", f"Give the scratch to the group {group} (mode {SCRATCH_MODE})"), path=plan.path,
                    user="root", group=group, mode=SCRATCH_MODE)
    context = dict(tier=settings.tier, path=plan.path, md_name=s.MD_NAME if raid else "",
                   mount_unit=s.mount_unit(plan.path))
    files.put(name=explained("Install the scratch script", "Install the script that mounts the scratch at boot"),
              src=StringIO(render("usr/local/sbin/gpufleet-scratch-mount.j2", **context)), dest=SCRATCH_SCRIPT,
              mode="755")
    unit = files.put(name=explained("Install the scratch unit", "Install the unit that assembles and mounts the scratch at boot where udev "
                                                      "and fstab did not"),
                     src=StringIO(render("etc/systemd/system/gpufleet-scratch.service.j2", **context)),
                     dest=SCRATCH_UNIT, mode="644")
    reload_when(explained("Reload systemd: scratch unit", "Reload systemd so it sees the scratch unit"), unit)
    systemd.service(name=explained("Enable the scratch unit", "Mount the scratch at every boot"), service=SCRATCH_SERVICE, running=None, enabled=True)


def _shm(plan: s.ShmPlan) -> None:
    if not plan.line:
        host.noop("storage_shm_size: unmanaged: /dev/shm left as it is")
        return
    files.line(name=explained("Add /dev/shm to /etc/fstab", f"Size /dev/shm at every boot (size={plan.setting}, /etc/fstab)"), path="/etc/fstab",
               line=_fstab_regex("/dev/shm"), replace=plan.line, extended_regex=True)
    ops.shm_size(name=explained(f"Size /dev/shm: {plan.setting}", f"Size /dev/shm now (size={plan.setting}, a remount)"), setting=plan.setting, remount=plan.remount,
                 why=plan.note)


@deploy("Storage")
def storage() -> None:
    settings = host_settings(host)
    try:
        scratch = s.plan_scratch(settings.storage_scratch, settings.storage_scratch_devices,
                                 settings.storage_scratch_path, block_devices(host),
                                 lambda: host.get_fact(ScratchSite, path=settings.storage_scratch_path))
        shm = s.plan_shm(settings.storage_shm_size, host.get_fact(ShmSize), resources(host).memory_total_kib)
    except Refused as refused:
        refused.refusal.stop(host)
        return
    _scratch(settings, scratch)
    _shm(shm)


# `pyinfra INVENTORY deploys/storage.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
