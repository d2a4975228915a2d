"""A driver upgrade on one host, in steps the rolling-upgrade runner (gpufleet/apps/rollout/runner.py)
runs one after the other, each as its own pyinfra run, because each needs the state the previous
one left (after a reboot, after a wait):

    survey    read what the host has (GPUs, processes, driver, packages, holds, Slurm)
    drain     Slurm drain; wait for (or refuse on) running GPU processes; refresh the apt index
    snapshot  disk snapshot (lvm | btrfs | zfs | command) and the manifest, copied to the controller
    upgrade   unhold -> install the target driver's exact versions, and the CUDA toolkit /
              cuDNN packages at the releases the inventory resolves to -> hold again (Ubuntu's
              prebuilt modules with the driver, and the kernels they follow with them; a
              toolkit's components with it, Nsight included: gpufleet/rollout/moves.py, on all.py's
              packages plan)
    reboot    only when the loaded module is not the target, or lacks the tier's tuning_profiling
              (a module option, read at its load), and driver_reboot allows it; by
              gpufleet, or by Slurm (rollout_slurm_reboot: slurm), the node left DOWN until undrain
    mig       the MIG partitions gpu_mig sets, where the GPUs' layout differs (the runner's step:
              deploys/tuning.py's MIG part, through the same per-GPU gate; a host whose only
              change is its MIG layout goes through every step, each a no-op but this one)
    tune      persistence and clocks back as recorded in the manifest (with --retune the runner
              applies deploys/tuning.py instead: the tier's tuning, as all.py does)
    validate  loaded module = installed = target, nvidia-smi healthy, GPUs and settings as before
              (clocks not compared on GPUs in MIG mode: not settable there), MIG layout as gpu_mig sets
    undrain   Slurm: the node's driver feature (gpufleet_driver_<version>), then resume

Every step reads the host's real state first and changes only what differs, so a re-run after
a failure picks up where it stopped.
"""
from __future__ import annotations

from typing import Any


from pyinfra import host, logger
from pyinfra.api import deploy

from gpufleet.facts.dcgm_diag import DcgmDiag
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.kernel import DriverState, ProfilingState
from gpufleet.facts.packages import TOOLKIT, HeldPackages, PackageVersions, StackPackages, ToolkitIndex
from gpufleet.facts.packages import AptVersions
from gpufleet.facts.slurm import SlurmNode
from gpufleet.rollout import manifest as mf
from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.moves import (MoveRefusal, RolloutMove, driver_releases, recorded_holds, rollout_move,
                                    stack_targets, toolkit_moves)
from gpufleet.plans.repos import apt_url
from gpufleet.config.failures import Refused
from gpufleet.plans.profiling import USERS, nsight_packages, nsight_releases, plan_profiling
from gpufleet.config.settings import Settings, host_settings
from gpufleet.explain import explained
from gpufleet.checks.validation import FAIL, PASS, diag_result
from gpufleet.config.hostfacts import gpu_state, mig_state
from gpufleet.plans.tuning import host_mig
from gpufleet.catalog.cuda_stack import stack_fact_packages
from gpufleet.operations.apt_index import index_refreshed
from gpufleet.operations.drain import (gpu_containers_stopped, gpus_idle, gpus_idle_now, slurm_driver_feature, slurm_node,
                                       slurm_node_drained)
from gpufleet.operations.driver import stack_recorded
from gpufleet.operations.driver_upgrade import package_change_settled, packages_at_versions
from gpufleet.operations.gpu_restore import gpu_settings_restored
from gpufleet.operations.reboot import rebooted, slurm_rebooted
from gpufleet.operations.manifest_steps import installed_packages, snapshot_and_manifest


