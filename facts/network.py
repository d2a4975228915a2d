"""
Network facts read from /sys (no `ip`, `ibstat` or `ibv_devinfo` needed):
physical-ish network interfaces, and RDMA devices with their ports.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, fail, read_files, with_values

# Interfaces the deploys never configure: loopback, container and VM plumbing.
EXCLUDED_INTERFACES = re.compile(r"^(lo|docker.*|veth.*|br-.*|virbr.*)$")

# ARPHRD_* values from <linux/if_arp.h> for the types we care about.
_LINK_TYPES = {1: "ethernet", 32: "infiniband", 772: "loopback", 65534: "none"}
_PCI_SLOT = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class NetInterface(JsonMixin):
    name: str
    operstate: str | None  # 'up', 'down', 'unknown'
    mac: str | None  # 20 bytes for InfiniBand
    mtu: int | None
    type: int | None  # ARPHRD number: 1 ethernet, 32 infiniband
    # The bus device behind the interface: a PCI slot ('0000:3b:00.0'), a
    # virtio device ('virtio2'), or None for software interfaces.
    device: str | None
    driver: str | None  # 'mlx5_core', 'virtio_net'; None for software interfaces
    # /sys/class/net/X/speed in Mbit/s; None when the link is down or the driver does not say
    # (virtio_net and most virtual interfaces report -1 or refuse the read)
    speed_mbps: int | None = None

    @property
    def kind(self) -> str:
        return _LINK_TYPES.get(self.type or -1, "other")

    @property
    def pci_slot(self) -> str | None:
        return self.device if self.device and _PCI_SLOT.match(self.device) else None

    @property
    def virtual(self) -> bool:
        """No backing device: bonds, bridges, VLANs, ifb, dummies."""
        return self.device is None


def net_command(sys_root: str = "/sys") -> str:
    """
    One line of KEY=VALUE per interface (all of them; process() filters).
    `sys_root` exists so tests can run the real command against a fake tree.
    """
    return with_values(
        'for i in "$net"/*; do '
        '[ -e "$i" ] || continue; '
        'dev=; if [ -e "$i/device" ]; then dev=$(readlink "$i/device" 2>/dev/null); dev=${dev##*/}; fi; '
        'drv=; if [ -e "$i/device/driver" ]; then drv=$(readlink "$i/device/driver" 2>/dev/null); drv=${drv##*/}; fi; '
        + read_files("$i", operstate="state", address="mac", mtu="mtu", type="type", speed="speed") +
        'echo "name=${i##*/} operstate=$state mac=$mac mtu=$mtu type=$type device=$dev driver=$drv speed=$speed"; '
        "done; true",
        net=sys_root + "/class/net",
    )


def _opt_number(value: str, what: str, line: str) -> int | None:
    if not value:
        return None
    if not value.isdigit():
        raise fail(f"expected a number for {what}", line)
    return int(value)


def _speed(value: str) -> int | None:
    """Mbit/s, or None for -1 / empty / anything else (unknown speed is not a speed)."""
    return int(value) if value.isdigit() and int(value) > 0 else None


def parse_net(lines: Sequence[str], include_all: bool = False) -> list[NetInterface]:
    """Parse net_command output; drops EXCLUDED_INTERFACES unless include_all."""
    interfaces = []
    for line in lines:
        if not line.strip():
            continue
        fields: dict[str, str] = {}
        for pair in line.split():
            key, sep, value = pair.partition("=")
            if not sep:
                raise fail("expected KEY=VALUE in network interface line", line)
            fields[key] = value
        name = fields.get("name")
        if not name:
            raise fail("network interface line without a name", line)
        if not include_all and EXCLUDED_INTERFACES.match(name):
            continue
        interfaces.append(
            NetInterface(
                name=name,
                operstate=fields.get("operstate") or None,
                mac=fields.get("mac") or None,
                mtu=_opt_number(fields.get("mtu", ""), "mtu", line),
                type=_opt_number(fields.get("type", ""), "type", line),
                device=fields.get("device") or None,
                driver=fields.get("driver") or None,
                speed_mbps=_speed(fields.get("speed", "")),
            )
        )
    return sorted(interfaces, key=lambda interface: interface.name)


class NetworkInterfaces(FactBase[list[NetInterface]]):
    """
    Returns the host's network interfaces from /sys/class/net, without lo,
    docker*, veth*, br-* and virbr*:

    .. code:: python

        [
            NetInterface(name="eth0", operstate="up", mac="52:54:00:12:34:56",
                         mtu=1500, type=1, device="virtio2", driver="virtio_net"),
            NetInterface(name="ib0", operstate="up",
                         mac="00:00:10:29:fe:80:00:00:00:00:00:00:b8:3f:d2:03:00:aa:bb:cc",
                         mtu=4092, type=32, device="0000:3b:00.0",
                         driver="mlx5_core"),
        ]
    """

    @override
    @staticmethod
    def default() -> list[NetInterface]:
        return []

    @override
    def command(self) -> str:
        return net_command()

    @override
    def process(self, output: list[str]) -> list[NetInterface]:
        return parse_net(output)


@dataclass(frozen=True)
class RdmaPort(JsonMixin):
    port: int
    link_layer: str | None  # 'InfiniBand' | 'Ethernet'
    state: str | None  # 'ACTIVE', 'DOWN', 'INIT' (the "4: " number dropped)
    phys_state: str | None  # 'LinkUp', 'Disabled', 'Polling'
    rate: str | None  # '400 Gb/sec (4X NDR)'

    @property
    def rate_gbps(self) -> float | None:
        match = re.match(r"(\d+(?:\.\d+)?) Gb/sec", self.rate or "")
        return float(match.group(1)) if match else None


@dataclass(frozen=True)
class RdmaDevice(JsonMixin):
    name: str  # 'mlx5_0'
    pci_slot: str | None
    node_guid: str | None
    fw_ver: str | None
    netdevs: list[str] = field(default_factory=list)  # ['ib0']
    ports: list[RdmaPort] = field(default_factory=list)

    @property
    def link_layer(self) -> str | None:
        """Link layer of the device's ports ('InfiniBand' or 'Ethernet')."""
        layers = {port.link_layer for port in self.ports if port.link_layer}
        return layers.pop() if len(layers) == 1 else None


