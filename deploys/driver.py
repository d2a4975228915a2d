"""NVIDIA driver, CUDA toolkit and cuDNN: exactly what the resolver chose, held, reboot-aware.

Story of a host, part 3: the host's tier and its real GPUs (from PCI) resolve to one driver
version, kernel-module flavour, CUDA toolkit, cuDNN and, on NVSwitch systems, Fabric Manager at
the driver's exact version (gpufleet/config/resolver.py, data in gpufleet/data/compat.yaml: no version
lives here). Every decision below is the host's DriverPlan (gpufleet/plans/driver.py: facts
in, a frozen plan or a refusal out; the plan view prints the same plan); this file applies it.
Then, in order:

1. **Refuse early**, before anything on the host changes: a combination the resolver refuses,
   Secure Boot on without a module signing key, no kernel headers for the running kernel
   (`driver_kernel_headers: require`; installed when the sources offer them).
2. **Package sources**: `driver_source: nvidia` -> NVIDIA's signing key (downloaded from
   `driver_repo_keyring_url`, trusted only if its fingerprint is the pinned one) and a flat
   `signed-by` source under `driver_repo_url` (a mirror for air-gapped fleets);
   `distro` -> the Debian archive's contrib / non-free / non-free-firmware components.
   On a fresh host's first converge deploys/bootstrap.py has written them (and installed the
   stack, where no NVIDIA driver was present) earlier in the run: this area then finds both done.
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
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import Host, State, deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import apt, files, python, systemd
from pyinfra.operations.util import any_changed

from gpufleet.apt_policy import APT_CACHE_SECONDS, GPU_PACKAGE_BLACKLIST, UNATTENDED_CONF
from gpufleet.config.failures import Refusal, fail_now, real_host
from gpufleet.config.settings import Settings, host_settings
from gpufleet.controller.run_summary import outcome
from gpufleet.explain import explained
from gpufleet.facts.kernel import DriverState
from gpufleet.operations.drain import gpu_work
from gpufleet.operations.driver import refresh_initramfs, stack_recorded
from gpufleet.operations.driver_upgrade import package_change_settled
from gpufleet.operations.holds import held
from gpufleet.operations.source_steps import MANAGED, cuda_sources, written_early
from gpufleet.operations.package_steps import packages_at_releases
from gpufleet.operations.reboot import rebooted
from gpufleet.plans.driver import (DriverPlan, plan_driver, read_driver_facts, reboot_forced,
                                   reboot_hold_back)
from gpufleet.plans.driver_preconditions import dkms_signing_conf
from gpufleet.config.failures import Refused
from gpufleet.plans.profiling import KEY, MODPROBE_FILE, plan_profiling
from gpufleet.rendering import render

NOUVEAU_BLACKLIST = "/etc/modprobe.d/gpufleet-blacklist-nouveau.conf"
CUDA_PROFILE = "/etc/profile.d/gpufleet-cuda.sh"
DKMS_SIGNING_CONF = "/etc/dkms/framework.conf.d/gpufleet-module-signing.conf"
REBOOT_TIMEOUT = 600


@deploy("Driver stack")
def driver() -> None:
    settings = host_settings(host)
    plan = plan_driver(settings, read_driver_facts(host, settings))
    if isinstance(plan, Refusal):
        plan.stop(host)
        return
    me = real_host(host)  # the concrete host, for callbacks that run at execution time
    _left_to_rollout(me, plan)
    # as the rollout: a package change an earlier (dead) session started finishes, and what an
    # interrupted one left half done is repaired (dpkg --configure -a), before apt is asked anything
    package_change_settled(name=explained("Settle an earlier package change", "Let an earlier package change finish; repair an interrupted dpkg"))
    refresh = apt.update(name=explained("Refresh the apt index (daily)", "Refresh the apt package index if it is older than a day"), cache_time=APT_CACHE_SECONDS)
    settled = _sources(plan, [refresh])                         # 1. package sources
    _preconditions(settings, plan)                              # 2. what the driver needs first
    install = _install(settings, plan, settled)                 # 3. the one sanctioned change,
    if install is None:
        return                                                  #    (refused: not offered)
    _holds(settings, plan)                                      #    then holds
    _cuda_environment(plan)                                     # 4. CUDA environment
    _reboot(settings, plan, install, me)                        # 5. reboot
    _profiling_pending(settings, plan, install, me)             #    profiling option still to load
    if plan.fabric_manager:
        _fabric_manager(me)


def _left_to_rollout(me: Host, plan: DriverPlan) -> None:
    """What this run leaves to tools/rollout, for the end of the run (the plan's notes, said now)."""
    if plan.stack_pending:
        outcome(me).stack_pending = plan.stack_pending
    if plan.drifted:
        outcome(me).stack_by_hand = {what: list(messages) for what, messages in plan.drifted.items()}
    if plan.pending:
        outcome(me).driver_pending = plan.pending
    for note in plan.notes:
        logger.warning(f"{me.print_prefix}{note}")


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
        outcome(h).needs_reboot = f"{why}; not rebooted ({policy})"
        logger.warning(f"{h.print_prefix}NEEDS A REBOOT: {why}; not rebooted ({policy})")


def _busy_now(policy: str) -> Callable[[Host, str], bool]:
    """rebooted()'s if_busy: GPU work found in the command that would reboot (it started after
    this run's planning): not rebooted, reported with the hosts that need a reboot; not a failure."""
    def busy(h: Host, running: str) -> bool:
        why = _mismatch(h) or "the loaded NVIDIA module differs from the installed driver"
        outcome(h).busy_at_reboot = True
        outcome(h).needs_reboot = f"{why}; BUSY, PENDING: not rebooted (driver_reboot: {policy}, GPU work started after planning: {running})"
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


def _sources(plan: DriverPlan, index_ops: list[OperationMeta]) -> bool:
    """NVIDIA's CUDA repository or the distribution's components (operations/source_steps.py;
    written earlier in this run by a first converge's early install, deploys/bootstrap.py, where
    it ran); whether they are settled: neither these sources nor `index_ops` change the package
    index the versions are read from before the install."""
    early = written_early()
    index_ops += early if early is not None else cuda_sources(plan)
    return not any(op.will_change for op in index_ops)


def _preconditions(settings: Settings, plan: DriverPlan) -> None:
    """What the driver needs before it installs: nouveau out, DKMS signing, kernel headers."""
    blacklist = files.put(
        name=explained("Blacklist nouveau", "Blacklist nouveau so that the NVIDIA module can claim the GPUs"),
        src=StringIO(MANAGED + "blacklist nouveau\noptions nouveau modeset=0\n"),
        dest=NOUVEAU_BLACKLIST, mode="644",
    )
    option = _profiling_option(settings, plan)
    # nouveau stays out at boot, and the nvidia module gets its options there too
    refresh_initramfs(name=explained("Refresh the initramfs", "Refresh the initramfs so that nouveau stays out at boot and the nvidia module gets its options"), _if=any_changed(blacklist, *option))
    if plan.signing_key is not None:
        files.put(name=explained("Let DKMS sign with the MOK (Secure Boot)", "Let DKMS sign the modules it builds with the enrolled MOK (Secure Boot)"), src=StringIO(dkms_signing_conf(plan.signing_key)),
                  dest=DKMS_SIGNING_CONF, mode="644")
    kernel = plan.kernel
    if kernel.prebuilt:
        host.noop(f"kernel {plan.before.kernel_release}: the distribution's prebuilt, signed NVIDIA modules "
                  f"({kernel.modules[0]}): no DKMS build, no kernel headers needed")
    elif plan.headers:
        apt.packages(name=explained(f"Install {plan.headers} (DKMS)", f"Install the headers of the running kernel {plan.before.kernel_release} for DKMS"), packages=[plan.headers], no_recommends=True)
    # Kernels arriving later (unattended upgrades, through linux-image-<flavour>) bring their
    # headers, so that DKMS builds the module for them, only with linux-headers-<flavour>
    # (Ubuntu's HWE kernels: linux-headers-generic-hwe-22.04, gpufleet/catalog/kernels.py).
    if plan.headers_meta:
        apt.packages(name=explained(f"Install {plan.headers_meta}", f"Install {plan.headers_meta} so that kernels installed later come with their headers"), packages=[plan.headers_meta], no_recommends=True)
    elif settings.driver_kernel_headers == "require" and not kernel.prebuilt:
        host.noop(f"kernel {plan.before.kernel_release}: no Debian/Ubuntu flavour, so no headers metapackage to follow it")


def _install(settings: Settings, plan: DriverPlan, settled: bool) -> OperationMeta | None:
    """The one sanctioned change (unhold, change, re-hold as one step); None when the sources do
    not offer a release (the host is refused)."""
    change = plan.change
    if change.in_place:
        # driver_upgrade_in_place (dev boxes): the gate's rules still hold, for this one host:
        # the manifest (and the disk snapshot rollout_snapshot names) first, idle right before.
        from gpufleet.operations.manifest_steps import snapshot_and_manifest
        from gpufleet.rollout.context import RolloutContext

        snapshot_and_manifest(RolloutContext(target=plan.res.driver_version))
    # in place, GPU work is checked in the command that starts the change (require_idle: a job
    # started after planning is seen): busy -> nothing changes, the host fails
    return packages_at_releases(
        name=explained(f"Install {change.what}", change.why), releases=change.releases, present=change.present, pinning=change.pinning,
        hold=settings.driver_hold, old_pins=change.old_pins, require_idle=bool(change.in_place), settled=settled,
        keys=change.keys)


def _holds(settings: Settings, plan: DriverPlan) -> None:
    """The record of the stack gpufleet installed, and the holds: driver, CUDA, cuDNN, toolkit,
    the running kernel, and the metapackages that move with them."""
    if plan.stack_record_packages:
        # tells an inventory change from a hand change
        stack_recorded(name=explained("Record the CUDA/cuDNN releases installed", "Record the CUDA toolkit and cuDNN releases gpufleet installed (tells an inventory change from a hand change)"), versions=plan.stack_record,
                       packages=list(plan.stack_record_packages))
    # with prebuilt modules, the modules' and kernels' flavour metapackages too: kernels move
    # only through tools/rollout
    held(name=explained(("Hold" if settings.driver_hold else "Release") + " the driver stack packages",
                        ("Hold" if settings.driver_hold else "Release") + " the driver, CUDA, cuDNN, container toolkit and running kernel packages, with the prebuilt modules' and kernels' flavour metapackages if any (kernels move only through tools/rollout)"),
         packages=list(plan.held), present=settings.driver_hold)
    if plan.hold_headers_meta:
        held(name=explained(f"Hold {plan.hold_headers_meta}", f"Hold {plan.hold_headers_meta} as the kernel image metapackage is held: new kernels and their headers move together"), packages=[plan.hold_headers_meta])
    if settings.hardening_unattended_upgrades:
        # The same file, template and list as deploys/hardening.py: whichever runs first writes it.
        files.put(
            name=explained("Keep unattended-upgrades off the GPU packages", "Keep unattended-upgrades away from NVIDIA, CUDA and cuDNN packages"),
            src=StringIO(render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                                blacklist=list(GPU_PACKAGE_BLACKLIST))),
            dest=UNATTENDED_CONF, mode="644",
        )


