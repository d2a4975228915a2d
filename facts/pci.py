"""
PCI facts read straight from /sys/bus/pci/devices, so they work with or without
the NVIDIA driver and on hosts without lspci (the recorded H200 hosts had none).

The facts return raw PCI ids; mapping ids to GPU models is done elsewhere
(``gpufleet.catalog.gpus.model_for_pci``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, fail, read_files, with_values

NVIDIA_VENDOR = "0x10de"
MELLANOX_VENDOR = "0x15b3"

PciKind = Literal["gpu", "nvswitch", "nic", "other"]


@dataclass(frozen=True)
class PciDevice(JsonMixin):
    slot: str  # sysfs form, e.g. '0000:00:06.0'
    vendor: str  # '0x10de'
    device_id: str  # '0x2335'
    pci_class: str  # '0x030200'
    subsystem_vendor: str | None  # '0x10de'
    subsystem_device: str | None  # '0x18bf'
    driver: str | None  # bound kernel driver ('nvidia', 'vfio-pci', 'nouveau') or None
    numa_node: int | None  # None when the kernel reports -1 (no NUMA affinity)
    kind: PciKind

    @property
    def bus_id(self) -> str:
        """The slot in nvidia-smi's form: '00000000:00:06.0'."""
        domain, _, rest = self.slot.partition(":")
        return f"{int(domain, 16):08X}:{rest.upper()}"


def classify(vendor: str, pci_class: str) -> PciKind:
    """
    Kind of a PCI function from its vendor and class code.

    NVIDIA class 0x03xxxx is a display controller (GPU: 0x0300 VGA on consumer
    boards, 0x0302 3D controller on data-centre boards); 0x0680xx is "other
    bridge", which NVIDIA uses for NVSwitch. Mellanox class 0x02xxxx is a network
    controller (0x0200 Ethernet, 0x0207 InfiniBand). Anything else (GPU audio and
    USB functions, ConnectX PCIe switches, BlueField management) is "other".
    """
    if vendor == NVIDIA_VENDOR:
        if pci_class.startswith("0x03"):
            return "gpu"
        if pci_class.startswith("0x0680"):
            return "nvswitch"
    if vendor == MELLANOX_VENDOR and pci_class.startswith("0x02"):
        return "nic"
    return "other"


# The command prints one line per function, the layout recorded on the H200
# hosts (tests/fixtures/nvidia/*/sys-pci.txt) plus subsys_vendor and numa:
#   0000:00:06.0 vendor=0x10de device=0x2335 class=0x030200 subsys_vendor=0x10de \
#       subsys=0x18bf driver=nvidia numa=0
# Only the shell's `read` and `readlink` are used (no `cat`: a fork and exec per file made this
# fact 55 ms on a no-op run); unreadable files print as empty values instead of failing.
# `sys_root` exists so tests can run the real command against a fake /sys tree.
def pci_command(sys_root: str = "/sys") -> str:
    return with_values(
        'for d in "$devices"/*; do '
        '[ -r "$d/vendor" ] || continue; '
        + read_files("$d", vendor="v") +
        'case "$v" in "$nvidia"|"$mellanox") ;; *) continue ;; esac; '
        'drv=; if [ -e "$d/driver" ]; then drv=$(readlink "$d/driver" 2>/dev/null); drv=${drv##*/}; fi; '
        + read_files("$d", device="dev", **{"class": "cls"}, subsystem_vendor="sv", subsystem_device="sd",
                     numa_node="numa") +
        'echo "${d##*/} vendor=$v device=$dev class=$cls subsys_vendor=$sv subsys=$sd driver=$drv numa=$numa"; '
        "done; true",
        devices=sys_root + "/bus/pci/devices", nvidia=NVIDIA_VENDOR, mellanox=MELLANOX_VENDOR,
    )


PCI_COMMAND = pci_command()

