"""The validation gate's checks: is each host what its tier says? Read-only; facts + comparisons.

Each check is a small function ``check(ctx) -> Result | list[Result]`` registered for one area
(base, preflight, driver, docker, tuning, hardening, probe, pytorch). ``run_checks(host, settings)``
runs them all against *fresh* facts (never the planning-time cache: the gate runs after the
changes) and returns one Result per check. deploys/validate.py turns failures into a failed
host; the fleet report shows the same results per host.

Statuses: pass | fail | warn | skip (does not apply, with the reason).

This is the core: it imports no deploy (tests/unit/test_import_direction.py). What a check
compares with comes from the same core plan the deploy applies (gpufleet.plans.tuning.plan_tuning,
gpufleet.catalog.tiers.managed_marker, gpufleet.plans.dockerconf, gpufleet.catalog.sshd_policy).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, cast

from pyinfra.facts.files import FileContents, Sha256File
from pyinfra.facts.systemd import SystemdStatus

from gpufleet.facts.gpu import GpuState, GpuStateData
from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.kernel import DriverState, DriverStateData
from gpufleet.facts.monitoring import MetricsEndpoint
from gpufleet.facts.packages import PackageVersions
from gpufleet.facts.pytorch import TorchBuild
from gpufleet.facts.nftables import TABLE, NftablesCapability
from gpufleet.facts.ssh import SshdEffectiveConfig
from gpufleet.facts.dcgm_diag import DcgmDiag, DcgmDiagData
from gpufleet.facts.gpu_checks import ContainerGpus, PerfProbe
from gpufleet.facts.health import GpuHealth
from gpufleet.facts.system import UnitActive

from gpufleet.plans import dockerconf

from gpufleet.plans import perf
from gpufleet.catalog.cuda_stack import STACK_FAMILIES, component_drift, pending_message, stack_drift_message, stack_fact_packages, stack_pending_message, stack_renames, stack_states
from gpufleet.errors import Incompatible
from gpufleet.plans.health import GpuVerdict, all_findings, assess, diag_findings, health_rules, rank
from gpufleet.config.hostcontext import host_context
from gpufleet.catalog.sshd_policy import expected_sshd
from gpufleet.catalog.tiers import managed_marker
from gpufleet.plans.tuning import Refusal, clocks_summary, host_mig, plan_tuning

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"
STATUSES = (PASS, FAIL, WARN, SKIP)
MARKER = "/etc/gpufleet/managed"
FIX_DEPLOY = "run deploys/all.py"
FIX_ROLLOUT = "tools/rollout INVENTORY (canary, batches, drain, snapshot); all.py changes no driver of a provisioned host"


AREAS = ("base", "preflight", "driver", "docker", "tuning", "storage", "monitoring", "hardening", "health", "probe",
         "pytorch")


@dataclass(frozen=True)
class Result:
    area: str
    name: str  # reads as a sentence: "the gpufleet marker matches the tier"
    status: str
    message: str = ""  # what was found
    fix: str = ""  # what to do when it failed

    def line(self) -> str:
        text = f"[{self.status.upper()}] {self.area}: {self.name}"
        if self.message:
            text += f": {self.message}"
        if self.fix and self.status in (FAIL, WARN):
            text += f" -> fix: {self.fix}"
        return text

    def to_json(self) -> dict[str, str]:
        return {"area": self.area, "name": self.name, "status": self.status,
                "message": self.message, "fix": self.fix}


@contextlib.contextmanager
def fresh_host_facts(host: Any) -> Iterator[None]:
    """gpufleet.config.hostfacts caches planning-time facts on the host; the gate must see the host
    as it is now, so run with an empty cache and put the planning cache back afterwards."""
    context = host_context(host)
    saved = context.facts
    context.facts = {}
    try:
        yield
    finally:
        context.facts = saved


class Context:
    """What a check may read: the host, its settings, facts (each asked once per run)."""

    def __init__(self, host: Any, settings: Any, probe: bool = True, probe_skip: str = "probes turned off",
                 torch_probe: bool | None = None, scrape_skip: str = "", health_skip: str = ""):
        self.host = host
        self.settings = settings
        self.probe = probe
        self.probe_skip = probe_skip  # why, when probe is False
        # reading the host's PyTorch build (imports torch there: seconds of CPU, no GPU load);
        # with the probes unless said otherwise (the fleet report always reads it)
        self.torch_probe = probe if torch_probe is None else torch_probe
        # why the exporters are not scraped on this run ("": they are); all.py's no-op re-run
        # leaves them alone: each scrape costs the host what a tenth of its whole no-op costs
        self.scrape_skip = scrape_skip
        self.health_skip = health_skip   # why the GPU health is not read on this run ("": it is)
        self._facts: dict[Any, Any] = {}

    def fact(self, cls: Any, **kwargs: Any) -> Any:
        key = (cls, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))
        if key not in self._facts:
            self._facts[key] = self.host.get_fact(cls, **kwargs)
        return self._facts[key]

    @property
    def gpu(self) -> GpuStateData:
        return cast(GpuStateData, self.fact(GpuState, processes=False))  # no check looks at processes

    @property
    def driver(self) -> DriverStateData:
        return cast(DriverStateData, self.fact(DriverState))

    @property
    def runtime(self) -> Any:
        """Where the host's PyTorch lives (gpufleet/plans/pytorch_runtime.py: the tier's pytorch_runtime)."""
        from gpufleet.plans.pytorch_runtime import runtime_of

        return runtime_of(self.settings)

    def wanted_pytorch(self) -> Any:
        """The resolver's PyTorch wheel for this host (None: none asked, or none fits)."""
        try:
            return self.resolution().pytorch
        except Incompatible:
            return None

    def hardware(self) -> Any:
        from gpufleet.config.hostfacts import hardware

        return hardware(self.host)

    def resolution(self) -> Any:
        from gpufleet.config.hostfacts import resolution

        return resolution(self.host, self.settings)


Check = Callable[[Context], "Result | list[Result]"]
CHECKS: list[tuple[str, Check]] = []


def check(area: str) -> Callable[[Check], Check]:
    def register(func: Check) -> Check:
        CHECKS.append((area, func))
        return func
    return register


# --- base -------------------------------------------------------------------------------------

@check("base")
def marker_matches_tier(ctx: Context) -> Result:
    name = "the gpufleet marker matches the tier"
    lines = ctx.fact(FileContents, path=MARKER)
    expected = managed_marker(ctx.settings.tier).splitlines()
    if lines is None:
        return Result("base", name, FAIL, f"{MARKER} is missing (gpufleet never ran here, or it was removed)",
                      FIX_DEPLOY)
    if [line.rstrip() for line in lines] == expected:
        return Result("base", name, PASS, f"tier {ctx.settings.tier}")
    tiers = [line.split(":", 1)[1].strip() for line in lines if line.startswith("tier:")]
    if tiers and tiers[0] != ctx.settings.tier:
        found = f"{MARKER} says tier {tiers[0]}, the inventory says {ctx.settings.tier}"
    else:
        changed = [line for line in lines if line.rstrip() not in expected]
        found = f"{MARKER} was changed by hand" + (f" (unexpected line {changed[0]!r})" if changed else "")
    return Result("base", name, FAIL, found, f"{FIX_DEPLOY} to rewrite it for tier {ctx.settings.tier}")


