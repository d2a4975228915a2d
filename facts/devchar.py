"""
Whether a `systemctl daemon-reload` would cut running GPU containers off their GPUs.

systemd keeps a container's device policy as `DeviceAllow=/dev/char/MAJ:MIN` entries (runc, with
the systemd cgroup driver, writes one per device it passes, and skips a device whose /dev/char
link is missing); every daemon-reload re-applies that policy. NVIDIA's device nodes come without
/dev/char links, so a container started with them loses them at the next reload ("Failed to
initialize NVML: Unknown Error": NVIDIA/nvidia-docker#1671, #1730; nvidia-container-toolkit#48,
#251, #1227). NVIDIA's fix is the links: `nvidia-ctk system create-dev-char-symlinks
--create-all`, at boot by a udev rule.

* ``DevCharLinks``: the NVIDIA character devices (/dev/nvidia*) that have no /dev/char link.
* ``DaemonReloadPending``: the units a reload was deferred for (gpufleet's marker, root's, in
  /run/gpufleet), so that the next run reloads once they are gone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin

PENDING_MARKER = "/run/gpufleet/daemon-reload-pending"
# "deferred" when the marker is there, then "active UNIT" for each unit it names that still runs
# (each name a quoted variable: the marker is root's, its names systemd's own scope names)
PENDING_COMMAND = ('f=/run/gpufleet/daemon-reload-pending; [ -f "$f" ] || exit 0; echo deferred; '
                   'set -f; for u in $(cat "$f"); do systemctl is-active --quiet -- "$u" 2>/dev/null && echo "active $u"; done; true')

# One line per NVIDIA character device: "MAJ:MIN PATH linked|missing".
DEV_CHAR_COMMAND = (
    'for d in /dev/nvidia*; do [ -c "$d" ] || continue; '
    "set -- $(stat -c '%t %T' \"$d\"); mm=$((0x$1)):$((0x$2)); "
    'if [ "$(readlink -f "/dev/char/$mm" 2>/dev/null)" = "$(readlink -f "$d")" ]; then s=linked; else s=missing; fi; '
    'echo "$mm $d $s"; done; true'
)

_DEVICE = re.compile(r"^(?P<mm>\d{1,4}:\d{1,7}) (?P<path>/dev/nvidia[A-Za-z0-9_-]*(?:/[A-Za-z0-9_-]+)*) (?P<state>linked|missing)$")
_UNIT = re.compile(r"[A-Za-z0-9:_.@-]{1,256}\.(?:scope|service)")


@dataclass(frozen=True)
class DevCharLinksData(JsonMixin):
    devices: dict[str, str] = field(default_factory=dict)   # /dev/nvidia0 -> "195:0"
    missing: list[str] = field(default_factory=list)        # devices without their /dev/char link


class DevCharLinks(FactBase):
    """NVIDIA character devices and whether /dev/char links to each (none on a host without the
    driver loaded: nothing to link)."""

    @override
    @staticmethod
    def default() -> DevCharLinksData:
        return DevCharLinksData()

    @override
    def command(self) -> str:
        return DEV_CHAR_COMMAND

    @override
    def process(self, output) -> DevCharLinksData:
        devices: dict[str, str] = {}
        missing: list[str] = []
        for line in output:
            match = _DEVICE.match(line.strip())
            if not match:
                continue
            devices[match["path"]] = match["mm"]
            if match["state"] == "missing":
                missing.append(match["path"])
        return DevCharLinksData(devices=devices, missing=sorted(missing))


@dataclass(frozen=True)
class ReloadPendingData(JsonMixin):
    deferred: bool = False                                # an earlier run deferred a daemon-reload
    active: list[str] = field(default_factory=list)       # the units it was deferred for that still run


class DaemonReloadPending(FactBase):
    """Whether an earlier run deferred a daemon-reload, and which of the container units it was
    deferred for still run. The marker is root's, in root's /run: no other user can write it."""

    @override
    @staticmethod
    def default() -> ReloadPendingData:
        return ReloadPendingData()

    @override
    def command(self) -> str:
        return PENDING_COMMAND

    @override
    def process(self, output) -> ReloadPendingData:
        lines = [line.strip() for line in output]
        active = sorted({line.split()[1] for line in lines
                         if len(line.split()) == 2 and line.startswith("active ") and _UNIT.fullmatch(line.split()[1])})
        return ReloadPendingData(deferred="deferred" in lines, active=active)
