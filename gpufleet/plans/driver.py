"""The driver area's plan: what deploys/driver.py does with a host, decided on the controller from
facts read before the run and the host's Settings. Pure: `plan_driver(settings, facts)` gives the
same DriverPlan (or Refusal) for the same facts; `read_driver_facts` is the one place that
asks the host, in the order (and only the questions) the decisions need.

Read by the deploy (it applies the plan), the plan view (it prints it) and the unit tests (on
recorded facts: tests/unit/plans/driver/*.json).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pyinfra.facts.files import File
from pyinfra.facts.server import Arch

from gpufleet.catalog.compat import compat_data
from gpufleet.catalog.cuda_stack import (component_drift, pending_message, stack_drift_message, stack_fact_packages,
                                         stack_pending_message, stack_renames, stack_states)
from gpufleet.catalog.kernels import kernel_metapackages
from gpufleet.config.hostfacts import KernelPlan, driver_state, kernel_plan, os_name, resolution
from gpufleet.config.resolver import Resolution
from gpufleet.config.settings import Settings
from gpufleet.errors import Incompatible
from gpufleet.explain import NAME_LIMIT
from gpufleet.facts.kernel import DriverStateData, ProfilingState, ProfilingStateData
from gpufleet.facts.packages import AptCandidates, HeldPackages, PackageVersions, StackPackages, StackPackagesData
from gpufleet.plans.driver_preconditions import mok_certificate, plain_path, preconditions
from gpufleet.plans.profiling import KEY as PROFILING_KEY
from gpufleet.config.failures import Refusal, Refused
from gpufleet.plans.profiling import ProfilingPlan, plan_profiling
from gpufleet.plans.repos import apt_url, cuda_repo_base, cuda_sources_line, unsupported_arch

if TYPE_CHECKING:
    from pyinfra.api import Host

AREA = "driver"
# Held with the stack when they are installed (the docker deploy installs the container toolkit).
CONTAINER_TOOLKIT = ("nvidia-container-toolkit", "nvidia-container-toolkit-base",
                     "libnvidia-container1", "libnvidia-container-tools")


@dataclass(frozen=True)
class DriverFacts:
    """What the host is, before the run, as far as the driver's decisions go. `None` fields were
    not asked (their question did not arise: nothing was refused on them)."""
    resolved: Resolution | Incompatible
    machine: str = "x86_64"                          # uname -m
    os: str = ""                                     # "debian-12", "ubuntu-22.04"
    before: DriverStateData = field(default_factory=DriverStateData)
    kernel: KernelPlan = KernelPlan(None, None)
    signing_key_present: bool | None = None          # Secure Boot: the MOK private key's file
    certificate_present: bool | None = None          # ... and its certificate
    headers_offered: bool | None = None              # no headers installed: the sources offer them
    stack: StackPackagesData = field(default_factory=lambda: StackPackagesData({}, {}))
    held: tuple[str, ...] = ()                       # HeldPackages
    installed_pinning: str | None = None             # the installed driver's version lock, if installed
    installed_extra: tuple[str, ...] = ()            # container toolkit / kernel packages installed
    profiling: ProfilingStateData = field(default_factory=ProfilingStateData)


@dataclass(frozen=True)
class NvidiaSource:
    """NVIDIA's CUDA repository: its key (checked by fingerprint) and the signed-by source."""
    base: str
    keyring_url: str
    fingerprint: str
    keyring: str
    line: str                # the sources.list line


@dataclass(frozen=True)
class PackageChange:
    """The one sanctioned change (operations/package_steps.py's packages_at_releases' arguments)."""
    what: str                # what moves, short: the operation's name is "Install {what}"
    releases: dict[str, str]
    present: tuple[str, ...]
    pinning: str | None
    old_pins: tuple[str, ...]
    keys: dict[str, str]
    in_place: tuple[str, ...] = ()   # moves made in place (driver_upgrade_in_place): manifest first

    @property
    def name(self) -> str:
        return f"Install {self.what}"

    @property
    def why(self) -> str:
        """The explanation beside the short name: the exact package releases, and what moves in place."""
        exact = ", ".join(f"{p} {v}" for p, v in sorted(self.releases.items())) or "no package release changes"
        return (f"Install {exact}; unhold, change and re-hold as one step"
                + (f" (in place: {', '.join(self.in_place)}; the GPUs checked idle right before, in the same "
                   "command)" if self.in_place else ""))