@check("base")
def diagnostics_installed(ctx: Context) -> Result:
    name = "the tier's diagnostics packages are installed"
    wanted = list(ctx.settings.extra_packages)
    if not wanted:
        return Result("base", name, SKIP, "the tier lists none")
    versions = ctx.fact(PackageVersions, packages=wanted)
    missing = [p for p in wanted if not versions.get(p)]
    if missing:
        return Result("base", name, FAIL, f"not installed: {', '.join(missing)}",
                      f"{FIX_DEPLOY} (or apt-get install {' '.join(missing)})")
    return Result("base", name, PASS, f"{len(wanted)} packages")


# --- preflight --------------------------------------------------------------------------------

@check("preflight")
def tier_matches_hardware(ctx: Context) -> Result:
    from gpufleet.config.hostfacts import tier_mismatches

    name = "the hardware matches the tier"
    problems = tier_mismatches(ctx.host, ctx.settings)
    if not problems:
        return Result("preflight", name, PASS, ctx.hardware().summary)
    found = f"found {ctx.hardware().summary}; " + "; ".join(problems)
    status = FAIL if ctx.settings.tier_mismatch == "fail" else WARN
    return Result("preflight", name, status, found + f" (tier_mismatch: {ctx.settings.tier_mismatch})",
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


# --- storage ----------------------------------------------------------------------------------

@check("storage")
def scratch_in_place(ctx: Context) -> Result:
    """The scratch the same plan as deploys/storage.py's says is there: mounted at its path."""
    from gpufleet.facts.storage import ScratchSite
    from gpufleet.config.hostfacts import block_devices
    from gpufleet.plans.storage import KEEP, MAKE, lost_note, plan_scratch

    name = "the local scratch is mounted where the tier says"
    settings = ctx.settings
    if settings.storage_scratch == "none":
        return Result("storage", name, SKIP, "storage_scratch: none")
    try:
        plan = plan_scratch(settings.storage_scratch, settings.storage_scratch_devices, settings.storage_scratch_path,
                            block_devices(ctx.host),
                            lambda: ctx.host.get_fact(ScratchSite, path=settings.storage_scratch_path))
    except Refusal as refused:
        return Result("storage", name, FAIL, str(refused), f"set {refused.key} to what this host allows")
    if plan.action == KEEP and plan.mounted and plan.remount:
        return Result("storage", name, FAIL, f"{plan.summary()}, but without nosuid,nodev", f"{FIX_DEPLOY} (it remounts it)")
    if plan.action == KEEP and plan.mounted:
        return Result("storage", name, PASS, plan.summary())
    if plan.action == KEEP:
        return Result("storage", name, FAIL, f"gpufleet's scratch on {plan.devices[0]} is not mounted at {plan.path}",
                      f"{FIX_DEPLOY} (it mounts it); if a drive failed, see dmesg and mdadm --detail {plan.devices[0]}")
    if plan.action == MAKE and plan.lost:
        return Result("storage", name, FAIL, f"{lost_note(plan.lost)}; gpufleet-scratch.service failed at boot and "
                      f"{plan.path} is sealed (nothing lands on the root disk); {plan.summary()} is planned",
                      f"{FIX_DEPLOY} (it makes the scratch again on the blank drives)")
    if plan.action == MAKE:
        return Result("storage", name, FAIL, f"no scratch yet: {plan.summary()} is planned", FIX_DEPLOY)
    return Result("storage", name, SKIP, "; ".join(plan.notes) or "no scratch planned")


@check("storage")
def shm_sized(ctx: Context) -> Result:
    from gpufleet.facts.storage import ShmSize
    from gpufleet.config.hostfacts import resources
    from gpufleet.plans.storage import plan_shm

    name = "/dev/shm has the size the tier sets"
    setting = ctx.settings.storage_shm_size
    if setting == "unmanaged":
        return Result("storage", name, SKIP, "storage_shm_size: unmanaged")
    try:
        plan = plan_shm(setting, ctx.host.get_fact(ShmSize), resources(ctx.host).memory_total_kib)
    except Refusal as refused:
        return Result("storage", name, FAIL, str(refused), f"set {refused.key} to what this host allows")
    if plan.remount:
        return Result("storage", name, FAIL, plan.note, FIX_DEPLOY)
    return Result("storage", name, PASS, f"size={setting}: {plan.note}")


# --- driver -----------------------------------------------------------------------------------

@check("driver")
def no_mismatch_pending(ctx: Context) -> Result:
    """Always checked: a loaded module that differs from the installed user space breaks every
    GPU program until the host reboots, whoever installed the driver."""
    name = "no driver mismatch is pending"
    drv, gpu = ctx.driver, ctx.gpu
    if drv.mismatch or gpu.status == "mismatch":
        loaded = drv.module_version or "?"
        installed = drv.userspace_version or gpu.nvml_version or "?"
        reboot = ctx.settings.driver_reboot
        how = ("run deploys/all.py (driver_reboot: allowed, so it reboots the host) or reboot the host"
               if reboot == "allowed" else
               f"reboot the host when it is idle (driver_reboot: {reboot} keeps deploys/all.py from doing it)")
        return Result("driver", name, FAIL, f"driver loaded {loaded} != installed {installed}", how)
    if drv.reboot_required:
        pkgs = ", ".join(drv.reboot_required_packages) or "unknown packages"
        return Result("driver", name, WARN, f"the OS asks for a reboot (/run/reboot-required: {pkgs})",
                      "reboot the host when it is idle")
    return Result("driver", name, PASS, f"loaded {drv.module_version or 'none'}, installed "
                                         f"{drv.userspace_version or 'none'}")


@check("driver")
def driver_versions_agree(ctx: Context) -> Result:
    name = "the loaded driver = the installed driver = the resolved driver"
    drv = ctx.driver
    found = f"loaded {drv.module_version or 'none'}, installed {drv.userspace_version or 'none'}"
    try:
        want = ctx.resolution().driver_version
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"no driver resolves for this host: {refused.reason}")
    if drv.module_version == drv.userspace_version == want:
        return Result("driver", name, PASS, f"{want} ({drv.module_flavour or '?'})")
    if drv.userspace_version and drv.userspace_version != want and not ctx.settings.driver_upgrade_in_place:
        # the inventory moved on: a rollout's job, not a broken host (unless the operator says so)
        status = FAIL if ctx.settings.driver_upgrade_pending == "fail" else WARN
        return Result("driver", name, status, f"{pending_message(drv.userspace_version, want)} ({found})",
                      FIX_ROLLOUT)
    return Result("driver", name, FAIL, f"{found}, resolved {want}", FIX_DEPLOY)


FIX_STACK_DRIFT = ("tools/rollout INVENTORY puts it back at the resolved release through the gate (GPUs idle, "
                   "manifest first); deploys/all.py changes no installed CUDA toolkit or cuDNN")


