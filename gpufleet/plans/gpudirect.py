"""GPUDirect RDMA on RDMA tiers: nvidia-peermem, and the HCAs NCCL is told to use.

NCCL moves GPU memory straight to an InfiniBand / RoCE HCA (GPUDirect RDMA) only when the
nvidia-peermem module is loaded; without it NCCL silently stages every transfer through host
memory. nvidia-peermem is built with the driver (DKMS, or Ubuntu's prebuilt modules) and carries
the driver's version (nvidia-peermem.c: MODULE_VERSION(NV_VERSION_STRING)), so it must be the
loaded nvidia module's version: one built for another driver fails to load, and a stale one
loaded before a driver change must go with the reboot that loads the new driver.

* plan_peermem: on the ib / roce profiles, on a host that has RDMA devices: load it now (when
  the loaded driver and the module on disk agree) and at every boot (/etc/modules-load.d);
* hca_problems: the HCAs the NCCL profile names (NCCL_IB_HCA as /etc/nccl.conf gets it) must be
  on the host (/sys/class/infiniband), their ports ACTIVE and LinkUp, at the tier's minimum rate
  (validate_min_nic_gbps).

Pure functions of the settings and facts: deploys/tuning.py applies the plan, the validation
gate checks the host against the same functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from gpufleet.facts.kernel import PEERMEM_BOOT_FILE, DriverStateData, PeermemStateData
from gpufleet.facts.network import RdmaDevice

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

RDMA_PROFILES = ("ib", "roce")
MODULE = "nvidia-peermem"
BOOT_FILE = PEERMEM_BOOT_FILE
BOOT_TEXT = ("# Managed by gpufleet (deploys/tuning.py): GPUDirect RDMA for NCCL over InfiniBand / RoCE.\n"
             f"{MODULE}\n")


@dataclass(frozen=True)
class PeermemPlan:
    wanted: bool  # the tier and the host call for GPUDirect RDMA
    reason: str  # why (not), for the no-op and the gate
    load_now: bool = False  # modprobe it in this run
    problem: str = ""  # wanted, but cannot be loaded as it should be (the gate FAILs on it)


def plan_peermem(profile: str, rdma: Sequence[RdmaDevice], driver: DriverStateData,
                 peermem: PeermemStateData) -> PeermemPlan:
    if profile not in RDMA_PROFILES:
        return PeermemPlan(False, f"nccl_profile: {profile} has no RDMA between hosts")
    if not rdma:
        return PeermemPlan(False, "no RDMA device on this host (/sys/class/infiniband is empty)")
    loaded_driver = driver.module_version
    if not loaded_driver:
        return PeermemPlan(True, "the nvidia module is not loaded", problem=(
            f"{MODULE} cannot load before the nvidia module (driver installed: "
            f"{driver.userspace_version or 'none'}); it loads at the next boot"))
    if peermem.loaded:
        if peermem.loaded_version != loaded_driver:
            return PeermemPlan(True, "a stale module is loaded", problem=(
                f"{MODULE} {peermem.loaded_version or '(no version)'} is loaded with driver {loaded_driver}: "
                "reboot (or rmmod nvidia-peermem, then modprobe nvidia-peermem) when the host is idle"))
        return PeermemPlan(True, f"{MODULE} {loaded_driver} is loaded, as the driver")
    if peermem.available_version is None:
        return PeermemPlan(True, "not built", problem=(
            f"no {MODULE} module for the running kernel (modinfo): the driver's packages build it with the "
            f"nvidia module; reinstall driver {loaded_driver} for this kernel (deploys/all.py, or dkms autoinstall)"))
    if peermem.available_version != loaded_driver:
        return PeermemPlan(True, "the module on disk is another driver's", problem=(
            f"{MODULE} on disk is {peermem.available_version}, the loaded driver {loaded_driver}: it loads after "
            "the reboot that loads the new driver"))
    return PeermemPlan(True, f"{MODULE} {loaded_driver} to load, as the driver", load_now=True)


def listed_hcas(nccl_ib_hca: str | None, rdma: Sequence[RdmaDevice]) -> list[tuple[str, int | None]]:
    """(HCA, port or None for every port) NCCL uses, from NCCL_IB_HCA's grammar: '=a,b' exact
    names, 'a,b' prefixes, '^a' all but those (NCCL User Guide, NCCL_IB_HCA); None: every HCA."""
    names = [d.name for d in rdma]
    if not nccl_ib_hca:
        return [(n, None) for n in names]
    text = nccl_ib_hca
    exclude = text.startswith("^")
    text = text.lstrip("^")
    exact = text.startswith("=")
    items: list[tuple[str, int | None]] = []
    for item in text.lstrip("=").split(","):
        hca, _, number = item.partition(":")
        items.append((hca, int(number) if number.isdigit() else None))

    def matches(device: str, name: str) -> bool:
        return device == name if exact else device.startswith(name)

    if exclude:
        return [(n, None) for n in names if not any(matches(n, name) for name, _ in items)]
    out = []
    for name, port in items:
        found = [n for n in names if matches(n, name)]
        out += [(n, port) for n in found] if found else [(name, port)]
    return out


def hca_problems(nccl_ib_hca: str | None, rdma: Sequence[RdmaDevice], min_gbps: int) -> tuple[list[str], list[str]]:
    """(problems, the HCAs that are fine as 'mlx5_0 port 1 400 Gb/s'): each listed HCA on the
    host, each of its (listed) ports ACTIVE, LinkUp, at least min_gbps (0: any rate)."""
    by_name = {d.name: d for d in rdma}
    problems, good = [], []
    for name, port in listed_hcas(nccl_ib_hca, rdma):
        device = by_name.get(name)
        if device is None:
            problems.append(f"{name}: not on this host (it has {', '.join(sorted(by_name)) or 'no RDMA device'})")
            continue
        ports = [p for p in device.ports if port is None or p.port == port]
        if not ports:
            problems.append(f"{name}: no port {port}")
            continue
        for p in ports:
            label = f"{name} port {p.port}"
            if p.state != "ACTIVE" or p.phys_state != "LinkUp":
                problems.append(f"{label}: link {p.state or '?'} ({p.phys_state or '?'}), not ACTIVE (LinkUp)")
            elif min_gbps and (p.rate_gbps or 0) < min_gbps:
                problems.append(f"{label}: {p.rate or 'no rate'}, below validate_min_nic_gbps {min_gbps}")
            else:
                good.append(f"{label} {p.rate_gbps or '?':g} Gb/s" if p.rate_gbps else f"{label} (rate unknown)")
    return problems, good


def rdma_tier(settings: Settings) -> bool:
    return bool(settings.nccl_profile in RDMA_PROFILES)