def survey_host(ctx: RolloutContext) -> None:
    """Read (never change) what the host has; the runner plans and prints from this."""
    settings = host_settings(host)
    gpus = host.get_fact(GpuState)
    driver = host.get_fact(DriverState)
    installed = host.get_fact(PackageVersions, packages=list(mf.PACKAGE_PATTERNS))
    moving = mf.driver_packages(installed, driver.userspace_version or "")
    candidates = host.get_fact(AptVersions, packages=moving) if moving else {}
    ctx.survey[host.name] = {
        "tier": settings.tier,
        "driver_source": settings.driver_source,
        "inventory_driver_version": settings.driver_version,
        "driver_reboot": settings.driver_reboot,
        "require_idle": settings.rollout_require_idle,
        "snapshot": settings.rollout_snapshot,
        "batch_size": settings.rollout_batch_size,
        "gpu_status": gpus.status,
        "gpu_count": len(gpus.gpus),
        "gpus": mf.gpu_record(gpus),
        "processes": [{"pid": p.pid, "name": p.process_name} for p in gpus.processes],
        "loaded": driver.module_version,
        "installed": driver.userspace_version,
        "packages": {k: v for k, v in installed.items() if v},
        "moving": moving,
        "available": {name: [v for v in versions if mf.upstream(v) == ctx.target]
                      for name, versions in candidates.items()},
        "holds": host.get_fact(HeldPackages),
        "slurm": host.get_fact(SlurmNode, node=settings.rollout_slurm_node_name).scontrol is not None,
        "profiling_pending": _profiling_pending(settings.tuning_profiling),
        **mig_survey(settings.gpu_mig),
    }


def mig_survey(setting: object) -> dict[str, object]:
    """The MIG plan's part of the survey: what changes (one line per GPU), or why the layout is
    refused for this host; the same plan (gpufleet.plans.tuning.host_mig) all.py, the plan view and the
    gate read."""
    try:
        plan = host_mig(host, setting)
    except Refused as refused:
        return {"mig_changes": [], "mig_error": f"refused ({refused.key}): {refused.problem}. Fix: set "
                                                f"{refused.key} to what this host allows: {refused.allowed}"}
    changes = [f"{g.label}: {g.found} -> " + (" + ".join(g.wanted) if g.wanted is not None else "MIG off")
               for g in plan.changes]
    return {"mig_changes": changes, "mig_error": None, "mig_summary": plan.summary(),
            "mig_on": any(g.mig_on for g in plan.gpus)}


def driver_moves(ctx: RolloutContext) -> bool:
    """Does this host's driver (or CUDA toolkit / cuDNN) move in this rollout? No: only its MIG layout."""
    info = ctx.survey.get(host.name, {})
    return not (info.get("installed") == info.get("loaded") == ctx.target and not info.get("stack_moves"))


def _profiling_pending(setting: str) -> bool:
    """The loaded nvidia module gives the GPU performance counters otherwise than the modprobe.d
    files gpufleet wrote for tuning_profiling say (gpufleet/plans/profiling.py): its next load, a reboot
    through these steps, makes it so (a setting all.py has not written yet is all.py's first)."""
    try:
        return plan_profiling(setting, host.get_fact(ProfilingState), None, False).reboot_helps
    except Refused:  # all.py refuses the host: nothing of it is rolled out
        return False


