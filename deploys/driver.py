"""NVIDIA driver, CUDA toolkit and cuDNN: exactly what the resolver chose, held, reboot-aware.

Story of a host, part 3: the host's tier and its real GPUs (from PCI) resolve to one driver
version, kernel-module flavour, CUDA toolkit, cuDNN and, on NVSwitch systems, Fabric Manager at
the driver's exact version (gpufleet/config/resolver.py, data in gpufleet/data/compat.yaml: no version
lives here). Then, in order:

1. **Refuse early**, before anything on the host changes: a combination the resolver refuses,
   Secure Boot on without a module signing key, no kernel headers for the running kernel
   (`driver_kernel_headers: require`; installed when the sources offer them).
2. **Package sources**: `driver_source: nvidia` -> NVIDIA's signing key (downloaded from
   `driver_repo_keyring_url`, trusted only if its fingerprint is the pinned one) and a flat
   `signed-by` source under `driver_repo_url` (a mirror for air-gapped fleets);
   `distro` -> the Debian archive's contrib / non-free / non-free-firmware components.
3. **nouveau** blacklisted; the initramfs is refreshed only when that file changed.
4. **One sanctioned step** changes the stack: unhold, NVIDIA's version-locking package, exact
   versions decided on the controller from the package index (driver and Fabric Manager move
   together in one apt transaction), re-hold: the same change as tools/rollout makes.
   Held afterwards: driver, Fabric Manager, CUDA, cuDNN, DCGM, the container toolkit and the
   running kernel's packages (with Ubuntu's prebuilt modules also the modules' and the kernels'
   flavour metapackages: kernels move with their modules, through tools/rollout);
   unattended-upgrades blacklists the GPU packages (the same file and list as deploys/hardening.py).
5. **Reboot** when the loaded kernel module differs from the installed driver (driver/library
   mismatch), by `driver_reboot`: never -> reported at the end of the run; if-idle -> only
   without GPU processes (nvidia-smi's, and any process holding a /dev/nvidiaN open: as found
   before the run, and again in the very command that reboots: a job started meanwhile makes the
   host "busy, pending", not rebooted); allowed -> reboot and wait, but with GPU processes only
   when `driver_reboot_force` is true. A host not rebooted is reported at the end of the run.
6. **CUDA environment**: /etc/profile.d/gpufleet-cuda.sh puts the toolkit on PATH and the
   library path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from io import StringIO
from typing import Any

from pyinfra import host, logger
from pyinfra.api import Host, State, deploy
from pyinfra.facts.server import Arch
from pyinfra.operations import apt, files, python, systemd
from pyinfra.operations.util import any_changed

from gpufleet.apt_policy import APT_CACHE_SECONDS, GPU_PACKAGE_BLACKLIST, UNATTENDED_CONF
from gpufleet.plans.driver_preconditions import dkms_signing_conf, preconditions
from gpufleet.operations.drain import gpu_work
from gpufleet.rendering import render
from gpufleet.controller.run_summary import SUMMARY
from gpufleet.facts.kernel import DriverState, DriverStateData
from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages
from gpufleet.catalog.compat import compat_data
from gpufleet.errors import Incompatible
from gpufleet.config.failures import fail_now, real_host, refuse
from gpufleet.config.hostfacts import driver_state, kernel_plan, os_name, resolution
from gpufleet.catalog.kernels import kernel_metapackages
from gpufleet.plans.repos import CUDA_SOURCE, apt_url, cuda_repo_base, cuda_sources_line, unsupported_arch
from gpufleet.config.resolver import Resolution
from gpufleet.config.settings import Settings, host_settings
from gpufleet.catalog.cuda_stack import (component_drift, pending_message, stack_drift_message, stack_fact_packages,
                                 stack_pending_message, stack_renames, stack_states)
from gpufleet.operations.driver import archive_components, refresh_initramfs, repo_key, stack_recorded
from gpufleet.operations.package_steps import packages_at_releases
from gpufleet.operations.driver_upgrade import package_change_settled
from gpufleet.operations.holds import held
from gpufleet.operations.reboot import rebooted
from gpufleet.plans.profiling import KEY, MODPROBE_FILE, ProfilingRefusal, host_profiling, plan_profiling

NOUVEAU_BLACKLIST = "/etc/modprobe.d/gpufleet-blacklist-nouveau.conf"
CUDA_PROFILE = "/etc/profile.d/gpufleet-cuda.sh"
DKMS_SIGNING_CONF = "/etc/dkms/framework.conf.d/gpufleet-module-signing.conf"
# Held with the stack when they are installed (the docker deploy installs the container toolkit).
CONTAINER_TOOLKIT = ("nvidia-container-toolkit", "nvidia-container-toolkit-base",
                     "libnvidia-container1", "libnvidia-container-tools")
REBOOT_TIMEOUT = 600



def pending_upgrade(settings: Settings, res: Resolution, before: DriverStateData) -> tuple[str, str] | None:
    """(installed, resolved) when the host runs another NVIDIA driver than its inventory resolves
    to: a fleet-wide change all.py leaves to tools/rollout (canary, batches, drain, snapshot)."""
    installed = before.userspace_version
    if installed and installed != res.driver_version:
        return installed, res.driver_version
    return None


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




def _mismatch(h: Host) -> str | None:
    """Why the host needs a reboot *now* (read at execution time), or None."""
    state = h.get_fact(DriverState)
    if state.mismatch:
        return (f"loaded NVIDIA module {state.module_version} ({state.module_flavour}) differs from the installed "
                f"driver {state.userspace_version} (driver/library mismatch)")
    return None


def _report(h: Host, policy: str) -> None:
    why = _mismatch(h)
    if why:
        SUMMARY.needs_reboot[h.name] = f"{why}; not rebooted ({policy})"
        logger.warning(f"{h.print_prefix}NEEDS A REBOOT: {why}; not rebooted ({policy})")


def _busy_now(policy: str) -> Callable[[Host, str], bool]:
    """rebooted()'s if_busy: GPU work found in the command that would reboot (it started after
    this run's planning): not rebooted, reported with the hosts that need a reboot; not a failure."""
    def busy(h: Host, running: str) -> bool:
        why = _mismatch(h) or "the loaded NVIDIA module differs from the installed driver"
        SUMMARY.busy_at_reboot.add(h.name)
        SUMMARY.needs_reboot[h.name] = f"{why}; BUSY, PENDING: not rebooted (driver_reboot: {policy}, GPU work started after planning: {running})"
        logger.warning(f"{h.print_prefix}BUSY, PENDING: not rebooted: GPU work started after planning: {running}")
        return True
    return busy


