"""The validation gate, pytorch: the host's PyTorch build runs on its GPUs and driver."""
from __future__ import annotations

from typing import Any

from gpufleet.checks.gate import FAIL, PASS, SKIP, WARN, Context, Result, check
from gpufleet.checks.probe import no_runtime, no_torch
from gpufleet.errors import Incompatible
from gpufleet.facts.pytorch import TorchBuild

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