FIX_COMPONENT_DRIFT = ("put each back at the version its CUDA toolkit release ships: apt-get install --allow-downgrades "
                       "--allow-change-held-packages PACKAGE=VERSION (apt-cache madison PACKAGE), then apt-mark hold "
                       "PACKAGE; tools/rollout moves the components with a toolkit release")


@check("driver")
def cuda_cudnn_releases_exact(ctx: Context) -> Result:
    """The CUDA toolkit and cuDNN on the host are exactly the resolved releases: a presence check
    would pass a cuDNN changed by hand or left behind by an inventory change. gpufleet's record
    of what it installed tells the two apart: an inventory change is a pending upgrade (as
    for the driver: WARN, or FAIL with driver_upgrade_pending: fail), a hand change a FAIL."""
    from gpufleet.facts.packages import StackPackages

    name = "the CUDA toolkit and cuDNN are the resolved releases"
    try:
        res = ctx.resolution()
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"nothing resolves for this host: {refused.reason}")
    wanted = res.stack_versions
    if not wanted:
        return Result("driver", name, SKIP, "the tier installs no host CUDA toolkit or cuDNN from NVIDIA's repository")
    found = ctx.fact(StackPackages, packages=stack_fact_packages(wanted))
    installed = found.installed
    renames = stack_renames(wanted, installed)
    renamed = {p for what, family in STACK_FAMILIES if what in renames for p in wanted if family.match(p)}
    missing = [p for p in sorted(wanted) if not installed.get(p) and p not in renamed]
    states = stack_states(wanted, installed, found.recorded)
    drift = [stack_drift_message(p, have, mine or "?", wanted[p])
             for p, (state, have, mine) in states.items() if state == "drift"]
    moves: dict[str, tuple[str, str]] = {}
    for p, (state, have, _) in states.items():
        if state == "pending":
            what = "CUDA toolkit" if p == res.cuda_package else "cuDNN"
            moves.setdefault(what, (have, wanted[p]))
    moves.update((what, (old, new)) for what, (_, old, new) in renames.items())
    pending = [stack_pending_message(what, *v) for what, v in moves.items()]
    components = component_drift(found.components, wanted, installed)
    not_installed = f"not installed: {', '.join(missing)}" if missing else ""
    if drift or components:
        fix = FIX_STACK_DRIFT if drift else FIX_COMPONENT_DRIFT
        return Result("driver", name, FAIL, "; ".join([*drift, *components, *pending]
                                                      + ([not_installed] if missing else [])), fix)
    if missing:
        return Result("driver", name, FAIL, "; ".join([*pending, not_installed]), FIX_DEPLOY)
    if pending:
        status = (FAIL if ctx.settings.driver_upgrade_pending == "fail" or ctx.settings.driver_upgrade_in_place
                  else WARN)
        fix = (FIX_DEPLOY + " (driver_upgrade_in_place: it moves the packages when the GPUs are idle, manifest first)"
               if ctx.settings.driver_upgrade_in_place else FIX_ROLLOUT)
        return Result("driver", name, status, "; ".join(pending), fix)
    shown = [f"CUDA {res.cuda_release}"] if res.cuda_release else []
    shown += [f"cuDNN {res.cudnn_release}"] if res.cudnn_release else []
    return Result("driver", name, PASS, ", ".join(shown))


@check("driver")
def stack_held(ctx: Context) -> Result:
    """The driver, CUDA and cuDNN packages held and NVIDIA's version-locking package present, as
    deploys/driver.py leaves them: an `apt-mark unhold` by hand lets the next `apt upgrade` move
    the stack past the gate."""
    from gpufleet.facts.packages import HeldPackages

    name = "the driver, CUDA and cuDNN are held and nvidia-driver-pinning-* is installed"
    if not ctx.settings.driver_hold:
        return Result("driver", name, SKIP, "driver_hold: false")
    try:
        res = ctx.resolution()
    except Incompatible as refused:
        return Result("driver", name, SKIP, f"nothing resolves for this host: {refused.reason}")
    wanted = sorted({*res.package_versions, *res.stack_versions})
    pinning = [res.pinning_package] if res.pinning_package else []
    versions = ctx.fact(PackageVersions, packages=[*wanted, *pinning])
    installed = [p for p in wanted if versions.get(p)]
    if not installed:
        return Result("driver", name, SKIP, "no driver package installed")
    held = set(ctx.fact(HeldPackages))
    loose = [p for p in installed if p not in held]
    missing_pin = [p for p in pinning if not versions.get(p)]
    if loose or missing_pin:
        found = [f"not held: {', '.join(loose)}"] if loose else []
        found += [f"{missing_pin[0]} not installed (NVIDIA's version lock)"] if missing_pin else []
        fix = (f"apt-mark hold {' '.join(loose)}" if loose else "") + (" and " if loose and missing_pin else "")
        fix += f"apt-get install {missing_pin[0]}" if missing_pin else ""
        return Result("driver", name, FAIL, "; ".join(found), f"{fix} (or {FIX_DEPLOY}, which holds them)")
    return Result("driver", name, PASS, f"{len(installed)} held" + (f", {pinning[0]}" if pinning else ""))


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


@check("driver")
def kernels_have_the_module(ctx: Context) -> Result:
    """A kernel installed after the driver (unattended upgrades) boots without GPUs unless DKMS
    built the module for it, which needs that kernel's headers (linux-headers-<flavour>), or,
    with Ubuntu's prebuilt modules, unless their package for that kernel came with it."""
    from gpufleet.catalog.kernels import headers_metapackage

    name = "every installed kernel has the nvidia module"
    drv = ctx.driver
    if not drv.userspace_version:
        return Result("driver", name, SKIP, "no NVIDIA driver installed")
    if not drv.installed_kernels:
        return Result("driver", name, SKIP, "no kernel in /lib/modules (a container runs its host's kernel)")
    missing = [release for release, has in sorted(drv.installed_kernels.items())
               if not has and not (release == drv.kernel_release and drv.module_loaded)]
    if not missing:
        return Result("driver", name, PASS, f"{len(drv.installed_kernels)} kernel(s)")
    prebuilt = sorted(n for n, e in drv.packages.items() if n.startswith("linux-modules-nvidia-") and e.installed)
    if prebuilt:
        # Ubuntu's prebuilt modules: no DKMS builds them for a kernel that came alone (held with
        # the driver by deploys/driver.py, so one installed by hand or before the holds)
        return Result("driver", name, WARN, f"no prebuilt nvidia module for {', '.join(missing)}: booting "
                      f"{'it' if len(missing) == 1 else 'one'} leaves the GPUs without a driver",
                      "kernels move with their prebuilt modules only through tools/rollout INVENTORY (it moves "
                      "the held kernel and linux-modules-nvidia-* flavour metapackages together); install "
                      "linux-modules-nvidia-<series>-RELEASE for each, or remove that kernel")
    meta = sorted({m for m in map(headers_metapackage, missing) if m})
    how = (f"install {' '.join(meta)} (deploys/all.py does, for the running kernel's flavour), then "
           "`dkms autoinstall -k RELEASE` for each" if meta else "install their headers, then `dkms autoinstall -k RELEASE`")
    return Result("driver", name, WARN, f"no nvidia module for {', '.join(missing)}: booting "
                  f"{'it' if len(missing) == 1 else 'one'} leaves the GPUs without a driver", how)