def _verify_after_reboot(state: State, host: Host, h: Host) -> bool:
    """Executing (python.call): fail the host when the reboot did not load the installed driver."""
    why = _mismatch(h)
    if why:
        return fail_now(state, h, "driver", f"still after the reboot: {why}",
                               "look at the boot's kernel log (dmesg | grep -i nvidia): the module may not have "
                               "built (DKMS) or loaded (Secure Boot); fix that and re-run")
    return True


@deploy("NVIDIA driver, CUDA and cuDNN")
def driver() -> None:
    settings = host_settings(host)
    me = real_host(host)  # the concrete host, for callbacks that run at execution time
    d = _decide(settings)
    if d is None:
        return
    # as the rollout: a package change an earlier (dead) session started finishes, and what an
    # interrupted one left half done is repaired (dpkg --configure -a), before apt is asked anything
    package_change_settled(name="Let an earlier package change finish; repair an interrupted dpkg")
    refresh = apt.update(name="Refresh the apt package index if it is older than a day", cache_time=APT_CACHE_SECONDS)

    settled = _sources(settings, d.res, [refresh])               # 1. package sources
    _preconditions(settings, d)                                 # 2. what the driver needs first
    install, present, pinning, held_now = _install(settings, d, settled)  # 3. the one sanctioned change,
    if install is None:
        return                                                  #    (refused: not offered)
    _holds(settings, d, present, pinning, held_now)             #    then holds
    _cuda_environment(d.res)                                    # 4. CUDA environment
    _reboot(settings, d, install, me)                           # 5. reboot
    _profiling_pending(settings, d, install, me)                #    profiling option still to load
    if d.res.fabricmanager_needed:
        _fabric_manager(me)


