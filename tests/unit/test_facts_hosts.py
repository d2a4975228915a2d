"""
Unit tests for facts.pci, facts.network, facts.system and facts.packages.

The /sys-reading commands are run for real against fake /sys trees (described
in tests/fixtures/facts/samples/*.tree), so both the shell and the parser are
tested; their output is compared with hand-checked expected output files.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.facts.network import (
    NetworkInterfaces,
    RdmaDevices,
    net_command,
    parse_net,
    parse_rdma,
    rdma_command,
)
from gpufleet.facts.packages import HeldPackages, PackageVersions, dpkg_query_command, parse_dpkg_query
from gpufleet.facts.pci import (
    MellanoxPciDevices,
    NvidiaPciDevices,
    PciDevice,
    PciDevices,
    parse_sys_pci,
    pci_command,
)
from gpufleet.facts.system import OsRelease, SystemResources, parse_os_release, parse_system_resources

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"


def lines(*parts: str) -> list[str]:
    return FIXTURES.joinpath(*parts).read_text().splitlines()


def build_tree(root: Path, spec: list[str]) -> Path:
    """Create a fake /sys from "PATH = CONTENT", "PATH -> TARGET", "dir PATH" lines."""
    for line in spec:
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith("dir "):
            (root / line[4:].strip()).mkdir(parents=True, exist_ok=True)
        elif " -> " in line:
            path, target = (part.strip() for part in line.split(" -> "))
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).symlink_to(target)
        else:
            path, _, content = line.partition(" = ")
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(content + "\n")
    return root


def run(command: str) -> list[str]:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    return result.stdout.splitlines()


# --- PCI -------------------------------------------------------------------


def test_sys_pci_recorded_h200_x2():
    devices = parse_sys_pci(lines("h200-x2", "sys-pci.txt"))
    assert devices == [
        PciDevice("0000:00:06.0", "0x10de", "0x2335", "0x030200", None, "0x18bf", "nvidia", None, "gpu"),
        PciDevice("0000:00:07.0", "0x10de", "0x2335", "0x030200", None, "0x18bf", "nvidia", None, "gpu"),
    ]
    assert devices[1].bus_id == "00000000:00:07.0"


@pytest.mark.parametrize("host", ["h200-x1", "h200-x2"])
def test_pci_command_on_a_tree_rebuilt_from_the_recording(tmp_path, host):
    # sys-pci.txt re-expressed as a /sys tree, then read by the fact's command:
    # the same devices come back, in the command's (wider) line layout.
    recorded = parse_sys_pci(lines(host, "sys-pci.txt"))
    spec = ["dir bus/pci/drivers/nvidia"]
    for device in recorded:
        base = f"bus/pci/devices/{device.slot}"
        spec += [
            f"{base}/vendor = {device.vendor}",
            f"{base}/device = {device.device_id}",
            f"{base}/class = {device.pci_class}",
            f"{base}/subsystem_device = {device.subsystem_device}",
            f"{base}/driver -> ../../drivers/{device.driver}",
        ]
    output = run(pci_command(str(build_tree(tmp_path / "sys", spec))))
    assert output[0] == (
        "0000:00:06.0 vendor=0x10de device=0x2335 class=0x030200 subsys_vendor= "
        "subsys=0x18bf driver=nvidia numa="
    )
    assert NvidiaPciDevices().process(output) == recorded


def test_pci_hgx_with_nvswitch_and_unbound_gpus(tmp_path):
    root = build_tree(tmp_path / "sys", lines("samples", "sysfs-hgx-pci.tree"))
    output = run(pci_command(str(root)))
    assert output == lines("samples", "sys-pci-hgx.txt")

    everything = PciDevices().process(output)
    assert [device.slot for device in everything] == [
        "0000:05:00.0",
        "0000:06:00.0",
        "0000:18:00.0",
        "0000:2a:00.0",
        "0000:2a:00.1",
        "0000:3b:00.0",
    ]  # the Intel bridge is skipped by the command

    nvidia = NvidiaPciDevices().process(output)
    assert [(d.slot, d.kind, d.device_id, d.driver) for d in nvidia] == [
        ("0000:05:00.0", "nvswitch", "0x22a3", "nvidia"),
        ("0000:06:00.0", "nvswitch", "0x22a3", None),
        ("0000:18:00.0", "gpu", "0x2330", None),
        ("0000:2a:00.0", "gpu", "0x2330", "vfio-pci"),
    ]
    assert nvidia[0].pci_class == "0x068000"
    assert nvidia[2].numa_node == 0 and nvidia[3].numa_node is None  # -1 = no affinity
    assert nvidia[2].subsystem_vendor == "0x10de" and nvidia[2].subsystem_device == "0x16c1"

    (nic,) = MellanoxPciDevices().process(output)
    assert (nic.slot, nic.kind, nic.device_id, nic.driver) == ("0000:3b:00.0", "nic", "0x1021", "mlx5_core")


def test_pci_without_any_device_gives_default(tmp_path):
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    assert run(pci_command(str(tmp_path / "sys"))) == []
    assert run(pci_command(str(tmp_path / "missing"))) == []
    assert NvidiaPciDevices.default() == []


@pytest.mark.parametrize(
    "line, message",
    [
        ("garbage", "expected a PCI slot"),
        ("0000:00:06.0 vendor=0x10de device=0x2335", "missing or non-hex PCI class"),
        ("0000:00:06.0 vendor=0x10de device=zz class=0x030200", "non-hex PCI device"),
        ("0000:00:06.0 vendor", "expected key=value"),
    ],
)
def test_sys_pci_malformed(line, message):
    with pytest.raises(ValueError, match=message):
        parse_sys_pci([line])


# --- network ---------------------------------------------------------------


@pytest.fixture
def net_root(tmp_path):
    return build_tree(tmp_path / "sys", lines("samples", "sysfs-net-ib.tree"))


def test_network_interfaces_exclude_plumbing(net_root):
    output = run(net_command(str(net_root)))
    assert output == lines("samples", "sys-class-net.txt")
    interfaces = NetworkInterfaces().process(output)
    assert [interface.name for interface in interfaces] == ["bond0", "ens1f1", "eth0", "ib0"]
    by_name = {interface.name: interface for interface in interfaces}
    eth0, ib0, bond0 = by_name["eth0"], by_name["ib0"], by_name["bond0"]
    assert (eth0.operstate, eth0.mac, eth0.mtu, eth0.type, eth0.kind) == (
        "up",
        "3c:ec:ef:01:02:03",
        9000,
        1,
        "ethernet",
    )
    assert (eth0.pci_slot, eth0.driver, eth0.virtual) == ("0000:01:00.0", "ixgbe", False)
    assert (ib0.kind, ib0.mtu, ib0.pci_slot, ib0.driver) == ("infiniband", 4092, "0000:3b:00.0", "mlx5_core")
    assert ib0.mac == "00:00:10:29:fe:80:00:00:00:00:00:00:b8:3f:d2:03:00:aa:bb:cc"
    assert bond0.virtual and bond0.device is None and bond0.driver is None
    # link speed in Mbit/s; -1 (link down) and a missing file are "unknown", not a speed
    assert {i.name: i.speed_mbps for i in interfaces} == {"bond0": None, "ens1f1": None, "eth0": 25000, "ib0": 200000}
    everything = parse_net(output, include_all=True)
    assert {i.name for i in everything} >= {"lo", "docker0", "veth1a2b3c4", "br-0123abcd4567", "virbr0"}


def test_network_interface_virtio_device_is_not_a_pci_slot():
    (interface,) = parse_net(["name=eth0 operstate=up mac=02:fc:00:00:00:01 mtu=1400 type=1 device=virtio2 driver=virtio_net"])
    assert interface.device == "virtio2" and interface.pci_slot is None and not interface.virtual


def test_network_malformed():
    with pytest.raises(ValueError, match="expected a number for mtu"):
        parse_net(["name=eth0 mtu=big"])
    with pytest.raises(ValueError, match="without a name"):
        parse_net(["operstate=up"])


def test_rdma_devices(net_root):
    output = run(rdma_command(str(net_root)))
    assert output == lines("samples", "sys-class-infiniband.txt")
    mlx5_0, mlx5_1 = RdmaDevices().process(output)
    assert (mlx5_0.name, mlx5_0.pci_slot, mlx5_0.netdevs, mlx5_0.link_layer) == (
        "mlx5_0",
        "0000:3b:00.0",
        ["ib0"],
        "InfiniBand",
    )
    assert (mlx5_0.node_guid, mlx5_0.fw_ver) == ("b83f:d203:00aa:bbcc", "28.39.1002")
    (port,) = mlx5_0.ports
    assert (port.port, port.state, port.phys_state, port.rate, port.rate_gbps) == (
        1,
        "ACTIVE",
        "LinkUp",
        "400 Gb/sec (4X NDR)",
        400.0,
    )
    assert mlx5_1.link_layer == "Ethernet" and mlx5_1.netdevs == ["ens1f1"]
    assert (mlx5_1.ports[0].state, mlx5_1.ports[0].phys_state) == ("DOWN", "Disabled")


def test_rdma_without_infiniband_class(tmp_path):
    assert run(rdma_command(str(tmp_path))) == []
    assert RdmaDevices.default() == []


def test_rdma_malformed():
    with pytest.raises(ValueError, match="expected 'dev ...' or 'port ...'"):
        parse_rdma(["hello world"])
    with pytest.raises(ValueError, match="unexpected RDMA port line"):
        parse_rdma(["port mlx5_0 one state 4: ACTIVE"])


# --- system ----------------------------------------------------------------


def test_os_release_ubuntu():
    release = OsRelease().process(lines("samples", "os-release-ubuntu-24.04.txt"))
    assert (release.id, release.version_id, release.version_codename) == ("ubuntu", "24.04", "noble")
    assert release.id_like == ["debian"]
    assert release.pretty_name == "Ubuntu 24.04.2 LTS"


def test_os_release_malformed():
    with pytest.raises(ValueError, match="expected KEY=value"):
        parse_os_release(["not os-release"])
    with pytest.raises(ValueError, match="badly quoted"):
        parse_os_release(['NAME="unterminated'])


def system_output(cpuinfo=(), topology=(), nproc=(), numa=(), meminfo=()):
    out = []
    for name, part in [
        ("cpuinfo", cpuinfo),
        ("cpu-topology", topology),
        ("nproc", nproc),
        ("numa", numa),
        ("meminfo", meminfo),
    ]:
        out += [f"::gpufleet:: begin {name}", *part]
    return out


def test_system_resources_two_sockets_with_hyperthreads():
    cpuinfo = []
    for cpu in range(8):  # 2 sockets x 2 cores x 2 threads
        cpuinfo += [f"processor\t: {cpu}", f"physical id\t: {cpu // 4}", f"core id\t\t: {cpu % 2}"]
    resources = SystemResources().process(
        system_output(cpuinfo=cpuinfo, nproc=["8"], numa=["node0", "node1"], meminfo=["MemTotal:       2113389544 kB"])
    )
    assert (resources.logical_cpus, resources.physical_cores, resources.sockets) == (8, 4, 2)
    assert resources.numa_nodes == 2
    assert resources.memory_total_kib == 2113389544
    assert resources.memory_total_mib == 2113389544 // 1024


def test_system_resources_arm_uses_sysfs_topology():
    # Grace: /proc/cpuinfo has processor lines but no physical/core ids.
    resources = parse_system_resources(
        system_output(
            cpuinfo=["processor\t: 0", "processor\t: 1", "processor\t: 2", "processor\t: 3"],
            topology=["0 0", "0 1", "0 2", "0 3"],
            nproc=["4"],
        )
    )
    assert (resources.logical_cpus, resources.physical_cores, resources.sockets, resources.numa_nodes) == (4, 4, 1, 1)


def test_system_resources_falls_back_to_nproc():
    resources = parse_system_resources(system_output(nproc=["6"]))
    assert (resources.logical_cpus, resources.physical_cores, resources.sockets) == (6, 6, 1)
    assert resources.memory_total_kib is None


def test_system_resources_malformed():
    with pytest.raises(ValueError, match="expected a number from nproc"):
        parse_system_resources(system_output(nproc=["many"]))
    with pytest.raises(ValueError, match="expected nodeN"):
        parse_system_resources(system_output(numa=["nodeX"]))
    with pytest.raises(ValueError, match="unexpected MemTotal line"):
        parse_system_resources(system_output(meminfo=["MemTotal: lots"]))


# --- packages --------------------------------------------------------------


def test_held_packages():
    # The three packages held on the recorded H200 hosts (README of the recording).
    output = ["libnccl2", "libcudnn9-cuda-13", "libnccl-dev", ""]
    assert HeldPackages().process(output) == ["libcudnn9-cuda-13", "libnccl-dev", "libnccl2"]
    with pytest.raises(ValueError, match="expected a package name"):
        HeldPackages().process(["Listing... Done"])


def test_gpu_device_users():
    from gpufleet.facts.driver import GpuDeviceUsers

    assert GpuDeviceUsers().process(["4121", "", " 87 "]) == [87, 4121]
    with pytest.raises(ValueError, match="expected a PID: 'ls: cannot'"):
        GpuDeviceUsers().process(["12", "ls: cannot"])


def test_package_versions():
    fact = PackageVersions()
    command = fact.command(packages=["libnccl2", "cuda-toolkit-13-0", "libcudnn9-cuda-*"])
    assert "'libcudnn9-cuda-*'" in command  # globs quoted for the shell, passed to dpkg-query
    output = [
        "::gpufleet:: want libnccl2 cuda-toolkit-13-0",
        "::gpufleet:: begin dpkg",
        "libnccl2 2.27.3-1+cuda13.0 hi ",
        "libcudnn9-cuda-13 9.10.2.21-1 hi ",
        "libcudnn9-cuda-12  un ",
    ]
    assert fact.process(output) == {
        "libnccl2": "2.27.3-1+cuda13.0",
        "cuda-toolkit-13-0": None,
        "libcudnn9-cuda-13": "9.10.2.21-1",
    }


def test_package_names_are_validated_not_injected():
    with pytest.raises(ValueError, match="not a Debian package name"):
        PackageVersions().command(packages=["libc6; rm -rf /"])
    with pytest.raises(ValueError, match="not a Debian package name"):
        dpkg_query_command(["$(reboot)"])


def test_dpkg_query_malformed():
    with pytest.raises(ValueError, match="expected 'package version status'"):
        parse_dpkg_query(["a b c d"])
    with pytest.raises(ValueError, match="unexpected dpkg-query line"):
        parse_dpkg_query(["libc6 2.36 installed"])