@check("driver")
def fabric_manager_active(ctx: Context) -> Result:
    name = "Fabric Manager is active where NVSwitch is present"
    if not ctx.hardware().nvswitch:
        return Result("driver", name, SKIP, "no NVSwitch on this host")
    state = ctx.fact(UnitActive, unit="nvidia-fabricmanager.service")
    if state == "active":
        return Result("driver", name, PASS, "nvidia-fabricmanager.service active")
    return Result("driver", name, FAIL, f"nvidia-fabricmanager.service is {state}",
                  "systemctl start nvidia-fabricmanager, or run deploys/all.py")


# --- tuning -----------------------------------------------------------------------------------

def _gpus_or_skip(ctx: Context, area: str, name: str) -> Result | None:
    if not ctx.gpu.ok:
        return Result(area, name, SKIP, f"nvidia-smi: {ctx.gpu.status}")
    return None


@check("tuning")
def persistence_on(ctx: Context) -> Result:
    name = "persistence mode is on for every GPU"
    skip = _gpus_or_skip(ctx, "tuning", name)
    if skip:
        return skip
    off = [str(g.index) for g in ctx.gpu.gpus if g.persistence is not True]
    found = f"off on GPU {', '.join(off)}" if off else f"on for {len(ctx.gpu.gpus)} GPUs"
    if ctx.settings.driver_persistence == "off":
        return Result("tuning", name, SKIP, f"driver_persistence: off ({found})")
    if off:
        return Result("tuning", name, FAIL, found, "nvidia-smi -pm 1 (or run deploys/all.py)")
    return Result("tuning", name, PASS, found)


@check("tuning")
def clocks_as_set(ctx: Context) -> Result:
    name = "GPU clocks are what the tier's clock policy sets"
    policy = ctx.settings.clock_policy
    if policy == "unmanaged":
        return Result("tuning", name, SKIP, "clock_policy: unmanaged")
    skip = _gpus_or_skip(ctx, "tuning", name)
    if skip:
        return skip
    # The tuning deploy's own plan: a GPU that still needs a command is not at its target.
    try:
        plan = plan_tuning(ctx.host, ctx.settings)
    except Refusal as refused:  # the deploy would refuse this host too
        return Result("tuning", name, FAIL, f"the tuning deploy refuses this host: {refused}",
                      "change clock_policy for this host")
    off = [f"{c.label}: wants {c.target.mem},{c.target.gfx}" if c.target else f"{c.label}: wants default"
           for c in plan.clocks if c.commands]
    if off:
        return Result("tuning", name, FAIL, "; ".join(off), "run deploys/all.py (tuning sets the clocks)")
    return Result("tuning", name, PASS, f"{len(plan.clocks)} GPUs at policy {policy}: {clocks_summary(plan.clocks)}")


@check("tuning")
def mig_as_set(ctx: Context) -> Result:
    name = "MIG partitions are what gpu_mig sets"
    setting = ctx.settings.gpu_mig
    if setting == "unmanaged":
        return Result("tuning", name, SKIP, "gpu_mig: unmanaged")
    skip = _gpus_or_skip(ctx, "tuning", name)
    if skip:
        return skip
    try:
        plan = host_mig(ctx.host, setting)
    except Refusal as refused:  # the deploy refuses this host too
        return Result("tuning", name, FAIL, f"the tuning deploy refuses this host: {refused}",
                      "change gpu_mig for this host")
    if not plan.gpus:
        return Result("tuning", name, PASS, "no GPU with MIG on this host")
    off = [f"{g.label}: has {g.found}, wants " + (" + ".join(g.wanted) if g.wanted is not None else "MIG off")
           for g in plan.changes]
    if not off:
        return Result("tuning", name, PASS, plan.summary())
    from gpufleet.controller.run_summary import SUMMARY

    reboot = SUMMARY.mig_reboot.get(ctx.host.name)
    if reboot:
        return Result("tuning", name, WARN, f"NEEDS A REBOOT (the GPU reset was refused: {reboot}): " + "; ".join(off),
                      "reboot the host while its GPUs are idle; the boot unit makes the partitions")
    pending = SUMMARY.mig_pending.get(ctx.host.name)
    if pending:
        return Result("tuning", name, WARN, f"PENDING (GPU work was running right before the change: {pending[1]}): "
                      + "; ".join(off), "re-run deploys/all.py once the GPUs are idle")
    return Result("tuning", name, FAIL, "; ".join(off),
                  "run deploys/all.py while the GPUs are idle (MIG changes only then)")


@check("tuning")
def profiles_current(ctx: Context) -> Result:
    name = "the NCCL / OMP / PyTorch profiles are present and current"
    stale, missing = [], []
    for path, text in plan_tuning(ctx.host, ctx.settings).files.items():
        digest = ctx.fact(Sha256File, path=path)
        if digest is None:
            missing.append(path)
        elif digest != hashlib.sha256(text.encode()).hexdigest():
            stale.append(path)
    if missing or stale:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + (
            [f"changed {', '.join(stale)}"] if stale else [])
        return Result("tuning", name, FAIL, "; ".join(parts), FIX_DEPLOY)
    return Result("tuning", name, PASS)


@check("tuning")
def gpudirect_rdma(ctx: Context) -> Result:
    """nvidia-peermem on the ib / roce profiles where the host has RDMA devices: loaded, the
    loaded driver's version, and loaded at boot (gpufleet/plans/gpudirect.py, the deploy's own plan)."""
    from gpufleet.plans import gpudirect
    from gpufleet.facts.kernel import PeermemState
    from gpufleet.config.hostfacts import rdma_devices

    name = "GPUDirect RDMA: nvidia-peermem is loaded, matches the driver and loads at boot"
    rdma = rdma_devices(ctx.host)
    if not gpudirect.rdma_tier(ctx.settings):
        return Result("tuning", name, SKIP, f"nccl_profile: {ctx.settings.nccl_profile} has no RDMA between hosts")
    if not rdma:
        return Result("tuning", name, SKIP, "no RDMA device on this host (/sys/class/infiniband is empty)")
    peermem = ctx.fact(PeermemState)
    plan = gpudirect.plan_peermem(ctx.settings.nccl_profile, rdma, ctx.driver, peermem)
    if plan.problem:
        return Result("tuning", name, FAIL, plan.problem, FIX_DEPLOY if "reinstall" in plan.problem
                      else "reboot the host when it is idle")
    if not peermem.loaded:
        return Result("tuning", name, FAIL, f"{gpudirect.MODULE} is not loaded: NCCL stages every transfer "
                      "through host memory", f"modprobe {gpudirect.MODULE}, or {FIX_DEPLOY}")
    if gpudirect.BOOT_FILE not in peermem.boot_files:
        return Result("tuning", name, FAIL, f"{gpudirect.BOOT_FILE} is missing: it would not load at the next boot",
                      FIX_DEPLOY)
    return Result("tuning", name, PASS, f"{gpudirect.MODULE} {peermem.loaded_version} loaded with driver "
                  f"{ctx.driver.module_version}, and at boot ({gpudirect.BOOT_FILE})")