@dataclass(frozen=True)
class DriverPlan:
    """Every decision of the driver deploy for one host (see deploys/driver.py's docstring)."""
    res: Resolution
    before: DriverStateData
    kernel: KernelPlan
    profiling: ProfilingPlan
    nvidia: NvidiaSource | None                   # None: the distribution's archive
    archive_components: tuple[str, ...]           # the archive components to enable (distro)
    signing_key: str | None                       # the MOK DKMS signs with
    headers: str | None                           # the running kernel's headers to install
    headers_meta: str | None                      # linux-headers-<flavour> to install
    change: PackageChange
    stack_record: dict[str, str]                  # package -> release gpufleet records as installed
    stack_record_packages: tuple[str, ...]        # StackPackages' arguments for that record
    held: tuple[str, ...]                         # held (or released, driver_hold false) afterwards
    hold_headers_meta: str | None                 # held too: its image metapackage is held
    cuda_home: str | None                         # the CUDA profile's toolkit folder; None: no profile
    pending: tuple[str, str] | None               # driver (installed, resolved) left to tools/rollout
    stack_pending: dict[str, tuple[str, str]]     # CUDA toolkit / cuDNN left to tools/rollout
    drifted: dict[str, tuple[str, ...]]           # changed by hand, left as found
    notes: tuple[str, ...] = ()                   # what this run leaves, in words (the run's warnings)

    @property
    def fabric_manager(self) -> bool:
        return self.res.fabricmanager_needed

    def summary(self) -> list[str]:
        """The plan in words, for the plan view."""
        out = [f"driver_change: {self.change.name}"]
        out += [f"driver_note: {note}" for note in self.notes]
        return out


def read_driver_facts(host: Host, settings: Settings) -> DriverFacts:
    """Ask `host` what the driver plan needs, lazily as the decisions go: a host the resolver
    refuses is asked nothing more; Secure Boot's files and the headers' candidate only when they
    decide (the prefetch of a no-op run holds the rest)."""
    try:
        res = resolution(host, settings)
    except Incompatible as refused:
        return DriverFacts(resolved=refused)
    machine = str(host.get_fact(Arch) or "x86_64")
    before = driver_state(host)
    kernel = kernel_plan(host, res)
    key, key_present, cert_present, offered = settings.driver_module_signing_key, None, None, None
    if before.secure_boot == "enabled" and not kernel.prebuilt and key != "none" and plain_path(key):
        key_present = bool(host.get_fact(File, path=key))
        cert_present = bool(host.get_fact(File, path=mok_certificate(key))) if key_present else None
    if settings.driver_kernel_headers == "require" and not before.kernel_headers and not kernel.prebuilt:
        package = f"linux-headers-{before.kernel_release or '?'}"
        offered = bool(host.get_fact(AptCandidates, packages=[package]).get(package))
    stack = res.stack_versions
    found = host.get_fact(StackPackages, packages=stack_fact_packages(stack)) if stack else StackPackages.default()
    installed = before.userspace_version
    pinning = None
    if installed and installed != res.driver_version:
        wanted = f"nvidia-driver-pinning-{installed}"
        pinning = next((p for p, v in host.get_fact(PackageVersions, packages=[wanted]).items() if v), None)
    extra = _extra_packages(before, kernel, os_name(host))
    held: list[str] = host.get_fact(HeldPackages)
    return DriverFacts(
        resolved=res, machine=machine, os=os_name(host), before=before, kernel=kernel,
        signing_key_present=key_present, certificate_present=cert_present, headers_offered=offered,
        stack=found, held=tuple(held), installed_pinning=pinning,
        installed_extra=tuple(p for p, v in host.get_fact(PackageVersions, packages=extra).items() if v),
        profiling=host.get_fact(ProfilingState))


