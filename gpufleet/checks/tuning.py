"""The validation gate, tuning: persistence, clocks, MIG, profiles, GPUDirect, NCCL HCAs, profiling, CPU governor, compared with their plans."""
from __future__ import annotations

import hashlib

from pyinfra.facts.files import Sha256File

from gpufleet.checks.gate import FAIL, FIX_DEPLOY, PASS, SKIP, WARN, Context, Result, check
from gpufleet.config.hostcontext import host_context
from gpufleet.errors import Incompatible
from gpufleet.facts.packages import PackageVersions
from gpufleet.config.failures import Refused
from gpufleet.plans.tuning import clocks_summary, host_mig, plan_tuning


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
    except Refused as refused:  # the deploy would refuse this host too
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
    except Refused as refused:  # the deploy refuses this host too
        return Result("tuning", name, FAIL, f"the tuning deploy refuses this host: {refused}",
                      "change gpu_mig for this host")
    if not plan.gpus:
        return Result("tuning", name, PASS, "no GPU with MIG on this host")
    off = [f"{g.label}: has {g.found}, wants " + (" + ".join(g.wanted) if g.wanted is not None else "MIG off")
           for g in plan.changes]
    if not off:
        return Result("tuning", name, PASS, plan.summary())
    done = host_context(ctx.host).outcome  # what this run's tuning deploy did with the plan
    reboot = done.mig_reboot
    if reboot:
        return Result("tuning", name, WARN, f"NEEDS A REBOOT (the GPU reset was refused: {reboot}): " + "; ".join(off),
                      "reboot the host while its GPUs are idle; the boot unit makes the partitions")
    pending = done.mig_pending
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
    from gpufleet.config.hostfacts import rdma_devices
    from gpufleet.facts.kernel import PeermemState
    from gpufleet.plans import gpudirect

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
    from gpufleet.config.hostfacts import rdma_devices
    from gpufleet.plans import gpudirect
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
    except Refused as refused:
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
    from gpufleet.plans.profiling import (
        FILE_TEXT,
        KEY,
        MODPROBE_FILE,
        USERS,
                host_profiling,
    )

    name = "GPU performance counters are for whom tuning_profiling says"
    setting = ctx.settings.tuning_profiling
    try:
        res = ctx.resolution()
    except Incompatible:
        res = None
    try:
        plan = host_profiling(ctx.host, ctx.settings, res)
    except Refused as refused:
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
    except Refused as refused:
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