@deploy("Drain")
def drain(ctx: RolloutContext) -> None:
    settings = host_settings(host)
    # a rollout resumed after its SSH session died: the package change it started finishes (or an
    # interrupted dpkg is repaired) before anything else happens on this host
    package_change_settled(name=explained("Settle an earlier package change", "Let an earlier package change finish; repair an interrupted dpkg"))
    processes = host.get_fact(GpuState).processes
    node = settings.rollout_slurm_node_name
    slurm = host.get_fact(SlurmNode, node=node)
    if slurm.scontrol and slurm.error:
        ctx.refuse(host, f"Slurm node {slurm.node}: {slurm.error}; not upgraded",
                   "set rollout_slurm_node_name if the node has another name in Slurm",
                   area="rollout_slurm_node_name")
        return
    # on a Slurm node the GPU processes are (mostly) its jobs: the drain waits for them below
    if processes and settings.rollout_require_idle and not ctx.force and ctx.wait_idle <= 0 and not slurm.scontrol:
        running = ", ".join(f"{p.pid} {p.process_name}" for p in processes)
        ctx.refuse(host, f"busy: {len(processes)} GPU process(es) running ({running}); not upgraded",
                   "let them finish and re-run, wait for them with --wait-idle SECONDS, or upgrade anyway "
                   "with --force", outcome="busy")
        return
    why = mf.purpose(ctx.survey.get(host.name, {}), ctx.target)
    slurm_node(name=explained("Drain the Slurm node", f"Drain the Slurm node for the {why}"), drained=True, reason=f"gpufleet {why}", node=node)
    slurm_node_drained(name=explained("Wait for the Slurm jobs on the node to finish (DRAINED)",
                                                 "Wait until Slurm reports the node DRAINED: its jobs have finished"), node=node,
                       timeout=settings.rollout_drain_timeout)
    if ctx.stop_containers:
        gpu_containers_stopped(name=explained("Stop the containers that use the GPUs", "Stop the containers that use the GPUs (--stop-containers)"))
    if slurm.scontrol and settings.rollout_require_idle and not ctx.force:
        # checked once the node is DRAINED: what still runs on the GPUs is not a Slurm job
        gpus_idle_now(name=explained("Wait for running GPU processes to finish", "Once the node is DRAINED, wait for what still runs on the GPUs: it is not a Slurm job"),
                      wait_seconds=ctx.wait_idle)
    elif processes and settings.rollout_require_idle and not ctx.force:
        gpus_idle(name=explained("Wait for running GPU processes to finish", "Wait for the GPU processes found at planning to finish (--wait-idle)"),
                  wait_seconds=ctx.wait_idle)
    index_refreshed(name=explained("Refresh the package index", "Refresh the package index of the NVIDIA repository (through the package cache, if any)"),
                    url=apt_url(host_settings(host), host_settings(host).driver_repo_url))


def _nsight_with(ctx: RolloutContext, wanted: dict[str, str]) -> dict[str, str] | None:
    """tuning_profiling users: the Nsight packages (package -> release) of the CUDA toolkit
    release the rollout moves to ({}: admins, or no toolkit); None when that release has none
    recorded (refused, as all.py refuses it: nothing moves on this host)."""
    settings = host_settings(host)
    release = next((v for p, v in sorted(wanted.items()) if TOOLKIT.match(p)), None)
    if settings.tuning_profiling != USERS or release is None or settings.driver_source != "nvidia":
        return {}
    found = nsight_packages(release)
    if found is None:
        ctx.refuse(host, f"no Nsight Systems / Nsight Compute release is recorded for CUDA {release} "
                         "(compat.yaml nsight_tools): tuning_profiling users would lose its tools; not upgraded",
                   "tuning_profiling: admins, or a cuda_version whose release has them: "
                   + ", ".join(nsight_releases()), area="tuning_profiling")
        return None
    return found


@deploy("Snapshot")
def snapshot(ctx: RolloutContext) -> None:
    snapshot_and_manifest(ctx)


@deploy("Upgrade the driver")
def upgrade(ctx: RolloutContext) -> None:
    settings = host_settings(host)
    installed = installed_packages()
    wanted = ctx.stack.get(host.name, {})
    nsight = _nsight_with(ctx, wanted) if toolkit_moves(installed, wanted) else {}
    if nsight is None:
        return
    move = _planned_move(ctx, settings, installed, wanted, nsight)
    if isinstance(move, MoveRefusal):
        ctx.refuse(host, move.reason, move.fix, area=move.area)
        return
    package_change_settled(name=explained("Settle an earlier package change", "Let an earlier package change finish; repair an interrupted dpkg"))
    # a driver or libraries swapped under a running job break it: GPU work is checked in the very
    # command that starts the change (a job started since the drain makes the host busy, pending)
    idle = bool(move.install) and settings.rollout_require_idle and not ctx.force
    if idle and ctx.wait_idle > 0:
        gpus_idle_now(name=explained("Wait for running GPU processes to finish", "Wait for running GPU processes to finish before the package change"),
                      wait_seconds=ctx.wait_idle)
    if move.what:
        logger.info(f"{host.print_prefix}moving {', '.join(move.what)}")
    # unhold, install, hold again (with `idle`: the GPUs checked idle right before, in the same command)
    packages_at_versions(name=explained(f"Move {move.short}" + (" (if idle)" if idle else ""),
                                        f"Move {', '.join(move.what) or 'nothing'} (unhold, install, hold again"
                                        + (", the GPUs checked idle right before, in the same command)" if idle else ")")),
                         install=move.install, remove=list(move.remove), hold=list(move.hold),
                         # an inventory may ask for an older release (pin back): apt is allowed to
                         # downgrade exactly when a target sorts before what is installed
                         downgrade=None, require_idle=idle)
    if wanted:
        stack_recorded(name=explained("Record the CUDA/cuDNN releases installed", "Record the CUDA toolkit and cuDNN releases gpufleet installed"),
                       versions={p: wanted[p] for p in move.stack_present}, packages=stack_fact_packages(wanted))


