"""What a host really has, read once per run and shared by every deploy.

pyinfra 3 re-runs a fact on every ``host.get_fact``; deploys ask the same questions (which GPUs?
which driver?), so the answers are kept in the host's context (gpufleet.config.hostcontext) for the rest of the planning phase.
That is also the planning rule: these are the host's state *before* this run, never what the
run itself will change.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, TypeVar, cast

from pyinfra.api.host import Host

from gpufleet.facts.cpu import CpuFreq, CpuFreqData
from gpufleet.facts.gpu import GpuState, GpuStateData
from gpufleet.facts.gpu_tuning import LockedClocks
from gpufleet.facts.kernel import DriverState, DriverStateData
from gpufleet.facts.mig import MigState, MigStateData
from gpufleet.facts.network import NetInterface, NetworkInterfaces, RdmaDevice, RdmaDevices
from gpufleet.facts.packages import AptCandidates, PackageVersions
from gpufleet.facts.pci import PciDevices
from gpufleet.facts.storage import BlockDevices, BlockDevicesData
from gpufleet.facts.system import OsRelease, OsReleaseData, SystemResources, SystemResourcesData

from gpufleet.errors import Incompatible
from gpufleet.config.hostcontext import host_context
from gpufleet.catalog.gpus import GpuModel, is_nvswitch_pci, model_for_pci
from gpufleet.catalog.kernels import image_metapackage_candidates, kernel_flavour, module_packages, package_flavour
from gpufleet.config.resolver import Resolution, check_tier_hardware, resolve

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

T = TypeVar("T")


def _cached(host: Host, key: str, make: Callable[[], T]) -> T:
    cache = host_context(host).facts
    if key not in cache:
        cache[key] = make()
    return cast(T, cache[key])


def gpu_state(host: Host) -> GpuStateData:
    """nvidia-smi's view (one remote command for GPUs, clocks, topology), without the compute
    processes: ask GpuState() itself where they matter (deploys/driver.py gpu_work)."""
    return _cached(host, "gpu_state", lambda: host.get_fact(GpuState, processes=False))


def mig_state(host: Host) -> MigStateData:
    """Every GPU's MIG mode and instances before this run."""
    return _cached(host, "mig_state", lambda: mig_from_gpu_state(gpu_state(host)) or host.get_fact(MigState))


def mig_from_gpu_state(state: GpuStateData) -> MigStateData | None:
    """MigState's answer from GpuState's query, or None to ask MigState. MigState's own command
    queries the same modes and stops there when no GPU has MIG on or pending (nothing else to
    list), so for such a host GpuState's MIG columns, read in the same nvidia-smi call as the
    GPUs, are exactly its answer; with MIG on or pending anywhere the instances are asked."""
    modes = state.mig_modes
    if not (state.ok and modes is not None and modes.ok and len(modes.gpus) == len(state.gpus)):
        return None
    if any("Enabled" in (gpu.current, gpu.pending) for gpu in modes.gpus):
        return None
    return modes


def driver_state(host: Host) -> DriverStateData:
    return _cached(host, "driver_state", lambda: host.get_fact(DriverState))


def os_release(host: Host) -> OsReleaseData:
    return _cached(host, "os_release", lambda: host.get_fact(OsRelease))


def resources(host: Host) -> SystemResourcesData:
    return _cached(host, "resources", lambda: host.get_fact(SystemResources))


def block_devices(host: Host) -> BlockDevicesData:
    """lsblk's tree with a blkid -p verdict per drive, before this run (the preflight's NVMe
    capacity and the scratch plan read the same answer)."""
    return _cached(host, "block_devices", lambda: host.get_fact(BlockDevices))


def interfaces(host: Host) -> list[NetInterface]:
    return _cached(host, "interfaces", lambda: host.get_fact(NetworkInterfaces))


def cpu_freq(host: Host) -> CpuFreqData:
    return _cached(host, "cpu_freq", lambda: host.get_fact(CpuFreq))


def rdma_devices(host: Host) -> list[RdmaDevice]:
    return _cached(host, "rdma", lambda: host.get_fact(RdmaDevices))


def locked_clocks(host: Host) -> dict[str, str]:
    """The clock locks gpufleet recorded since boot (LockedClocks): the state before this run."""
    return _cached(host, "locked_clocks", lambda: host.get_fact(LockedClocks))