_SLOT = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HEX_ID = re.compile(r"^0x[0-9a-f]+$")


def parse_sys_pci(lines: list[str]) -> list[PciDevice]:
    """
    Parse the lines printed by ``PCI_COMMAND`` (or the recorded sys-pci.txt,
    which lacks subsys_vendor and numa) into PciDevice objects, sorted by slot.
    """
    devices = []
    for line in lines:
        if not line.strip():
            continue
        slot, *pairs = line.split()
        slot = slot.lower()
        if not _SLOT.match(slot):
            raise fail("expected a PCI slot like 0000:00:06.0 at the start of the line", line)
        fields: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep:
                raise fail("expected key=value after the PCI slot", line)
            fields[key] = value.lower()
        for key in ("vendor", "device", "class"):
            if not _HEX_ID.match(fields.get(key, "")):
                raise fail(f"missing or non-hex PCI {key}", line)
        numa = fields.get("numa", "")
        numa_node = int(numa) if re.fullmatch(r"\d+", numa) else None
        devices.append(
            PciDevice(
                slot=slot,
                vendor=fields["vendor"],
                device_id=fields["device"],
                pci_class=fields["class"],
                subsystem_vendor=fields.get("subsys_vendor") or None,
                subsystem_device=fields.get("subsys") or None,
                driver=fields.get("driver") or None,
                numa_node=numa_node,
                kind=classify(fields["vendor"], fields["class"]),
            )
        )
    return sorted(devices, key=lambda device: device.slot)


class PciDevices(FactBase[list[PciDevice]]):
    """
    Returns every NVIDIA (0x10de) and Mellanox (0x15b3) PCI function, bound to a
    driver or not, read from /sys/bus/pci/devices (no lspci needed):

    .. code:: python

        [
            PciDevice(slot="0000:00:06.0", vendor="0x10de", device_id="0x2335",
                      pci_class="0x030200", subsystem_vendor="0x10de",
                      subsystem_device="0x18bf", driver="nvidia", numa_node=0,
                      kind="gpu"),
        ]
    """

    @override
    @staticmethod
    def default() -> list[PciDevice]:
        return []

    @override
    def command(self) -> str:
        return PCI_COMMAND

    @override
    def process(self, output: list[str]) -> list[PciDevice]:
        return parse_sys_pci(output)


class NvidiaPciDevices(PciDevices):
    """
    Returns the NVIDIA GPUs and NVSwitches on the PCI bus, whether or not a
    driver is bound (``driver`` is None when none is):

    .. code:: python

        [
            PciDevice(slot="0000:00:06.0", vendor="0x10de", device_id="0x2335",
                      pci_class="0x030200", subsystem_vendor="0x10de",
                      subsystem_device="0x18bf", driver=None, numa_node=0,
                      kind="gpu"),
            PciDevice(slot="0000:05:00.0", vendor="0x10de", device_id="0x22a3",
                      pci_class="0x068000", ..., kind="nvswitch"),
        ]
    """

    @override
    def process(self, output: list[str]) -> list[PciDevice]:
        return [
            device
            for device in parse_sys_pci(output)
            if device.vendor == NVIDIA_VENDOR and device.kind in ("gpu", "nvswitch")
        ]


class MellanoxPciDevices(PciDevices):
    """
    Returns the Mellanox/NVIDIA Networking (ConnectX, BlueField) network
    functions on the PCI bus (class 0x02xxxx; bridges and management functions
    left out):

    .. code:: python

        [
            PciDevice(slot="0000:3b:00.0", vendor="0x15b3", device_id="0x1021",
                      pci_class="0x020700", subsystem_vendor="0x15b3",
                      subsystem_device="0x0023", driver="mlx5_core",
                      numa_node=0, kind="nic"),
        ]
    """

    @override
    def process(self, output: list[str]) -> list[PciDevice]:
        return [device for device in parse_sys_pci(output) if device.kind == "nic"]