@dataclass(frozen=True)
class Decided:
    """What _decide found: the resolution, the driver state and kernel before the run, and the
    moves all.py makes or leaves (to tools/rollout)."""
    res: Any
    before: Any
    kernel: Any
    pending: tuple[str, str] | None
    stack: dict[str, str]
    found: Any
    stack_moves: dict[str, tuple[str, str]]
    drifted: dict[str, list[str]]
    in_place: bool
    left: set[str]
    profiling: Any = None  # gpufleet/plans/profiling.py's plan (tuning_profiling)


def _decide(settings: Settings) -> Decided | None:
    """What this run does with the host, from facts read before it: None when refused (named,
    nothing changed). The driver, CUDA toolkit and cuDNN moves all.py leaves to tools/rollout
    are recorded for the end of the run (gpufleet/controller/run_summary.py)."""
    try:
        res = resolution(host, settings)
    except Incompatible as refused:
        if refused.allowed:
            fix = f"set {refused.key or 'the driver settings'} to what this host allows: {refused.allowed}"
        elif refused.key:
            fix = f"change {refused.key} (tools/compat shows what fits this host's GPUs)"
        else:
            fix = "leave this host out of the driver deploy, or give it a GPU gpufleet supports (tools/compat)"
        refuse(host, refused.key or "driver", refused.reason, fix)
        return None
    if res.source == "nvidia" and (problem := unsupported_arch(_machine())):
        refuse(host, *problem)
        return None
    before = driver_state(host)
    kernel = kernel_plan(host, res)
    problem = preconditions(settings, res, before, host, prebuilt=kernel.prebuilt)
    if problem:
        refuse(host, *problem)
        return None

    pending = pending_upgrade(settings, res, before)
    stack = res.stack_versions
    # installed releases and gpufleet's record of the ones it installed, in one remote command
    found = host.get_fact(StackPackages, packages=stack_fact_packages(stack)) if stack else StackPackages.default()
    stack_moves = stack_pending(res, found.installed, found.recorded)
    drifted = stack_drift(res, found.installed, found.recorded)
    moved_components = component_drift(found.components, stack, found.installed)
    if moved_components:
        drifted.setdefault("CUDA toolkit", []).extend(moved_components)
    in_place = bool(pending or stack_moves or drifted) and settings.driver_upgrade_in_place
    if stack_moves and not in_place:
        # The same rule as the driver: installed libraries change only by a sanctioned upgrade.
        SUMMARY.stack_pending[host.name] = stack_moves
        for what, move in stack_moves.items():
            logger.warning(f"{host.print_prefix}{stack_pending_message(what, *move)}")
    if drifted and not in_place:
        SUMMARY.stack_by_hand[host.name] = drifted
        for messages in drifted.values():
            for message in messages:
                logger.warning(f"{host.print_prefix}{message}; left as it is (tools/rollout puts it back)")
    left = set() if in_place else set(stack_moves) | set(drifted)   # CUDA toolkit / cuDNN all.py keeps
    if pending and not in_place:
        # A provisioned host: its driver changes only through tools/rollout (issue 14). The rest
        # of this deploy still converges around the driver that is installed.
        SUMMARY.driver_pending[host.name] = pending
        logger.warning(f"{host.print_prefix}{pending_message(*pending)} "
                       "(deploys/all.py changes no driver of a provisioned host)")

    try:
        profiling = host_profiling(host, settings, res)
    except ProfilingRefusal as refused:
        refuse(host, refused.key, refused.problem, f"set {refused.key} to what this host allows: {refused.allowed}")
        return None
    return Decided(res=res, before=before, kernel=kernel, pending=pending, stack=stack, found=found,
                   stack_moves=stack_moves, drifted=drifted, in_place=in_place, left=left, profiling=profiling)


def _machine() -> str:
    """The host's architecture (`uname -m`): which directory of NVIDIA's CUDA repository it uses."""
    return str(host.get_fact(Arch) or "x86_64")


