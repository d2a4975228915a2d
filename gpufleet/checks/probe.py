"""The validation gate, probe: the optional health and performance probe."""
from __future__ import annotations

import os
from typing import Any

from gpufleet.plans import perf
from gpufleet.checks.gate import FAIL, PASS, SKIP, WARN, Context, Result, check
from gpufleet.facts.dcgm_diag import DcgmDiag, DcgmDiagData
from gpufleet.facts.gpu_checks import PerfProbe
from gpufleet.plans.health import diag_findings, health_rules, rank

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


