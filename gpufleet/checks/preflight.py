"""The validation gate, preflight: the host has what its tier asks for: hardware, RAM, NIC, NVMe."""
from __future__ import annotations

from typing import Any

from gpufleet.checks.gate import FAIL, PASS, SKIP, WARN, Context, Result, check


@check("preflight")
def tier_matches_hardware(ctx: Context) -> Result:
    from gpufleet.config.hostfacts import tier_mismatches
    from gpufleet.plans.preflight import plan_preflight

    name = "the hardware matches the tier"
    plan = plan_preflight(ctx.settings, ctx.hardware().summary, tier_mismatches(ctx.host, ctx.settings))
    if plan.matches:
        return Result("preflight", name, PASS, plan.found)
    status = FAIL if plan.refusal is not None else WARN
    return Result("preflight", name, status, plan.found + f" (tier_mismatch: {ctx.settings.tier_mismatch})",
                  "move the host to the tier that fits its hardware, or fix the hardware")


@check("preflight")
def one_gpu_model(ctx: Context) -> Result:
    """Mixed GPU models work, but jobs spanning them are paced by the slowest: say so, with the pins.
    (That the driver and the PyTorch wheel cover every GPU is the resolver's job, at planning time.)"""
    from gpufleet.catalog.pytorch import mixed_gpus

    name = "the host's GPUs are one model"
    models = ctx.hardware().models
    if not models:
        return Result("preflight", name, SKIP, "no known NVIDIA GPU")
    mixed = mixed_gpus(models)
    if mixed is None:
        return Result("preflight", name, PASS, f"{len(models)} x {models[0].name}")
    return Result("preflight", name, WARN, mixed,
                  "pin each job to one model as above, or put one GPU model per host")


def _hardware_status(ctx: Context) -> str:
    return FAIL if ctx.settings.tier_mismatch == "fail" else WARN


def _against_minimum(ctx: Context, name: str, key: str, minimum: float, unit: str, found: float,
                     passed: str, short: str, remedy: str) -> Result:
    """A preflight minimum (RAM, NIC speed, NVMe capacity): PASS naming what was found, else the
    tier_mismatch status naming what was found, the tier, its minimum and the key to change."""
    if found >= minimum:
        return Result("preflight", name, PASS, f"{passed} ({key}: {minimum:g})")
    return Result("preflight", name, _hardware_status(ctx),
                  f"{short}, tier {ctx.settings.tier} expects at least {minimum:g} {unit} "
                  f"({key}; tier_mismatch: {ctx.settings.tier_mismatch})", remedy)


#: interfaces that carry no data between hosts, whatever speed they report
_NOT_DATA_NIC = ("lo", "docker", "veth", "br-", "virbr", "ifb", "dummy", "tun", "tap", "wg", "tailscale")


def fastest_data_nic(interfaces: list[Any]) -> Any | None:
    """The Ethernet / InfiniBand interface with the highest reported link speed (None: none says)."""
    known = [i for i in interfaces if i.speed_mbps and i.kind in ("ethernet", "infiniband")
             and not i.name.startswith(_NOT_DATA_NIC)]
    return max(known, key=lambda i: (i.speed_mbps, i.name)) if known else None


@check("preflight")
def enough_ram(ctx: Context) -> Result:
    """MemTotal counts in GB of 10^9 bytes: a host with N GiB installed shows a little over N GB
    once firmware and kernel took their share, so the tier's round number holds."""
    from gpufleet.config.hostfacts import resources

    name = "the host has the tier's minimum RAM"
    minimum = ctx.settings.validate_min_ram_gb
    if not minimum:
        return Result("preflight", name, SKIP, "validate_min_ram_gb: 0")
    kib = resources(ctx.host).memory_total_kib
    if kib is None:
        return Result("preflight", name, SKIP, "/proc/meminfo gave no MemTotal")
    found = kib * 1024 / 1e9
    return _against_minimum(ctx, name, "validate_min_ram_gb", minimum, "GB", found, f"{found:.0f} GB",
                            f"{found:.1f} GB of RAM (MemTotal)",
                            "add RAM, move the host to a tier that fits it, or set validate_min_ram_gb for it")


@check("preflight")
def fast_enough_nic(ctx: Context) -> Result:
    from gpufleet.config.hostfacts import interfaces

    name = "the fastest data NIC reaches the tier's minimum speed"
    minimum = ctx.settings.validate_min_nic_gbps
    if not minimum:
        return Result("preflight", name, SKIP, "validate_min_nic_gbps: 0")
    nic = fastest_data_nic(interfaces(ctx.host))
    if nic is None:  # virtual NICs (virtio, many clouds') report -1: no speed is not a slow NIC
        return Result("preflight", name, SKIP, f"no Ethernet or InfiniBand interface reports its link speed "
                      f"(/sys/class/net/*/speed), so validate_min_nic_gbps: {minimum} cannot be checked")
    gbps = nic.speed_mbps / 1000
    return _against_minimum(ctx, name, "validate_min_nic_gbps", minimum, "Gbit/s", gbps, f"{nic.name} {gbps:g} Gbit/s",
                            f"fastest data NIC {nic.name} runs at {gbps:g} Gbit/s",
                            "check the link (ethtool), move the host to a tier that fits it, "
                            "or set validate_min_nic_gbps for it")


@check("preflight")
def enough_nvme(ctx: Context) -> Result:
    """The local NVMe capacity for data (gpufleet.plans.storage.data_nvme_bytes: NVMe disks that do not
    carry the system), in TB of 10^12 bytes as drives are sold."""
    from gpufleet.config.hostfacts import block_devices
    from gpufleet.plans.storage import data_nvme_bytes

    name = "the host has the tier's local NVMe capacity"
    minimum = ctx.settings.validate_min_nvme_tb
    if not minimum:
        return Result("preflight", name, SKIP, "validate_min_nvme_tb: 0")
    total, disks = data_nvme_bytes(block_devices(ctx.host))
    found = total / 1e12
    return _against_minimum(ctx, name, "validate_min_nvme_tb", minimum, "TB", found,
                            f"{found:.2f} TB on {len(disks)} NVMe drives",
                            f"{found:.2f} TB of local NVMe for data "
                            f"({', '.join(disks) or 'no NVMe drive besides the system'}; lsblk)",
                            "add drives, move the host to a tier that fits it, or set validate_min_nvme_tb for it")


@check("preflight")
def os_as_planned(ctx: Context) -> Result:
    """The OS the host runs is the one the tier was planned for (validate_os_release): read at
    planning to resolve the stack, and checked here, where a re-imaged host shows."""
    from gpufleet.config.hostfacts import os_name

    name = "the OS is the tier's validate_os_release"
    found, wanted = os_name(ctx.host), ctx.settings.validate_os_release
    if found == wanted:
        return Result("preflight", name, PASS, found)
    status = FAIL if ctx.settings.tier_mismatch == "fail" else WARN
    return Result("preflight", name, status, f"found {found}, the tier is planned for {wanted} "
                                             f"(tier_mismatch: {ctx.settings.tier_mismatch})",
                  f"set validate_os_release: {found} for this host and re-run (the stack resolves for it), "
                  "or re-image it")