def _sources(settings: Settings, res: Any, index_ops: list[Any]) -> bool:
    """NVIDIA's CUDA repository (key checked by fingerprint), or the distribution's components;
    whether they are settled: neither these sources nor `index_ops` change the package index the
    versions are read from before the install."""
    data = compat_data()
    repo = data.nvidia_repo
    if res.source == "nvidia":
        apt.packages(name="Install gpg to check the repository key", packages=["gpg"], no_recommends=True)
        os_dir = res.repo_os_dir
        assert os_dir is not None, "the resolver gives every plan from NVIDIA's repository its folder"
        repo_url = apt_url(settings, settings.driver_repo_url)
        base = cuda_repo_base(repo_url, os_dir, _machine())
        keyring_url = (f"{base}/{repo['keyring_package_file']}" if settings.driver_repo_keyring_url == "auto"
                       else apt_url(settings, settings.driver_repo_keyring_url))
        fingerprint = (repo["key_fingerprint"] if settings.driver_repo_key_fingerprint == "auto"
                       else settings.driver_repo_key_fingerprint)
        key = repo_key(
            name=f"Trust the CUDA repository key {fingerprint[-16:]} (fingerprint checked) for that source only",
            url=keyring_url, fingerprint=fingerprint, keyring=repo["keyring_path"],
        )
        source = files.put(
            name=f"Add NVIDIA's CUDA repository {base}/ as a signed-by source",
            src=StringIO("# Managed by gpufleet (deploys/driver.py). Do not edit: changes are reverted.\n"
                         + cuda_sources_line(repo_url, os_dir, repo["keyring_path"], _machine())),
            dest=CUDA_SOURCE, mode="644",
        )
        apt.update(name="Read the package index of the changed sources", _if=any_changed(key, source))
        index_ops += [key, source]
    else:
        offer = data.distro_offers[res.os_release]
        if offer.components:
            archive = "Ubuntu" if res.os_release.startswith("ubuntu") else "Debian"
            enabled = archive_components(
                name=f"Enable {', '.join(offer.components)} on the {archive} archive sources",
                components=list(offer.components),
            )
            apt.update(name="Read the package index of the changed sources", _if=enabled.did_change)
            index_ops.append(enabled)
    return not any(op.will_change for op in index_ops)


def _preconditions(settings: Settings, d: Decided) -> None:
    """What the driver needs before it installs: nouveau out, DKMS signing, kernel headers."""
    before, kernel = d.before, d.kernel
    blacklist = files.put(
        name="Blacklist nouveau so that the NVIDIA module can claim the GPUs",
        src=StringIO("# Managed by gpufleet (deploys/driver.py). Do not edit: changes are reverted.\n"
                     "blacklist nouveau\noptions nouveau modeset=0\n"),
        dest=NOUVEAU_BLACKLIST, mode="644",
    )
    option = _profiling_option(settings, d)
    refresh_initramfs(name="Refresh the initramfs so that nouveau stays out at boot and the nvidia module gets "
                           "its options there too", _if=any_changed(blacklist, *option))
    if settings.driver_module_signing_key != "none":
        signing_key = settings.driver_module_signing_key
        files.put(
            name="Let DKMS sign the modules it builds with the enrolled MOK (Secure Boot)",
            src=StringIO(dkms_signing_conf(signing_key)),
            dest=DKMS_SIGNING_CONF, mode="644",
        )
    if kernel.prebuilt:
        host.noop(f"kernel {before.kernel_release}: the distribution's prebuilt, signed NVIDIA modules "
                  f"({kernel.modules[0]}): no DKMS build, no kernel headers needed")
    elif settings.driver_kernel_headers == "require" and not before.kernel_headers:
        apt.packages(name=f"Install the headers of the running kernel {before.kernel_release} for DKMS",
                     packages=[f"linux-headers-{before.kernel_release}"], no_recommends=True)
    # Kernels arriving later (unattended upgrades, through linux-image-<flavour>) bring their
    # headers, so that DKMS builds the module for them, only with linux-headers-<flavour>
    # (Ubuntu's HWE kernels: linux-headers-generic-hwe-22.04, gpufleet/catalog/kernels.py).
    headers_meta = kernel.headers_metapackage
    if settings.driver_kernel_headers == "require" and not kernel.prebuilt:
        if headers_meta:
            apt.packages(name=f"Install {headers_meta} so that kernels installed later come with their headers",
                         packages=[headers_meta], no_recommends=True)
        else:
            host.noop(f"kernel {before.kernel_release}: no Debian/Ubuntu flavour, so no headers metapackage to follow it")