def _extra_packages(before: DriverStateData, kernel: KernelPlan, os: str) -> list[str]:
    """Held with the stack when installed: the container toolkit, the running kernel's image and
    headers, and with prebuilt modules the kernels' flavour metapackages."""
    release = before.kernel_release or ""
    # Prebuilt modules exist only for the kernels Canonical built them for: a kernel that
    # unattended-upgrades installs alone (it blacklists the module packages, not the kernels)
    # boots without an nvidia module. The kernel flavour metapackages are held with the driver
    # and the modules' flavour metapackage: kernels and their modules move together, and only
    # through tools/rollout.
    metas = kernel_metapackages(release, os) if kernel.prebuilt else []
    return [*CONTAINER_TOOLKIT, *((f"linux-image-{release}", f"linux-headers-{release}") if release else ()), *metas]


# --- the decisions ------------------------------------------------------------------------------


def refusal_of(refused: Incompatible) -> Refusal:
    """The resolver's refusal as the driver deploy words it."""
    if refused.allowed:
        fix = f"set {refused.key or 'the driver settings'} to what this host allows: {refused.allowed}"
    elif refused.key:
        fix = f"change {refused.key} (tools/compat shows what fits this host's GPUs)"
    else:
        fix = "leave this host out of the driver deploy, or give it a GPU gpufleet supports (tools/compat)"
    return Refusal(AREA, refused.key or AREA, refused.reason, fix)


def first_refusal(settings: Settings, facts: DriverFacts) -> Refusal | None:
    """The first reason not to touch the host's driver, from facts before the run."""
    res = facts.resolved
    if isinstance(res, Incompatible):
        return refusal_of(res)
    if res.source == "nvidia" and (problem := unsupported_arch(facts.machine)):
        return Refusal(AREA, *problem)
    problem = preconditions(settings, facts.before, facts.kernel.prebuilt, facts.signing_key_present,
                            facts.certificate_present, facts.headers_offered)
    return Refusal(AREA, *problem) if problem else None


def plan_driver(settings: Settings, facts: DriverFacts) -> DriverPlan | Refusal:
    """The driver plan of one host, or why it is refused (nothing changes on it)."""
    refused = first_refusal(settings, facts)
    if refused is not None:
        return refused
    res = facts.resolved
    assert isinstance(res, Resolution)  # first_refusal refuses the rest
    try:
        profiling = plan_profiling(settings.tuning_profiling, facts.profiling, res.cuda_release,
                                   res.source == "nvidia" and bool(res.cuda_package))
    except Refused as bad:
        return Refusal(AREA, bad.key, bad.problem, f"set {bad.key} to what this host allows: {bad.allowed}")
    moves = _moves(settings, res, facts)
    change = _change(settings, res, facts, profiling, moves)
    return DriverPlan(
        res=res, before=facts.before, kernel=facts.kernel, profiling=profiling,
        nvidia=_nvidia_source(settings, res, facts.machine),
        archive_components=() if res.source == "nvidia" else tuple(compat_data().distro_offers[res.os_release].components),
        signing_key=None if settings.driver_module_signing_key == "none" else settings.driver_module_signing_key,
        headers=(f"linux-headers-{facts.before.kernel_release}" if settings.driver_kernel_headers == "require"
                 and not facts.kernel.prebuilt and not facts.before.kernel_headers else None),
        headers_meta=(facts.kernel.headers_metapackage if settings.driver_kernel_headers == "require"
                      and not facts.kernel.prebuilt else None),
        change=change,
        stack_record={p: v for what, group in stack_groups(res).items() if what not in moves.left
                      for p, v in group.items()},
        stack_record_packages=tuple(stack_fact_packages(res.stack_versions)),
        held=_held(res, facts, change, moves.left, profiling),
        hold_headers_meta=_hold_headers_meta(settings, facts),
        cuda_home=(compat_data().nvidia_repo["cuda_home"].format(cuda_version=res.cuda_version)
                   if res.cuda_version and res.source == "nvidia" else None),
        pending=None if moves.in_place else moves.pending,
        stack_pending={} if moves.in_place else moves.stack,
        drifted={} if moves.in_place else {w: tuple(m) for w, m in moves.drifted.items()},
        notes=moves.notes,
    )