@check("tuning")
def nccl_hcas_up(ctx: Context) -> Result:
    """The HCAs /etc/nccl.conf gives NCCL (NCCL_IB_HCA, or every HCA) are there, up, fast enough."""
    from gpufleet.plans import gpudirect
    from gpufleet.config.hostfacts import rdma_devices
    from gpufleet.plans.tuning import ib_hca

    name = "the NCCL profile's HCAs are up at the tier's speed"
    settings = ctx.settings
    if not gpudirect.rdma_tier(settings):
        return Result("tuning", name, SKIP, f"nccl_profile: {settings.nccl_profile} uses no HCA")
    rdma = rdma_devices(ctx.host)
    if not rdma:
        return Result("tuning", name, SKIP, "no RDMA device on this host (/sys/class/infiniband is empty)")
    try:
        listed = ib_hca(settings.tuning_nccl_ib_hca, settings.nccl_profile, rdma)
    except Refusal as refused:
        return Result("tuning", name, FAIL, refused.problem, f"set tuning_nccl_ib_hca: {refused.allowed}")
    problems, good = gpudirect.hca_problems(listed, rdma, settings.validate_min_nic_gbps)
    said = f"NCCL_IB_HCA {listed}" if listed else "every HCA"
    if problems:
        return Result("tuning", name, FAIL, f"{said}: " + "; ".join(problems),
                      "bring the link up (ibstat, the switch port), or name only the working HCAs in tuning_nccl_ib_hca")
    return Result("tuning", name, PASS, f"{said}: " + ", ".join(good))


@check("tuning")
def profiling_as_set(ctx: Context) -> Result:
    """tuning_profiling: who the loaded nvidia module lets read the GPU performance counters
    (/proc/driver/nvidia/params, RmProfilingAdminOnly), gpufleet's modprobe.d file for the next
    load, and with users the Nsight packages at the toolkit release's versions, held (the
    deploy's own plan, gpufleet/plans/profiling.py)."""
    from gpufleet.facts.packages import HeldPackages
    from gpufleet.plans.profiling import FILE_TEXT, KEY, MODPROBE_FILE, USERS, ProfilingRefusal, host_profiling

    name = "GPU performance counters are for whom tuning_profiling says"
    setting = ctx.settings.tuning_profiling
    try:
        res = ctx.resolution()
    except Incompatible:
        res = None
    try:
        plan = host_profiling(ctx.host, ctx.settings, res)
    except ProfilingRefusal as refused:
        return Result("tuning", name, FAIL, f"the driver deploy refuses this host: {refused}",
                      f"set {KEY} to what this host allows: {refused.allowed}")
    digest = ctx.fact(Sha256File, path=MODPROBE_FILE)
    if plan.file_text is not None and digest != hashlib.sha256(FILE_TEXT.encode()).hexdigest():
        return Result("tuning", name, FAIL, f"{MODPROBE_FILE} is {'changed' if digest else 'missing'}: the next load "
                      "of the nvidia module would not let users read the counters", FIX_DEPLOY)
    if plan.file_text is None and digest is not None:
        return Result("tuning", name, FAIL, f"{MODPROBE_FILE} is there though {KEY} is {setting}", FIX_DEPLOY)
    if plan.nsight:
        have = ctx.fact(PackageVersions, packages=list(plan.nsight))
        held = set(ctx.fact(HeldPackages))
        off = [f"{p} {have.get(p) or 'not installed'} (wants {v})" for p, v in plan.nsight.items()
               if not (have.get(p) or "").split(":")[-1].startswith(v + "-")]
        loose = [p for p in plan.nsight if p not in held] if ctx.settings.driver_hold else []
        if off or loose:
            return Result("tuning", name, FAIL, "; ".join(off + [f"{p} not held" for p in loose]), FIX_DEPLOY)
    if plan.loaded is None:
        return Result("tuning", name, SKIP, f"no nvidia module loaded: {KEY}: {setting} applies at its first load")
    if plan.pending:
        return Result("tuning", name, WARN, f"PENDING: the loaded nvidia module gives them to {plan.who(plan.loaded)} "
                      f"(RmProfilingAdminOnly {plan.loaded}); {KEY}: {setting} takes effect at its next load",
                      "tools/rollout INVENTORY reboots it through the gate (drained, the GPUs idle right before); "
                      "deploys/all.py does not reboot for it")
    if setting != USERS and plan.wanted == 0:
        return Result("tuning", name, WARN, f"{KEY}: {setting}, but every user may read them: "
                      + ", ".join(f"{p} sets the option to {v}" for p, v in plan.others.items())
                      + " (not gpufleet's file)", f"remove that line and reboot, or set {KEY}: {USERS}")
    shown = [f"{plan.who(plan.loaded)} (RmProfilingAdminOnly {plan.loaded})"]
    shown += [", ".join(f"{p} {v}" for p, v in plan.nsight.items()) + " held"] if plan.nsight else []
    return Result("tuning", name, PASS, "; ".join(shown))


@check("tuning")
def cpu_governor_as_set(ctx: Context) -> Result:
    """The same plan as the deploy's: a CPU it would still write to is not on the tier's governor."""
    from gpufleet.config.hostfacts import cpu_freq
    from gpufleet.plans.tuning import plan_governor

    name = "every CPU runs the tier's frequency governor"
    try:
        plan = plan_governor(ctx.settings.tuning_cpu_governor, cpu_freq(ctx.host))
    except Refusal as refused:
        return Result("tuning", name, FAIL, str(refused), "set tuning_cpu_governor to one the host offers")
    if plan.governor is None:
        return Result("tuning", name, SKIP, plan.reason)
    if plan.cpus:
        now = cpu_freq(ctx.host).governors
        found = sorted({now[c] or "unreadable" for c in plan.cpus})
        return Result("tuning", name, FAIL, f"{len(plan.cpus)} CPU(s) ({', '.join(plan.cpus[:4])}"
                      f"{', ...' if len(plan.cpus) > 4 else ''}) run {', '.join(found)}, not {plan.governor}",
                      "run deploys/all.py (tuning sets the governor)")
    return Result("tuning", name, PASS, f"{len(cpu_freq(ctx.host).governors)} CPUs on {plan.governor}")


# --- docker -----------------------------------------------------------------------------------

@check("docker")
def containers_see_gpus(ctx: Context) -> Result:
    name = "containers see the GPUs"
    data = ctx.fact(ContainerGpus)
    found = (f"docker {'present' if data.docker else 'absent'}, nvidia runtime "
             f"{'yes' if data.nvidia_runtime else 'no'}, {len(data.gpu_indices)} CDI GPUs")
    if not data.docker:
        return Result("docker", name, SKIP, "no docker on this host")
    gpus = len(ctx.gpu.gpus) if ctx.gpu.ok else 0
    problems = []
    if data.active != "active":
        problems.append(f"docker.service is {data.active}")
    if ctx.settings.docker_default_runtime == "nvidia" and not data.nvidia_runtime:
        problems.append("dockerd has no nvidia runtime")
    if ctx.settings.docker_cdi and len(data.gpu_indices) != gpus:
        problems.append(f"CDI lists {len(data.gpu_indices)} GPUs, nvidia-smi {gpus}")
    if problems:
        return Result("docker", name, FAIL, "; ".join(problems), FIX_DEPLOY)
    return Result("docker", name, PASS, found)