def _install(settings: Settings, d: Decided, settled: bool) -> tuple[Any, list[str], str | None, list[str]]:
    """The one sanctioned change (unhold, change, re-hold as one step): (the operation, None when
    the sources do not offer a release; the packages present beside the stack, the pinning
    package, what is held now)."""
    res, stack, pending, in_place, left, stack_moves, kernel = d.res, d.stack, d.pending, d.in_place, d.left, d.stack_moves, d.kernel
    drifted = d.drifted
    present = [p for p in (res.cuda_package, res.cudnn_package, *res.dcgm_packages, *res.fabric_extra_packages,
                           *kernel.modules)
               if p and p not in stack]
    versions = dict(res.package_versions)
    held_now = host.get_fact(HeldPackages)
    pinning = res.pinning_package
    old_pins = [p for p in held_now if p.startswith("nvidia-driver-pinning-") and p != res.pinning_package]
    if pending and not in_place:
        # driver, Fabric Manager and the version lock stay as they are; CUDA and cuDNN converge
        versions, old_pins = {}, []
        pinning = next((p for p, v in host.get_fact(PackageVersions, packages=[f"nvidia-driver-pinning-{pending[0]}"]).items()
                        if v), None)
    # CUDA toolkit and cuDNN at their exact releases; one that is pending or drifted stays as it is (held)
    for what, group in stack_groups(res).items():
        if what not in left:
            versions.update(group)
    nsight = _nsight(d)
    versions.update(nsight)
    if in_place:
        # driver_upgrade_in_place (dev boxes): the gate's rules still hold, for this one host:
        # the manifest (and the disk snapshot rollout_snapshot names) first, idle right before.
        from gpufleet.operations.manifest_steps import snapshot_and_manifest
        from gpufleet.rollout.context import RolloutContext

        moves = ([f"driver {pending[0]} -> {pending[1]}"] if pending else []) + [
            f"{what} {old} -> {new}" for what, (old, new) in stack_moves.items()] + [
            f"{what} back to the resolved release (changed by hand)"
            for what in drifted]
        snapshot_and_manifest(RolloutContext(target=res.driver_version))
        # GPU work is checked in the command that starts the change (packages_at_versions'
        # require_idle: a job started after planning is seen): busy -> nothing changes, the host fails
    install = packages_at_releases(
        name=(f"Install CUDA and cuDNN around the installed driver {pending[0]} ({pending_message(*pending)})"
              if pending and not in_place else
              f"Install driver {res.driver_version} ({res.flavour})"
              + (f" with Fabric Manager {res.fabricmanager_version}" if res.fabricmanager_needed else ""))
             + "".join(f", {what} {old} kept (pending {new})" if what in left else ""
                       for what, (old, new) in stack_moves.items())
             + "".join(f", {what} kept as changed by hand" for what in drifted if what in left)
             + (f", CUDA {res.cuda_release or res.cuda_version}"
                if res.cuda_version and "CUDA toolkit" not in left else "")
             + (f", cuDNN {res.cudnn_release or res.cudnn_version}"
                if res.cudnn_version and "cuDNN" not in left else "")
             + (f", Nsight {', '.join(f'{p} {v}' for p, v in nsight.items())}" if nsight else "")
             + ": unhold, change and re-hold as one step"
             + (f" (in place: {', '.join(moves)}; the GPUs checked idle right before, in the same command)"
                if in_place else ""),
        releases=versions, present=present, pinning=pinning,
        hold=settings.driver_hold, old_pins=old_pins, require_idle=in_place, settled=settled,
        keys={**{p: "cuda_version" if what == "CUDA toolkit" else "cudnn_version"
                 for what, group in stack_groups(res).items() for p in group},
              **{p: KEY for p in nsight}},
    )
    return install, present, pinning, held_now