@dataclass(frozen=True)
class _Moves:
    """The driver, CUDA toolkit and cuDNN moves the inventory asks for, and which all.py makes."""
    pending: tuple[str, str] | None
    stack: dict[str, tuple[str, str]]
    drifted: dict[str, list[str]]
    in_place: bool
    left: frozenset[str]     # "CUDA toolkit" / "cuDNN": kept as they are (pending or changed by hand)
    notes: tuple[str, ...]
    in_place_moves: tuple[str, ...] = ()


def _moves(settings: Settings, res: Resolution, facts: DriverFacts) -> _Moves:
    installed = facts.before.userspace_version
    pending = (installed, res.driver_version) if installed and installed != res.driver_version else None
    found = facts.stack
    moves = stack_pending(res, found.installed, found.recorded)
    drifted = stack_drift(res, found.installed, found.recorded)
    if moved := component_drift(found.components, res.stack_versions, found.installed):
        drifted.setdefault("CUDA toolkit", []).extend(moved)
    in_place = bool(pending or moves or drifted) and settings.driver_upgrade_in_place
    notes: list[str] = []
    if not in_place:
        # The same rule as the driver: installed libraries change only by a sanctioned upgrade.
        notes += [stack_pending_message(what, *move) for what, move in moves.items()]
        notes += [f"{m}; left as it is (tools/rollout puts it back)" for ms in drifted.values() for m in ms]
        if pending:
            # A provisioned host: its driver changes only through tools/rollout (issue 14). The
            # rest of the deploy still converges around the driver that is installed.
            notes.append(f"{pending_message(*pending)} (deploys/all.py changes no driver of a provisioned host)")
    left = frozenset() if in_place else frozenset(moves) | frozenset(drifted)
    made = (([f"driver {pending[0]} -> {pending[1]}"] if pending else [])
            + [f"{what} {old} -> {new}" for what, (old, new) in moves.items()]
            + [f"{what} back to the resolved release (changed by hand)" for what in drifted]) if in_place else []
    if made:
        notes.append(f"moved in place: {', '.join(made)} (driver_upgrade_in_place; the GPUs checked idle right "
                     "before, in the same command)")
    return _Moves(pending, moves, drifted, in_place, left, tuple(notes), tuple(made))


def _nvidia_source(settings: Settings, res: Resolution, machine: str) -> NvidiaSource | None:
    if res.source != "nvidia":
        return None
    repo = compat_data().nvidia_repo
    assert res.repo_os_dir is not None, "the resolver gives every plan from NVIDIA's repository its folder"
    repo_url = apt_url(settings, settings.driver_repo_url)   # through the fleet's package cache, if any
    base = cuda_repo_base(repo_url, res.repo_os_dir, machine)
    return NvidiaSource(
        base=base,
        keyring_url=(f"{base}/{repo['keyring_package_file']}" if settings.driver_repo_keyring_url == "auto"
                     else apt_url(settings, settings.driver_repo_keyring_url)),
        fingerprint=(repo["key_fingerprint"] if settings.driver_repo_key_fingerprint == "auto"
                     else settings.driver_repo_key_fingerprint),
        keyring=repo["keyring_path"],
        line=cuda_sources_line(repo_url, res.repo_os_dir, repo["keyring_path"], machine))


def _nsight(profiling: ProfilingPlan, left: frozenset[str]) -> dict[str, str]:
    """Nsight Systems / Compute at the CUDA toolkit release's versions, with the toolkit (not
    while the toolkit itself is left pending or changed by hand)."""
    return {} if "CUDA toolkit" in left else dict(profiling.nsight)