@check("docker")
def daemon_json_current(ctx: Context) -> Result:
    """Validation: daemon.json holds every gpufleet key; what a run left pending shows here."""
    name = "daemon.json has gpufleet's keys (no Docker change pending)"
    if not ctx.fact(ContainerGpus).docker:
        return Result("docker", name, SKIP, "no docker on this host")
    current = ctx.fact(DaemonJson, path=dockerconf.DAEMON_JSON)
    try:
        existing = dockerconf.parse(current.raw if current.exists else None)
    except dockerconf.MalformedDaemonJson as exc:
        return Result("docker", name, WARN, f"{dockerconf.DAEMON_JSON} is malformed: {exc}", "fix the file, then run deploys/all.py")
    keys = dockerconf.changed_keys(existing, dockerconf.merge(existing, dockerconf.DockerDefaults.from_settings(ctx.settings)))
    if not keys:
        return Result("docker", name, PASS, f"live-restore {'on' if ctx.settings.docker_live_restore else 'off'}")
    return Result("docker", name, WARN, f"not yet in {dockerconf.DAEMON_JSON}: {', '.join(keys)} (a Docker restart "
                  "was left pending while GPU containers ran, or the file was changed)",
                  "run deploys/all.py once the GPU containers have stopped (or set "
                  "docker_restart_with_gpu_containers: always)")


# --- monitoring -------------------------------------------------------------------------------

def exporter_check_name(label: str) -> str:
    return f"the {label} serves metrics"


@check("monitoring")
def exporters_serve_metrics(ctx: Context) -> list[Result]:
    """Each exporter the tier turns on answers on the host with real metrics (curl on the host,
    to the address it is bound to); the DCGM exporter with a GPU temperature for every GPU."""
    from gpufleet.plans import monitoring

    found = monitoring.exporters(ctx.settings)
    if not found:
        return [Result("monitoring", "the tier's Prometheus exporters serve metrics", SKIP,
                       "monitoring_node_exporter and monitoring_dcgm_exporter are false")]
    results = []
    for exporter in found:
        name = exporter_check_name(exporter.label)
        url = monitoring.local_url(ctx.settings, exporter)
        fix = (f"systemctl status {exporter.service} and journalctl -u {exporter.service}; "
               "deploys/monitoring.py installs and starts it")
        dcgm = exporter.key == "monitoring_dcgm_exporter"
        if dcgm and not (ctx.gpu.ok and ctx.gpu.gpus):
            results.append(Result("monitoring", name, SKIP, f"nvidia-smi: {ctx.gpu.status} (DCGM needs a working driver)"))
            continue
        if ctx.scrape_skip:
            results.append(_exporter_not_scraped(ctx, exporter, name, fix))
            continue
        data = ctx.fact(MetricsEndpoint, url=url, family=exporter.family, sample=exporter.sample)
        if data.status == "no-curl":
            results.append(Result("monitoring", name, FAIL, "curl is not installed on the host",
                                  "apt-get install curl (deploys/monitoring.py installs it)"))
            continue
        if data.status != "ok":
            results.append(Result("monitoring", name, FAIL, f"{url}: {data.error}", fix))
            continue
        if not data.samples:
            results.append(Result("monitoring", name, FAIL, f"{url} answered without any {exporter.family}* metric", fix))
            continue
        found_text = f"{url}: {data.samples} {exporter.family}* samples"
        if dcgm:
            want = sorted(str(g.index) for g in ctx.gpu.gpus)
            have = sorted(set(data.label_values("gpu")))
            if have != want:
                results.append(Result("monitoring", name, FAIL, f"{found_text}, but {exporter.sample} for GPU "
                                      f"{', '.join(have) or 'none'} of {', '.join(want)}",
                                      f"systemctl status {monitoring.DCGM_SERVICE} {exporter.service}; dcgmi discovery -l"))
                continue
            found_text += f", {exporter.sample} for {len(want)} GPUs"
        results.append(Result("monitoring", name, PASS, found_text))
    return results


def _exporter_not_scraped(ctx: Context, exporter: Any, name: str, fix: str) -> Result:
    """A run that does not scrape (all.py's re-run that changed nothing): systemd must still
    report the exporter running. On that run deploys/monitoring.py read this very fact (a
    stopped exporter would have been started, and the run then scrapes), so it costs no command."""
    running = ctx.fact(SystemdStatus, services=[exporter.service]).get(exporter.service)
    if not running:
        return Result("monitoring", name, FAIL, f"{exporter.service} is not running (systemd)", fix)
    return Result("monitoring", name, SKIP, f"not scraped: {ctx.scrape_skip}; systemd reports {exporter.service} running")


# --- hardening --------------------------------------------------------------------------------

@check("hardening")
def sshd_hardened(ctx: Context) -> Result:
    name = "sshd's effective configuration is hardened"
    config = ctx.fact(SshdEffectiveConfig)
    if config is None:
        return Result("hardening", name, FAIL, "sshd -T printed nothing (no sshd?)", FIX_DEPLOY)
    expected = expected_sshd(ctx.settings)
    wrong = [f"{key} {_sshd_value(got)} (want {_sshd_value(want)})" for key, got, want in config.differences(expected)]
    if wrong:
        return Result("hardening", name, FAIL, "sshd -T: " + ", ".join(wrong), FIX_DEPLOY)
    return Result("hardening", name, PASS, f"{len(expected)} settings as the tier says")


def _sshd_value(value: Any) -> str:
    """A value as sshd_config writes it (a multi-valued keyword's values space-separated)."""
    if isinstance(value, list):
        return " ".join(value) if value else "none"
    return str(value)


@check("hardening")
def firewall_active(ctx: Context) -> Result:
    name = "the host firewall is active"
    if not ctx.settings.firewall_enabled:
        return Result("hardening", name, SKIP, "firewall_enabled: false")
    nft = ctx.fact(NftablesCapability)
    conf = ctx.fact(FileContents, path="/etc/nftables.conf") or []
    written = any(f"table {TABLE}" in line for line in conf)
    if not nft.nft_installed:
        return Result("hardening", name, FAIL, "nft is not installed", FIX_DEPLOY)
    if not nft.can_load:
        if written:
            return Result("hardening", name, SKIP, "this host cannot load rules (no CAP_NET_ADMIN, e.g. a "
                          f"container); /etc/nftables.conf holds table {TABLE}")
        return Result("hardening", name, FAIL, f"/etc/nftables.conf lacks table {TABLE}", FIX_DEPLOY)
    if not nft.table_loaded:
        return Result("hardening", name, FAIL, f"table {TABLE} is not loaded",
                      "systemctl restart nftables, or run deploys/all.py")
    return Result("hardening", name, PASS, f"table {TABLE} loaded")


