"""The validation gate, storage: the local scratch and /dev/shm, compared with gpufleet.plans.storage's plans."""
from __future__ import annotations

from gpufleet.checks.gate import FAIL, FIX_DEPLOY, PASS, SKIP, Context, Result, check
from gpufleet.config.failures import Refused


@check("storage")
def scratch_in_place(ctx: Context) -> Result:
    """The scratch the same plan as deploys/storage.py's says is there: mounted at its path."""
    from gpufleet.config.hostfacts import block_devices
    from gpufleet.facts.storage import ScratchSite
    from gpufleet.plans.storage import KEEP, MAKE, lost_note, plan_scratch

    name = "the local scratch is mounted where the tier says"
    settings = ctx.settings
    if settings.storage_scratch == "none":
        return Result("storage", name, SKIP, "storage_scratch: none")
    try:
        plan = plan_scratch(settings.storage_scratch, settings.storage_scratch_devices, settings.storage_scratch_path,
                            block_devices(ctx.host),
                            lambda: ctx.host.get_fact(ScratchSite, path=settings.storage_scratch_path))
    except Refused as refused:
        return Result("storage", name, FAIL, str(refused), refused.refusal.how_to_fix())
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
    from gpufleet.config.hostfacts import resources
    from gpufleet.facts.storage import ShmSize
    from gpufleet.plans.storage import plan_shm

    name = "/dev/shm has the size the tier sets"
    setting = ctx.settings.storage_shm_size
    if setting == "unmanaged":
        return Result("storage", name, SKIP, "storage_shm_size: unmanaged")
    try:
        plan = plan_shm(setting, ctx.host.get_fact(ShmSize), resources(ctx.host).memory_total_kib)
    except Refused as refused:
        return Result("storage", name, FAIL, str(refused), refused.refusal.how_to_fix())
    if plan.remount:
        return Result("storage", name, FAIL, plan.note, FIX_DEPLOY)
    return Result("storage", name, PASS, f"size={setting}: {plan.note}")