def _change(settings: Settings, res: Resolution, facts: DriverFacts, profiling: ProfilingPlan,
            moves: _Moves) -> PackageChange:
    """The one sanctioned change: unhold, change, re-hold as one step."""
    stack, left = res.stack_versions, moves.left
    present = tuple(p for p in (res.cuda_package, res.cudnn_package, *res.dcgm_packages,
                                *res.fabric_extra_packages, *facts.kernel.modules) if p and p not in stack)
    versions = dict(res.package_versions)
    pinning = res.pinning_package
    old_pins = tuple(p for p in facts.held if p.startswith("nvidia-driver-pinning-") and p != res.pinning_package)
    kept = moves.pending and not moves.in_place
    if kept:
        # driver, Fabric Manager and the version lock stay as they are; CUDA and cuDNN converge
        versions, old_pins, pinning = {}, (), facts.installed_pinning
    # CUDA toolkit and cuDNN at their exact releases; one that is pending or drifted stays as it is (held)
    for what, group in stack_groups(res).items():
        if what not in left:
            versions.update(group)
    nsight = _nsight(profiling, left)
    versions.update(nsight)
    return PackageChange(
        what=_change_what(res, moves, nsight, bool(kept)), releases=versions, present=present, pinning=pinning,
        old_pins=old_pins, in_place=moves.in_place_moves,
        keys={**{p: "cuda_version" if what == "CUDA toolkit" else "cudnn_version"
                 for what, group in stack_groups(res).items() for p in group},
              **{p: PROFILING_KEY for p in nsight}})


def _change_what(res: Resolution, moves: _Moves, nsight: dict[str, str], kept: bool) -> str:
    """What the change moves, for its short operation name: the most detailed form that fits
    NAME_LIMIT (the exact releases are the change's explanation; the moves it leaves are the
    plan's notes). "if idle" is never dropped: it says the GPUs are checked right before."""
    # in place: the GPUs checked idle right before, in the same command
    suffix = " (in place, if idle)" if moves.in_place else ""
    budget = NAME_LIMIT - len("Install ") - len(suffix)
    if kept and moves.pending:
        forms = [f"CUDA/cuDNN around driver {moves.pending[0]}", "CUDA/cuDNN"]
    else:
        driver = f"driver {res.driver_version}"
        fm = " + Fabric Manager" if res.fabricmanager_needed else ""
        cuda = bool(res.cuda_version) and "CUDA toolkit" not in moves.left
        cudnn = bool(res.cudnn_version) and "cuDNN" not in moves.left
        # the tier's cuDNN release (9.17.0), not its package build (9.17.0.29)
        versioned = ([f"CUDA {res.cuda_release or res.cuda_version}"] if cuda else []) \
            + ([f"cuDNN {res.cudnn_version}"] if cudnn else []) + (["Nsight"] if nsight else [])
        bare = (["CUDA"] if cuda else []) + (["cuDNN"] if cudnn else []) + (["Nsight"] if nsight else [])
        forms = [", ".join([f"{driver} ({res.flavour}){fm}", *versioned]),
                 ", ".join([f"{driver}{fm}", *versioned]),
                 ", ".join([f"{driver}{' + FM' if fm else ''}", *versioned]),
                 ", ".join([f"{driver}{' + FM' if fm else ''}", *bare]),
                 f"the {driver} stack"]
    return next((f for f in forms if len(f) <= budget), forms[-1]) + suffix