def _holds(settings: Settings, d: Decided, present: list[str], pinning: str | None, held_now: list[str]) -> None:
    """The record of the stack gpufleet installed, and the holds: driver, CUDA, cuDNN, toolkit,
    the running kernel, and the metapackages that move with them."""
    res, stack, before, kernel, found, left = d.res, d.stack, d.before, d.kernel, d.found, d.left
    if stack:
        stack_recorded(name="Record the CUDA toolkit and cuDNN releases gpufleet installed "
                            "(tells an inventory change from a hand change)",
                       versions={p: v for what, group in stack_groups(res).items() if what not in left
                                 for p, v in group.items()},
                       packages=stack_fact_packages(stack))
    release = before.kernel_release or ""
    # Prebuilt modules exist only for the kernels Canonical built them for: a kernel that
    # unattended-upgrades installs alone (it blacklists the module packages, not the kernels)
    # boots without an nvidia module. The kernel flavour metapackages that are installed
    # (linux-generic, linux-image-generic, linux-headers-generic, or the -hwe-NN.04 ones) are held
    # with the driver and the modules' flavour metapackage: kernels and their modules move
    # together, and only through tools/rollout.
    kernel_metas = kernel_metapackages(release, os_name(host)) if kernel.prebuilt else []
    extra = [*CONTAINER_TOOLKIT, *((f"linux-image-{release}", f"linux-headers-{release}") if release else ()),
             *kernel_metas]
    installed_extra = [p for p, v in host.get_fact(PackageVersions, packages=extra).items() if v]
    # a renamed CUDA toolkit / cuDNN left pending: its new package is not installed, nor held
    stack_held = [p for what, group in stack_groups(res).items()
                  if not (what in left and what in stack_renames(stack, found.installed)) for p in group]
    # the toolkit's components are held with it (the install unit holds them; this puts back a
    # hold someone released)
    components = sorted(found.components) if res.cuda_package in stack_held else []
    managed = [*res.package_versions, *present, *stack_held, *components, *([pinning] if pinning else []),
               *installed_extra, *_nsight(d)]
    held(
        name=("Hold" if settings.driver_hold else "Release") + " the driver, CUDA, cuDNN, container toolkit "
             "and running kernel packages"
             + (", with the prebuilt modules' and kernels' flavour metapackages (kernels move only through "
                "tools/rollout)" if kernel.prebuilt else ""),
        packages=managed, present=settings.driver_hold,
    )
    headers_meta, image_meta = kernel.headers_metapackage, kernel.image_metapackage
    if settings.driver_kernel_headers == "require" and headers_meta and image_meta in held_now and not kernel.prebuilt:
        # Held alongside: a held headers metapackage with a moving image one would bring kernels
        # without headers again.
        held(name=f"Hold {headers_meta} as {image_meta} is held: new kernels and their headers move together",
             packages=[headers_meta])
    if settings.hardening_unattended_upgrades:
        # The same file, template and list as deploys/hardening.py: whichever runs first writes it.
        files.put(
            name="Keep unattended-upgrades away from NVIDIA, CUDA and cuDNN packages",
            src=StringIO(render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                                          blacklist=list(GPU_PACKAGE_BLACKLIST))),
            dest=UNATTENDED_CONF, mode="644",
        )


def _cuda_environment(res: Any) -> None:
    """CUDA on PATH and the library path of login shells, or no such profile."""
    repo = compat_data().nvidia_repo
    if res.cuda_version and res.source == "nvidia":
        cuda_home = repo["cuda_home"].format(cuda_version=res.cuda_version)
        files.put(
            name=f"Put CUDA {res.cuda_version} on PATH and the library path of login shells",
            src=StringIO(render("etc/profile.d/gpufleet-cuda.sh.j2", cuda_version=res.cuda_version,
                                package=res.cuda_package, cuda_home=cuda_home)),
            dest=CUDA_PROFILE, mode="644",
        )
    else:
        files.file(name="No host CUDA toolkit from gpufleet: no CUDA profile", path=CUDA_PROFILE, present=False)


def _reboot(settings: Settings, d: Decided, install: Any, me: Any) -> None:
    """Reboot to load the installed driver where the tier allows it and the GPUs are idle right
    before; else say the host needs one."""
    before = d.before
    # Only a run that changes the driver, or finds a mismatch already pending, can reboot: only
    # then is the GPU work on the host worth reading (it scans every process's open files).
    reboot_possible = install.will_change or before.mismatch
    busy = gpu_work(host) if reboot_possible else []
    running = f"{len(busy)} GPU process(es) running ({', '.join(busy[:3])}{', ...' if len(busy) > 3 else ''})"
    policy: str | None = settings.driver_reboot
    if policy == "never":
        policy = "driver_reboot: never"
    elif busy and policy == "if-idle":
        policy = f"driver_reboot: if-idle, {running}"
    elif busy and not settings.driver_reboot_force:
        policy = f"driver_reboot: allowed, {running}, driver_reboot_force: false"
    else:
        policy = None  # idle, or allowed + forced
    if policy is None:
        forced = settings.driver_reboot == "allowed" and settings.driver_reboot_force
        rebooted(
            name="Reboot to load the installed NVIDIA driver, if the loaded module differs from it"
                 + ("" if forced else " (GPUs checked idle in the same command)"),
            reason="gpufleet driver: load the installed NVIDIA kernel module", timeout=REBOOT_TIMEOUT,
            # idle at planning is not idle now: a job started since makes the host busy, pending
            require_idle=not forced, if_busy=_busy_now(settings.driver_reboot),
            _if=lambda: _mismatch(me) is not None,
        )
        python.call(
            name="Check that the loaded NVIDIA module is the installed driver after the reboot",
            function=_verify_after_reboot, h=me,
            _if=lambda: me.name not in SUMMARY.busy_at_reboot and _mismatch(me) is not None,
        )
    else:
        python.call(
            name="Report that the host needs a reboot, if the loaded NVIDIA module differs from the installed driver",
            function=_report, h=me, policy=policy,
            _if=lambda: _mismatch(me) is not None,
        )


