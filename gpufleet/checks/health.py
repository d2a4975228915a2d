"""The validation gate, health: the GPUs are healthy (gpufleet.plans.health)."""
from __future__ import annotations

from gpufleet.checks.gate import FAIL, PASS, SKIP, WARN, Context, Result, check
from gpufleet.facts.health import GpuHealth
from gpufleet.plans.health import GpuVerdict, all_findings, assess

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