def rdma_command(sys_root: str = "/sys") -> str:
    """
    Lines "dev NAME KEY VALUE..." and "port NAME N KEY VALUE..." (values such
    as "4: ACTIVE" contain blanks, so they come last on the line).
    """
    return with_values("\n".join(
        [
            # a FILE PREFIX: print PREFIX and the file's first line, if readable.
            'a() { if [ -r "$1" ]; then echo "$2 $(head -n1 "$1" 2>/dev/null)"; fi; }',
            'for d in "$ib"/*; do',
            '  [ -d "$d" ] || continue',
            '  n=${d##*/}',
            '  if [ -e "$d/device" ]; then s=$(readlink "$d/device" 2>/dev/null); echo "dev $n pci ${s##*/}"; fi',
            '  a "$d/node_guid" "dev $n node_guid"',
            '  a "$d/fw_ver" "dev $n fw_ver"',
            '  for x in "$d"/device/net/*; do if [ -e "$x" ]; then echo "dev $n netdev ${x##*/}"; fi; done',
            '  for p in "$d"/ports/*; do',
            '    [ -d "$p" ] || continue',
            '    for k in link_layer state phys_state rate; do a "$p/$k" "port $n ${p##*/} $k"; done',
            "  done",
            "done",
            "true",
        ]
    ), ib=sys_root + "/class/infiniband")


def parse_rdma(lines: Sequence[str]) -> list[RdmaDevice]:
    """Parse rdma_command output into devices sorted by name, ports by number."""
    devices: dict[str, dict] = {}
    ports: dict[str, dict[int, dict[str, str]]] = {}
    for line in lines:
        if not line.strip():
            continue
        words = line.split(None, 3)
        if words[0] == "dev" and len(words) >= 3:
            name, key = words[1], words[2]
            value = words[3].strip() if len(words) == 4 else ""
            device = devices.setdefault(name, {"netdevs": []})
            ports.setdefault(name, {})
            if key == "netdev":
                device["netdevs"].append(value)
            elif key in ("pci", "node_guid", "fw_ver"):
                device[key] = value or None
            else:
                raise fail("unexpected RDMA device attribute", line)
        elif words[0] == "port" and len(words) == 4:
            name, number = words[1], words[2]
            key, _, value = words[3].partition(" ")
            if not number.isdigit() or key not in ("link_layer", "state", "phys_state", "rate"):
                raise fail("unexpected RDMA port line", line)
            devices.setdefault(name, {"netdevs": []})
            ports.setdefault(name, {}).setdefault(int(number), {})[key] = value.strip()
        else:
            raise fail("expected 'dev ...' or 'port ...' in RDMA output", line)

    def state(value: str | None) -> str | None:
        # "4: ACTIVE" -> "ACTIVE"; "5: LinkUp" -> "LinkUp"
        if not value:
            return None
        return value.split(":", 1)[1].strip() if ":" in value else value

    result = []
    for name in sorted(devices):
        device = devices[name]
        result.append(
            RdmaDevice(
                name=name,
                pci_slot=device.get("pci"),
                node_guid=device.get("node_guid"),
                fw_ver=device.get("fw_ver"),
                netdevs=sorted(device["netdevs"]),
                ports=[
                    RdmaPort(
                        port=number,
                        link_layer=attrs.get("link_layer") or None,
                        state=state(attrs.get("state")),
                        phys_state=state(attrs.get("phys_state")),
                        rate=attrs.get("rate") or None,
                    )
                    for number, attrs in sorted(ports.get(name, {}).items())
                ],
            )
        )
    return result