def _cuda_environment(plan: DriverPlan) -> None:
    """CUDA on PATH and the library path of login shells, or no such profile."""
    res = plan.res
    if plan.cuda_home is not None:
        files.put(
            name=explained(f"Put CUDA {res.cuda_version} on PATH", f"Put CUDA {res.cuda_version} on PATH and the library path of login shells"),
            src=StringIO(render("etc/profile.d/gpufleet-cuda.sh.j2", cuda_version=res.cuda_version,
                                package=res.cuda_package, cuda_home=plan.cuda_home)),
            dest=CUDA_PROFILE, mode="644",
        )
    else:
        files.file(name=explained("No CUDA profile", "No host CUDA toolkit from gpufleet: no CUDA profile"), path=CUDA_PROFILE, present=False)


def _reboot(settings: Settings, plan: DriverPlan, install: OperationMeta, me: Host) -> None:
    """Reboot to load the installed driver where the tier allows it and the GPUs are idle right
    before; else say the host needs one."""
    # Only a run that changes the driver, or finds a mismatch already pending, can reboot: only
    # then is the GPU work on the host worth reading (it scans every process's open files).
    busy = gpu_work(host) if install.will_change or plan.before.mismatch else []
    policy = reboot_hold_back(settings, busy)
    if policy is None:
        forced = reboot_forced(settings)
        # only if the loaded module differs from the installed driver; unless forced, the GPUs
        # are checked idle in the very command that reboots
        rebooted(
            name=explained("Reboot to load the NVIDIA driver" + ("" if forced else " (if idle)"),
                           "Reboot to load the installed NVIDIA driver, if the loaded module differs from it"
                           + ("" if forced else " (GPUs checked idle in the same command)")),
            reason="gpufleet driver: load the installed NVIDIA kernel module", timeout=REBOOT_TIMEOUT,
            # idle at planning is not idle now: a job started since makes the host busy, pending
            require_idle=not forced, if_busy=_busy_now(settings.driver_reboot),
            _if=lambda: _mismatch(me) is not None,
        )
        python.call(
            name=explained("Check the loaded NVIDIA module", "Check that the loaded NVIDIA module is the installed driver after the reboot"),
            function=_verify_after_reboot, h=me,
            _if=lambda: not outcome(me).busy_at_reboot and _mismatch(me) is not None,
        )
    else:
        python.call(
            name=explained("Report a pending reboot", "Report that the host needs a reboot, if the loaded NVIDIA module differs from the installed driver"),
            function=_report, h=me, policy=policy,
            _if=lambda: _mismatch(me) is not None,
        )