@check("hardening")
def training_peers_let_in(ctx: Context) -> Result:
    """Which networks the host trusts for training (gpufleet/plans/cluster.py), and that the firewall
    the host boots and has loaded lets them in: every rule of theirs is in /etc/nftables.conf."""
    from gpufleet.plans import cluster

    name = "the firewall lets the training peers in"
    settings = ctx.settings
    said = cluster.training_networks(settings)
    if not settings.firewall_enabled:
        return Result("hardening", name, SKIP, said)
    if not settings.firewall_cluster_cidrs:
        if warning := cluster.missing_peers(settings):
            return Result("hardening", name, WARN, warning.partition("; set ")[0],
                          "set " + warning.partition("; set ")[2])
        why = cluster.multi_node(settings)
        return Result("hardening", name, PASS if why else SKIP,
                      said if why else f"tier {settings.tier} trains on one host (nccl_profile: "
                      f"{settings.nccl_profile}, no NVSwitch baseboard); {said}")
    conf = [line.strip() for line in ctx.fact(FileContents, path="/etc/nftables.conf") or []]
    missing = [rule["saddr"] + " " + rule["match"] for rule in cluster.rules(settings)
               if f'{rule["family"]} saddr {rule["saddr"]} {rule["match"]} accept comment "{rule["comment"]}"' not in conf]
    if missing:
        return Result("hardening", name, FAIL, f"/etc/nftables.conf does not let in {', '.join(missing)}", FIX_DEPLOY)
    nft = ctx.fact(NftablesCapability)
    if nft.can_load and not nft.table_loaded:
        return Result("hardening", name, FAIL, f"table {TABLE} is not loaded: {said}",
                      "systemctl restart nftables, or run deploys/all.py")
    return Result("hardening", name, PASS, said)


# --- GPU health: the GPU to pull before a job finds it --------------------------------------------

HEALTH_CHECK = "the GPUs are healthy (ECC, row remapper, throttling, PCIe, NVLink, XIDs)"


@check("health")
def gpu_health(ctx: Context) -> Result:
    """FAILs a host with a finding of class reset or worse (gpufleet/data/health.yaml), naming the
    GPU by index and bus id; WARNs on what only needs watching."""
    if ctx.health_skip:
        return Result("health", HEALTH_CHECK, SKIP, ctx.health_skip)
    if not ctx.gpu.ok:
        return Result("health", HEALTH_CHECK, SKIP, f"nvidia-smi does not work ({ctx.gpu.status}): see the driver checks")
    verdict = assess(ctx.fact(GpuHealth), nvlink=getattr(ctx.settings, "validate_nvlink", "any"))
    found = [(g, f) for g, f in all_findings(verdict) if f.cls != "ok"]

    def where(g: GpuVerdict | None) -> str:
        return f"GPU {g.index} ({g.bus_id})" if g else "host"

    act = verdict.actionable()
    if act:
        return Result("health", HEALTH_CHECK, FAIL,
                      "; ".join(f"{where(g)}: {f.cls}: {f.detail}" for g, f in act),
                      act[0][1].fix + " (tools/health INVENTORY lists every finding)")
    if found:
        return Result("health", HEALTH_CHECK, WARN, "; ".join(f"{where(g)}: {f.cls}: {f.detail}" for g, f in found),
                      found[0][1].fix)
    return Result("health", HEALTH_CHECK, PASS, f"{len(verdict.gpus)} GPU(s): no ECC, row remap, throttling, "
                                                "PCIe, NVLink or XID finding")


# --- optional health and performance probe ----------------------------------------------------

DCGM_CHECK = "DCGM's quick diagnostic passes"


def diag_result(diag: DcgmDiagData, buses: dict[int, str], name: str, area: str) -> Result:
    """A DCGM diagnostic as a check's result: PASS, SKIP without DCGM, or FAIL naming each failed
    GPU (index and bus id) with DCGM's message and the class its severity gives (health.yaml)."""
    command = f"dcgmi diag -r {diag.level} -j"
    if diag.status == "not-installed":
        return Result(area, name, SKIP, "skipped: DCGM not installed")
    if diag.status == "pass":
        return Result(area, name, PASS, command)
    if diag.status != "fail":
        return Result(area, name, FAIL, diag.detail, f"run `{command}` on the host (as root) and read what it says")
    rules = health_rules()
    found = sorted(((r.gpu, f) for r in diag.results for f in diag_findings(r, diag.level, rules)),
                   key=lambda pair: -rank(pair[1].cls))

    def where(gpu: int | None) -> str:
        return "host" if gpu is None else f"GPU {gpu} ({buses.get(gpu, 'bus id unknown')})"

    what = "; ".join(f"{where(gpu)}: {f.cls}: {f.detail}" for gpu, f in found) or f"failed: {', '.join(diag.failed)}"
    fix = found[0][1].fix if found else f"run `{command}` on the host (as root)"
    return Result(area, name, FAIL, what, f"{fix} (`{command}` on the host shows the whole run)")


@check("probe")
def dcgm_diag(ctx: Context) -> Result:
    if not ctx.probe:
        return Result("probe", DCGM_CHECK, SKIP, ctx.probe_skip)
    diag = ctx.fact(DcgmDiag, level=1)
    return diag_result(diag, {g.index: g.bus_id for g in ctx.gpu.gpus}, DCGM_CHECK, "probe")


def probe_arguments() -> dict[str, Any]:
    """PerfProbe's arguments: GPUFLEET_VALIDATE_PROBE_DEVICE=cpu runs its small CPU variant
    (hosts with PyTorch but no CUDA device, such as the test hosts; no minimums apply)."""
    if os.environ.get("GPUFLEET_VALIDATE_PROBE_DEVICE", "cuda").strip().lower() == "cpu":
        return {"device": "cpu", "size": 512, "iters": 3, "copy_mib": 64, "allreduce_mib": 16}
    return {}


def no_torch(ctx: Context, area: str, name: str, what: str) -> Result:
    """The runtime imports no torch: a WARN naming what to set (the tier asked for a runtime;
    only pytorch_runtime: none says the host has no PyTorch on purpose)."""
    runtime = ctx.runtime
    return Result(area, name, WARN, f"no PyTorch to run it with: {what} ({runtime.describe()})",
                  runtime.missing_fix(ctx.wanted_pytorch()))


def no_runtime(area: str, name: str) -> Result:
    return Result(area, name, SKIP, "no PyTorch on this host (pytorch_runtime: none): set pytorch_runtime to "
                                    "venv or python to check it")