def _planned_move(ctx: RolloutContext, settings: Settings, installed: dict[str, str | None],
                  wanted: dict[str, str], nsight: dict[str, str]) -> RolloutMove | MoveRefusal:
    """The host's facts that decide its package change, and the change (gpufleet/rollout/moves.py)."""
    driver, _ = driver_releases(installed, ctx.target)
    stack, _ = stack_targets(installed, wanted)
    names = sorted({*driver, *stack, *nsight, *(n for n, v in installed.items() if v and mf.MODULES_PACKAGE.match(n)),
                    *mf.kernel_metapackages(installed)})
    available = host.get_fact(AptVersions, packages=names)
    # what the manifest recorded as held is held again, even if an interrupted change released it
    held: list[str] = host.get_fact(HeldPackages)
    holds = recorded_holds(held, (ctx.manifests.get(host.name) or {}).get("holds", []))
    # a toolkit moves with its components at the versions its release names (apt alone would
    # bring the newest ones its >= dependencies allow)
    toolkits = {meta: host.get_fact(ToolkitIndex, package=meta) for meta in stack if TOOLKIT.match(meta)}
    return rollout_move(installed, holds, available, ctx.target, wanted, toolkits, nsight, settings.driver_hold)


@deploy("Reboot if needed")
def reboot(ctx: RolloutContext) -> None:
    settings = host_settings(host)
    loaded = host.get_fact(DriverState).module_version
    profiling = _profiling_pending(settings.tuning_profiling)
    if loaded == ctx.target and not profiling:
        host.noop(f"driver {ctx.target} is loaded: no reboot needed")
        return
    why = (f"load driver {ctx.target} (loaded: {loaded})" if loaded != ctx.target
           else f"load the nvidia module with tuning_profiling: {settings.tuning_profiling}")
    if settings.driver_reboot == "never":
        ctx.refuse(host, f"a reboot is needed to {why}, and driver_reboot is never",
                   "reboot the host by hand, then re-run the rollout", outcome="reboot-pending",
                   area="driver_reboot")
        return
    # the idle check runs again in the very command that starts the reboot (drain to reboot is
    # minutes of package work; a job started meanwhile must not be killed)
    if settings.rollout_slurm_reboot == "slurm":
        slurm = host.get_fact(SlurmNode, node=settings.rollout_slurm_node_name)
        if not slurm.scontrol or slurm.error:
            ctx.refuse(host, f"rollout_slurm_reboot is slurm, but Slurm node {slurm.node} cannot be asked: "
                             f"{slurm.error or 'no scontrol on the host'}",
                       "set rollout_slurm_reboot: gpufleet for hosts outside Slurm", area="rollout_slurm_reboot")
            return
        slurm_rebooted(name=explained(f"Let Slurm reboot node {slurm.node}", f"Let Slurm reboot node {slurm.node} to {why}"),
                       node=slurm.node, reason=f"gpufleet {mf.purpose(ctx.survey.get(host.name, {}), ctx.target)}",
                       timeout=ctx.reboot_timeout,
                       require_idle=settings.rollout_require_idle and not ctx.force)
        return
    rebooted(name=explained("Reboot", f"Reboot to {why}"),
             reason=f"gpufleet {mf.purpose(ctx.survey.get(host.name, {}), ctx.target)}", timeout=ctx.reboot_timeout,
             require_idle=settings.rollout_require_idle and not ctx.force)