def _profiling_option(settings: Settings, plan: DriverPlan) -> list[OperationMeta]:
    """tuning_profiling's modprobe.d file (gpufleet/plans/profiling.py), written with the nouveau
    blacklist: before the driver is installed, so that the module loaded after this run's
    reboot (a new host) already has it."""
    text = plan.profiling.file_text
    if text is not None:
        # every user may read the GPU performance counters from the next load of the module
        return [files.put(name=explained(f"Set the nvidia profiling option ({KEY}: users)", f"Let every user read the GPU performance counters from the next load of the nvidia module ({KEY}: users)"),
                          src=StringIO(text), dest=MODPROBE_FILE, mode="644")]
    return [files.file(name=explained(f"No nvidia profiling option ({KEY}: {settings.tuning_profiling})", f"No gpufleet profiling option for the nvidia module ({KEY}: {settings.tuning_profiling})"),
                       path=MODPROBE_FILE, present=False)]


def _profiling_stale(h: Host, setting: str) -> bool:
    """Executing: whether the loaded nvidia module gives the counters otherwise than the next load
    will (read then: after this run's own reboot, if it made one)."""
    from gpufleet.facts.kernel import ProfilingState

    try:
        return plan_profiling(setting, h.get_fact(ProfilingState), None, False).pending
    except Refused:  # refused at planning already
        return False