def _held(res: Resolution, facts: DriverFacts, change: PackageChange, left: frozenset[str],
          profiling: ProfilingPlan) -> tuple[str, ...]:
    """What is held afterwards: driver, CUDA, cuDNN, container toolkit, the running kernel, and
    the metapackages that move with them."""
    stack = res.stack_versions
    # a renamed CUDA toolkit / cuDNN left pending: its new package is not installed, nor held
    renamed = stack_renames(stack, facts.stack.installed)
    stack_held = [p for what, group in stack_groups(res).items()
                  if not (what in left and what in renamed) for p in group]
    # the toolkit's components are held with it (the install unit holds them; this puts back a
    # hold someone released)
    components = sorted(facts.stack.components) if res.cuda_package in stack_held else []
    return (*res.package_versions, *change.present, *stack_held, *components,
            *([change.pinning] if change.pinning else []), *facts.installed_extra, *_nsight(profiling, left))


def _hold_headers_meta(settings: Settings, facts: DriverFacts) -> str | None:
    """A held headers metapackage goes with a held image one: a moving image metapackage with a
    held headers one would bring kernels without headers again."""
    kernel = facts.kernel
    if settings.driver_kernel_headers == "require" and kernel.headers_metapackage and not kernel.prebuilt \
            and kernel.image_metapackage in facts.held:
        return kernel.headers_metapackage
    return None


# --- the CUDA toolkit / cuDNN moves (also read by the gate and the tests) -----------------------


def stack_groups(res: Resolution) -> dict[str, dict[str, str]]:
    """The CUDA toolkit and cuDNN packages with their exact versions, per what moves as one."""
    versions = res.stack_versions
    groups = {"CUDA toolkit": {p: v for p, v in versions.items() if p == res.cuda_package},
              "cuDNN": {p: v for p, v in versions.items() if p in res.cudnn_packages}}
    return {what: group for what, group in groups.items() if group}


def stack_pending(res: Resolution, installed: dict[str, str | None], recorded: dict[str, str] | None = None
                  ) -> dict[str, tuple[str, str]]:
    """{"cuDNN": (installed, resolved)} for each of the CUDA toolkit and cuDNN that is installed at
    the release gpufleet installed (its record; or no record) while the inventory resolves to
    another: like the driver, changed only by tools/rollout (a re-run of all.py must not swap the
    libraries under running jobs). A package name that changes with the release (CUDA 13.0 ->
    13.1, cuDNN for CUDA 12 -> 13) is pending too: ("old-package release", "new-package release")."""
    out = {}
    for what, group in stack_groups(res).items():
        for package, (state, have, _) in stack_states(group, installed, recorded or {}).items():
            if state == "pending":
                out[what] = (have, group[package])
                break
    out.update((what, (old, new)) for what, (_, old, new) in stack_renames(res.stack_versions, installed).items())
    return out


def stack_drift(res: Resolution, installed: dict[str, str | None], recorded: dict[str, str]
                ) -> dict[str, list[str]]:
    """{"cuDNN": [message, ...]} for packages installed at another release than the one gpufleet's
    record says it installed: changed by hand, left as found (the validation gate FAILs them)."""
    out: dict[str, list[str]] = {}
    for what, group in stack_groups(res).items():
        for package, (state, have, mine) in stack_states(group, installed, recorded).items():
            if state == "drift":
                out.setdefault(what, []).append(stack_drift_message(package, have or '?', mine or '?', group[package]))
    return out



# --- decided while the run executes: the reboot, from the GPU work found then -------------------


def reboot_hold_back(settings: Settings, busy: list[str]) -> str | None:
    """Why the driver reboot is not made (the words the run's end prints), or None: reboot.
    `busy`: the GPU processes found before the reboot (read only when one may happen)."""
    running = f"{len(busy)} GPU process(es) running ({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})"
    if settings.driver_reboot == "never":
        return "driver_reboot: never"
    if busy and settings.driver_reboot == "if-idle":
        return f"driver_reboot: if-idle, {running}"
    if busy and not settings.driver_reboot_force:
        return f"driver_reboot: allowed, {running}, driver_reboot_force: false"
    return None  # idle, or allowed + forced


def reboot_forced(settings: Settings) -> bool:
    """A reboot made with GPU work running: no idle check in the command that reboots."""
    return settings.driver_reboot == "allowed" and settings.driver_reboot_force