def _profiling_option(settings: Settings, d: Decided) -> list[Any]:
    """tuning_profiling's modprobe.d file (gpufleet/plans/profiling.py), written with the nouveau
    blacklist: before the driver is installed, so that the module loaded after this run's
    reboot (a new host) already has it."""
    plan = d.profiling
    if plan.file_text is not None:
        return [files.put(name=f"Let every user read the GPU performance counters from the next load of the "
                               f"nvidia module ({KEY}: users)",
                          src=StringIO(plan.file_text), dest=MODPROBE_FILE, mode="644")]
    return [files.file(name=f"No gpufleet profiling option for the nvidia module ({KEY}: {settings.tuning_profiling})",
                       path=MODPROBE_FILE, present=False)]


def _nsight(d: Decided) -> dict[str, str]:
    """Nsight Systems / Compute at the CUDA toolkit release's versions, with the toolkit (not
    while the toolkit itself is left pending or changed by hand)."""
    return {} if "CUDA toolkit" in d.left else dict(d.profiling.nsight)


def _profiling_stale(h: Host, setting: str) -> bool:
    """Executing: whether the loaded nvidia module gives the counters otherwise than the next load
    will (read then: after this run's own reboot, if it made one)."""
    from gpufleet.facts.kernel import ProfilingState

    try:
        return plan_profiling(setting, h.get_fact(ProfilingState), None, False).pending
    except ProfilingRefusal:  # refused at planning already
        return False


def _profiling_report(state: State | None, host: Host, h: Host, setting: str) -> bool:
    """Executing (python.call): record a profiling setting the loaded module does not have yet."""
    SUMMARY.profiling_pending[h.name] = f"{KEY}: {setting}: the loaded nvidia module has the other setting"
    logger.warning(f"{h.print_prefix}PROFILING PENDING: {KEY}: {setting} takes effect at the next load of the nvidia "
                   "module: reboot it through tools/rollout (deploys/all.py does not reboot for it)")
    return True


def _profiling_pending(settings: Settings, d: Decided, install: Any, me: Any) -> None:
    """Said at the end of the run: a setting the loaded module does not have yet. No reboot of its
    own: tools/rollout's gate reboots for it. When this run may reboot (a driver change), asked
    again after that reboot; else decided now, from the facts before the run (no operation: a
    re-run while it waits changes nothing)."""
    setting = settings.tuning_profiling
    if install.will_change or d.before.mismatch:
        python.call(name=f"Report that the loaded nvidia module waits for a reboot to get {KEY}: {setting}, if it does",
                    function=_profiling_report, h=me, setting=setting, _if=lambda: _profiling_stale(me, setting))
    elif d.profiling.pending:
        _profiling_report(state=None, host=me, h=me, setting=setting)


def _fabric_manager(me: Any) -> None:
    """Fabric Manager refuses to start against a module of another version: at boot, and now
    only once the loaded module is the installed driver."""
    systemd.service(
        name="Start Fabric Manager at boot",
        service="nvidia-fabricmanager.service", running=None, enabled=True,
    )
    systemd.service(
        name="Run Fabric Manager now, if the loaded module is the installed driver",
        service="nvidia-fabricmanager.service", running=True,
        _if=lambda: _mismatch(me) is None,
    )


# `pyinfra INVENTORY deploys/driver.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