def _profiling_report(state: State | None, host: Host, h: Host, setting: str) -> bool:
    """Executing (python.call): record a profiling setting the loaded module does not have yet."""
    outcome(h).profiling_pending = f"{KEY}: {setting}: the loaded nvidia module has the other setting"
    logger.warning(f"{h.print_prefix}PROFILING PENDING: {KEY}: {setting} takes effect at the next load of the nvidia "
                   "module: reboot it through tools/rollout (deploys/all.py does not reboot for it)")
    return True


def _profiling_pending(settings: Settings, plan: DriverPlan, install: OperationMeta, me: Host) -> None:
    """Said at the end of the run: a setting the loaded module does not have yet. No reboot of its
    own: tools/rollout's gate reboots for it. When this run may reboot (a driver change), asked
    again after that reboot; else decided now, from the facts before the run (no operation: a
    re-run while it waits changes nothing)."""
    setting = settings.tuning_profiling
    if install.will_change or plan.before.mismatch:
        # if the loaded nvidia module waits for a reboot to get the setting
        python.call(name=explained("Report a pending profiling setting", f"Report that the loaded nvidia module waits for a reboot to get {KEY}: {setting}, if it does"),
                    function=_profiling_report, h=me, setting=setting, _if=lambda: _profiling_stale(me, setting))
    elif plan.profiling.pending:
        _profiling_report(state=None, host=me, h=me, setting=setting)


def _fabric_manager(me: Host) -> None:
    """Fabric Manager refuses to start against a module of another version: at boot, and now
    only once the loaded module is the installed driver."""
    systemd.service(name=explained("Enable Fabric Manager", "Start Fabric Manager at boot"), service="nvidia-fabricmanager.service", running=None, enabled=True)
    systemd.service(
        name=explained("Start Fabric Manager", "Run Fabric Manager now, if the loaded module is the installed driver"),
        service="nvidia-fabricmanager.service", running=True,
        _if=lambda: _mismatch(me) is None,
    )


# `pyinfra INVENTORY deploys/driver.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