class RdmaDevices(FactBase[list[RdmaDevice]]):
    """
    Returns the RDMA devices in /sys/class/infiniband with their ports:

    .. code:: python

        [
            RdmaDevice(name="mlx5_0", pci_slot="0000:3b:00.0",
                       node_guid="b83f:d203:00aa:bbcc", fw_ver="28.39.1002",
                       netdevs=["ib0"],
                       ports=[RdmaPort(port=1, link_layer="InfiniBand",
                                       state="ACTIVE", phys_state="LinkUp",
                                       rate="400 Gb/sec (4X NDR)")]),
        ]
    """

    @override
    @staticmethod
    def default() -> list[RdmaDevice]:
        return []

    @override
    def command(self) -> str:
        return rdma_command()

    @override
    def process(self, output: list[str]) -> list[RdmaDevice]:
        return parse_rdma(output)


# ------------------------------------------------------------------------------------------
# Port counters: read before and after an acceptance (gpufleet/plans/acceptance.py)
# ------------------------------------------------------------------------------------------

#: the counters an erroring or flapping link grows (/sys/class/infiniband/DEV/ports/N/counters)
IB_COUNTERS = ("symbol_error", "link_downed", "link_error_recovery", "port_rcv_errors",
               "local_link_integrity_errors")


@dataclass(frozen=True)
class IbPortCounters(JsonMixin):
    device: str
    port: int
    state: str | None = None        # "ACTIVE"
    phys_state: str | None = None   # "LinkUp"
    counters: dict[str, int] = field(default_factory=dict)


def ib_counters_command(sys_root: str = "/sys") -> str:
    """Lines "DEV PORT state|phys_state|COUNTER VALUE" for every port of every RDMA device."""
    return with_values("\n".join([
        'for p in "$ib"/*/ports/*; do',
        '  [ -d "$p" ] || continue',
        '  d=${p%/ports/*}; d=${d##*/}; n=${p##*/}',
        '  for k in state phys_state; do [ -r "$p/$k" ] && echo "$d $n $k $(head -n1 "$p/$k")"; done',
        '  for k in $counters; do [ -r "$p/counters/$k" ] && echo "$d $n $k $(head -n1 "$p/counters/$k")"; done',
        "done",
        "true",
    ]), ib=sys_root + "/class/infiniband", counters=" ".join(IB_COUNTERS))


def parse_ib_counters(lines: Sequence[str]) -> list[IbPortCounters]:
    ports: dict[tuple[str, int], dict] = {}
    for line in lines:
        words = line.split(None, 3)
        if not words:
            continue
        if len(words) < 3 or not words[1].isdigit():
            raise fail("expected 'DEV PORT KEY VALUE' in the port counters", line)
        device, number, key = words[0], int(words[1]), words[2]
        value = words[3].strip() if len(words) == 4 else ""
        port = ports.setdefault((device, number), {"counters": {}})
        if key in ("state", "phys_state"):
            # "4: ACTIVE" -> "ACTIVE"
            port[key] = value.split(":", 1)[1].strip() if ":" in value else value
        elif key in IB_COUNTERS:
            if not value.isdigit():
                raise fail(f"counter {key} is not a number", line)
            port["counters"][key] = int(value)
        else:
            raise fail("unexpected port counter", line)
    return [IbPortCounters(device=d, port=n, state=v.get("state"), phys_state=v.get("phys_state"),
                           counters=v["counters"]) for (d, n), v in sorted(ports.items())]


class IbCounters(FactBase[list[IbPortCounters]]):
    """
    The state and error counters of every InfiniBand/RoCE port, under ``sys_root`` (``/sys``;
    a test points it at a recorded tree):

    .. code:: python

        [IbPortCounters(device="mlx5_0", port=1, state="ACTIVE", phys_state="LinkUp",
                        counters={"symbol_error": 0, "link_downed": 0, ...})]
    """

    gpufleet_no_prefetch = True  # read before and after a measurement: never from a cache

    @override
    @staticmethod
    def default() -> list[IbPortCounters]:
        return []

    @override
    def command(self, sys_root: str = "/sys") -> str:
        return ib_counters_command(sys_root)

    @override
    def process(self, output: list[str]) -> list[IbPortCounters]:
        return parse_ib_counters(output)