def os_name(host: Host) -> str:
    """The OS as compat.yaml names it, e.g. ``debian-12``."""
    rel = os_release(host)
    return f"{rel.id}-{rel.version_id}"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The GPUs and fabric a host has, from PCI (works with no driver installed)."""

    gpu_pci_ids: tuple[str, ...]
    models: tuple[GpuModel, ...]
    unknown_pci_ids: tuple[str, ...]
    nvswitch: bool
    nvlink: bool
    rdma: bool

    @property
    def summary(self) -> str:
        if not self.gpu_pci_ids:
            return "no NVIDIA GPU"
        names: dict[str, int] = {}
        for m in self.models:
            names[m.name] = names.get(m.name, 0) + 1
        for pci in self.unknown_pci_ids:
            names[f"unknown {pci}"] = names.get(f"unknown {pci}", 0) + 1
        parts = [f"{count} x {name}" for name, count in names.items()]
        extras = [what for what, present in (("NVSwitch", self.nvswitch), ("NVLink", self.nvlink),
                                             ("RDMA", self.rdma)) if present]
        return ", ".join(parts) + (f" ({', '.join(extras)})" if extras else "")


def hardware(host: Host) -> Hardware:
    def make() -> Hardware:
        pci = host.get_fact(PciDevices)
        gpus = [d for d in pci if d.kind == "gpu"]
        models, unknown = [], []
        for dev in gpus:
            model = model_for_pci(dev.device_id)
            (models.append(model) if model else unknown.append(dev.device_id))
        state = gpu_state(host)
        topo_gpus = [d for d in state.topology.devices if d.startswith("GPU")]
        nvlink = any(state.topology.nvlinks(a, b) for a in topo_gpus for b in topo_gpus if a != b)
        return Hardware(
            gpu_pci_ids=tuple(d.device_id for d in gpus),
            models=tuple(models),
            unknown_pci_ids=tuple(unknown),
            nvswitch=any(d.kind == "nvswitch" or is_nvswitch_pci(d.device_id) for d in pci),
            nvlink=nvlink,
            rdma=bool(rdma_devices(host)),
        )

    return _cached(host, "hardware", make)


def resolution(host: Host, settings: Settings) -> Resolution:
    """What to install on this host: the tier's wishes resolved against the GPUs it really has.

    Raises Incompatible (with the reason and the key to change) when nothing fits."""
    def make() -> Resolution:
        hw = hardware(host)
        if not hw.models:
            raise Incompatible(f"no supported NVIDIA GPU found on the host ({hw.summary})", key=None)
        return resolve(list(hw.models), settings, os_name(host), nvswitch=hw.nvswitch)

    return _cached(host, "resolution", make)


def tier_mismatches(host: Host, settings: Settings) -> list[str]:
    hw = hardware(host)
    return check_tier_hardware(settings, [*hw.models, *hw.unknown_pci_ids], hw.nvswitch, hw.rdma,
                               nvlink=hw.nvlink)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """Which kernel packages go with the resolved driver on this host's running kernel."""

    release: str | None  # uname -r
    flavour: str | None  # what the kernel metapackages follow: "amd64", "generic", "generic-hwe-22.04"
    modules: tuple[str, ...] = ()  # module packages apart from the driver's (Ubuntu's distro drivers)
    prebuilt: bool = False  # those modules are prebuilt and signed by the distribution (no DKMS, no MOK)

    @property
    def headers_metapackage(self) -> str | None:
        return f"linux-headers-{self.flavour}" if self.flavour else None

    @property
    def image_metapackage(self) -> str | None:
        return f"linux-image-{self.flavour}" if self.flavour else None


def kernel_plan(host: Host, res: Resolution) -> KernelPlan:
    """The running kernel's flavour as its packages follow it (Ubuntu: the installed -hwe image
    metapackage), and for a driver whose modules are packaged apart the modules to install:
    prebuilt and signed where the sources have a build for this kernel's ABI (`ubuntu-drivers
    install --gpgpu`), else DKMS. Asks apt only while no prebuilt module package is installed."""
    def make() -> KernelPlan:
        state = driver_state(host)
        name, release = os_name(host), state.kernel_release
        flavour = kernel_flavour(release)
        candidates = image_metapackage_candidates(release, name)
        if name.startswith("ubuntu-") and len(candidates) > 1:
            flavour = package_flavour(release, name, host.get_fact(PackageVersions, packages=candidates))
        if not (res.prebuilt_modules or res.dkms_modules):
            return KernelPlan(release, flavour)
        abi = res.prebuilt_modules.format(kernel=release) if res.prebuilt_modules and release else None
        abi_build = bool(abi and (abi in state.packages
                                  or host.get_fact(AptCandidates, packages=[abi]).get(abi)))
        modules, prebuilt = module_packages(res.prebuilt_modules, res.dkms_modules, release, flavour, abi_build)
        return KernelPlan(release, flavour, tuple(modules), prebuilt)

    return _cached(host, "kernel_plan", make)