@deploy("Restore tuning")
def tune(ctx: RolloutContext) -> None:
    doc = ctx.manifests.get(host.name)
    if not doc:
        host.noop("no manifest for this rollout: nothing recorded to restore")
        return
    # the persistence mode and application clocks recorded before the upgrade
    gpu_settings_restored(name=explained("Restore persistence and clocks", "Restore the persistence mode and application clocks recorded before the upgrade"),
                          gpus=doc.get("gpus", []), skip=sorted(mig_on(host)))


def mig_on(host: Any) -> frozenset[str]:
    """UUIDs of the GPUs in MIG mode now: their clocks are not settable (not restored, not compared)."""
    state = mig_state(host)
    buses = {g.bus_id for g in state.gpus if g.current == "Enabled"}
    return frozenset(g.uuid for g in gpu_state(host).gpus if g.bus_id in buses)


@deploy("Validate the upgrade")
def validate(ctx: RolloutContext) -> None:
    driver = host.get_fact(DriverState)
    gpus = host.get_fact(GpuState)
    holds = host.get_fact(HeldPackages)
    stack = ctx.stack.get(host.name, {})
    found = host.get_fact(StackPackages, packages=stack_fact_packages(stack)) if stack else StackPackages.default()
    settings = host_settings(host)
    problems = mf.validation_problems(ctx.target, driver, gpus, holds, ctx.manifests.get(host.name),
                                      stack=stack, stack_installed=found.installed,
                                      stack_held=settings.driver_hold, mig_on=mig_on(host))
    try:
        problems += [f"MIG layout: {g.label} has {g.found}, gpu_mig sets "
                     + (" + ".join(g.wanted) if g.wanted is not None else "MIG off")
                     for g in host_mig(host, settings.gpu_mig).changes]
    except Refused as refused:
        problems.append(f"gpu_mig refused for this host: {refused.problem}")
    if _profiling_pending(settings.tuning_profiling):
        problems.append(f"the loaded nvidia module still lacks tuning_profiling: {settings.tuning_profiling} "
                        "after its reboot (RmProfilingAdminOnly in /proc/driver/nvidia/params): is the initramfs current?")
    level = settings.rollout_canary_diag_level if host.name in ctx.canaries else 0
    diag = ""
    if level:
        # the canary proves the new driver on the GPUs before any batch gets it (the host is drained)
        result = diag_result(host.get_fact(DcgmDiag, level=level), {g.index: g.bus_id for g in gpus.gpus},
                             f"DCGM diagnostic level {level}", "rollout")
        if result.status == FAIL:
            problems.append(f"DCGM diagnostic level {level} on the canary failed: {result.message} "
                            f"(fix: {result.fix})")
        elif result.status == PASS:
            diag = f", DCGM diagnostic level {level} passed"
            ctx.note(host, f"canary: DCGM diagnostic level {level} passed")
    if problems:
        ctx.refuse(host, "validation failed: " + "; ".join(problems),
                   "fix what it names and re-run the rollout, or put the host back with "
                   "tools/rollback INVENTORY HOST --reboot", area="validation")
    else:
        exact = [f"{p} {v}" for p, v in sorted(stack.items()) if found.installed.get(p)]
        mig = mig_survey(settings.gpu_mig).get("mig_summary")
        host.noop(f"driver {ctx.target} loaded" + (f", {', '.join(exact)}" if exact else "")
                  + f", {len(gpus.gpus)} GPU(s) healthy{diag}, settings and holds as before"
                  + (f", MIG as gpu_mig sets ({mig})" if mig else ""))


@deploy("Return to service")
def undrain(ctx: RolloutContext) -> None:
    node = host_settings(host).rollout_slurm_node_name
    # the loaded driver, not the target: a host given back unchanged keeps its true label
    # feature gpufleet_driver_<version>
    slurm_driver_feature(name=explained("Label the Slurm node with its driver", "Label the Slurm node with its driver (feature gpufleet_driver_<version>)"),
                         version=host.get_fact(DriverState).module_version or "", node=node)
    slurm_node(name=explained("Resume the Slurm node", "Resume the Slurm node (only if gpufleet drained it)"), drained=False,
               node=node)