@check("probe")
def performance(ctx: Context) -> Result:
    name = "bf16 matmul, memory and all-reduce bandwidth reach the expected minimums"
    if not ctx.probe:
        return Result("probe", name, SKIP, ctx.probe_skip)
    runtime = ctx.runtime
    if runtime.kind == "none":
        return no_runtime("probe", name)
    lines = ctx.fact(PerfProbe, python=runtime.python, **probe_arguments())
    models = {g.index: g.name for g in ctx.gpu.gpus} if ctx.gpu.ok else {}
    nvlink = False
    if ctx.gpu.ok and len(ctx.gpu.gpus) > 1:
        names = [d for d in ctx.gpu.topology.devices if d.startswith("GPU")]
        nvlink = bool(names) and all(ctx.gpu.topology.nvlinks(a, b) for a in names for b in names if a != b)
    try:
        result = perf.parse_probe_output(lines, models, nvlink=nvlink)
    except ValueError as error:
        return Result("probe", name, FAIL, f"probe output not understood: {error}", "")
    if result.status != "ok":
        if result.reason in ("PyTorch not installed", "no such interpreter"):
            missing = "no such interpreter" if result.reason == "no such interpreter" else "it imports no torch"
            return no_torch(ctx, "probe", name, f"{runtime.python}: {missing}")
        return Result("probe", name, SKIP, f"skipped ({runtime.describe()}): {result.reason}")
    used = f"torch {result.torch}, {runtime.describe()}"
    if not result.measurements:
        return Result("probe", name, SKIP, f"skipped ({used}): " + "; ".join(result.skipped))
    text = "; ".join(m.describe() for m in result.measurements) + f" ({used})"
    if result.failures:
        return Result("probe", name, FAIL, text, "check clocks, power and thermals (nvidia-smi -q -d "
                      "PERFORMANCE), PCIe width and NVLink state (nvidia-smi nvlink -s)")
    return Result("probe", name, PASS, text)


# --- the host's PyTorch build -------------------------------------------------------------------

PYTORCH_CHECK = "the host's PyTorch build runs on its GPUs and driver"


def _pytorch_fix(ctx: Context, installed: str | None, models: Any, driver: str | None) -> str:
    """The wheel to install instead: the installed release's fitting variant, else the tier's
    PyTorch choice for this host, else where to ask. Never the very build that failed (the
    compatibility data would then disagree with the host: said so)."""
    from gpufleet.catalog.pytorch import choose_pytorch
    from gpufleet.versions import major_minor

    version, _, tag = (installed or "").partition("+")
    release = major_minor(version)
    disagrees = ""
    if driver:
        try:
            choice = choose_pytorch(models, release, driver)
            if choice is not None and choice.variant != tag:
                return f"pip install --force-reinstall torch=={choice.version}.* --index-url {choice.index_url}"
            if choice is not None:
                disagrees = (f"gpufleet's compatibility data says {release} {tag} fits these GPUs, the host's "
                             f"build does not (report it); ")
        except Incompatible:
            pass
    try:
        choice = ctx.resolution().pytorch
    except Incompatible:
        choice = None
    if choice is not None and not disagrees:
        return (f"pip install --force-reinstall torch=={choice.version}.* --index-url {choice.index_url} "
                "(the tier's pytorch_version, resolved for this host)")
    gpus = " ".join(f"--gpu {m.name!r}" for m in {m.name: m for m in models}.values())
    return disagrees + f"install a CUDA build that covers these GPUs (tools/compat {gpus} --pytorch RELEASE answers)"


@check("pytorch")
def pytorch_build_runs_here(ctx: Context) -> Result:
    """Where python3 imports torch: its CUDA build (torch.version.cuda) needs a driver at or
    above the CUDA family's floor, and its architecture list (torch.cuda.get_arch_list())
    must cover every GPU, or jobs fail at their first CUDA call (gpufleet/catalog/pytorch.py)."""
    from gpufleet.catalog.pytorch import NONE, check_build

    name = PYTORCH_CHECK
    if not ctx.torch_probe:
        return Result("pytorch", name, SKIP, ctx.probe_skip)
    runtime = ctx.runtime
    if runtime.kind == "none":
        return no_runtime("pytorch", name)
    build = ctx.fact(TorchBuild, python=runtime.python)
    if build.status == "no-python":
        return no_torch(ctx, "pytorch", name, f"{runtime.python}: no such interpreter")
    if build.status == "no-torch":
        python = f"{runtime.python} (python {build.python})" if build.python else runtime.python
        return no_torch(ctx, "pytorch", name, f"{python} imports no torch ({build.reason or 'not installed'})")
    if build.status == "broken":
        return Result("pytorch", name, FAIL, f"{runtime.python} finds torch but importing it fails: {build.reason}",
                      "reinstall PyTorch (pip install --force-reinstall torch==... --index-url ...)")
    if build.status != "ok":
        return Result("pytorch", name, WARN, f"the PyTorch probe's answer was not understood: {build.reason}", "")
    where = f"torch {build.torch} ({build.path or runtime.python})"
    models = ctx.hardware().models
    if not models:
        return Result("pytorch", name, SKIP, f"nothing to check against: no known NVIDIA GPU ({where})")
    if build.hip:
        return Result("pytorch", name, SKIP, f"{where} is a ROCm build (HIP {build.hip}), not for NVIDIA GPUs")
    drv = ctx.driver
    driver = drv.module_version or drv.userspace_version or (ctx.gpu.nvml_version if ctx.gpu.ok else None)
    fix = _pytorch_fix(ctx, build.torch, models, driver)
    if build.cpu_only:
        # the classic "torch.cuda.is_available() is False": a CPU wheel on a GPU server
        wanted = getattr(ctx.settings, "pytorch_version", NONE)
        status = WARN if wanted in (None, NONE) else FAIL
        return Result("pytorch", name, status, f"{where} is a CPU-only build (torch.version.cuda is None): "
                      f"torch.cuda.is_available() is False, jobs run on the CPU and not on the "
                      f"{len(models)} GPU{'s' if len(models) != 1 else ''} ({runtime.describe()})", fix)
    verdict = check_build(models, build.torch or "?", build.cuda or "", build.arch_list, driver)
    message = f"{verdict.message} ({runtime.describe()})"
    if verdict.status == "pass":
        return Result("pytorch", name, PASS, message)
    if verdict.status == "unknown":
        return Result("pytorch", name, WARN, message, fix)
    return Result("pytorch", name, FAIL, message, fix)


# --- running ----------------------------------------------------------------------------------

def run_checks(host: Any, settings: Any, probe: bool = True, probe_skip: str = "probes turned off",
               torch_probe: bool | None = None, scrape_skip: str = "", health_skip: str = "") -> list[Result]:
    """Every check against the host as it is now. A check that raises becomes a failed result
    naming the error, so one broken check never hides the others. `scrape_skip`, when given,
    says why the exporters are not scraped (their units are checked instead)."""
    ctx = Context(host, settings, probe=probe, probe_skip=probe_skip, torch_probe=torch_probe,
                  scrape_skip=scrape_skip, health_skip=health_skip)
    results: list[Result] = []
    with fresh_host_facts(host):
        for area, func in CHECKS:
            try:
                out = func(ctx)
            except Exception as error:  # noqa: BLE001 - reported, never swallowed
                out = Result(area, func.__name__.replace("_", " "), FAIL,
                             f"the check itself failed: {type(error).__name__}: {error}",
                             "report this as a gpufleet bug")
            results.extend(out if isinstance(out, list) else [out])
    return results


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.status == FAIL]
