"""The newest stack that still supports a GPU: driver branch, CUDA release, PyTorch wheel, kernel
modules. tools/compat --list-gpus prints it per GPU, and the resolver names it when it refuses a
GPU that only an older stack supports (a Pascal board asked for CUDA 13, a Volta one for R590).

Pure: everything comes from compat.yaml (compat.py, gpus.py, pytorch.py). Where NVIDIA's and
PyTorch's tables say nothing the answer is None, never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from gpufleet.catalog.compat import CompatData, DriverBranch, compat_data
from gpufleet.errors import Incompatible
from gpufleet.catalog.gpus import GpuModel
from gpufleet.catalog.pytorch import choose_pytorch, fitting_releases, pytorch_data
from gpufleet.versions import at_least, major, parse


@dataclass(frozen=True)
class NewestStack:
    """What the newest known stack gives one GPU model (None: nothing in the data supports it)."""

    gpu: str
    arch: str
    compute_capability: str
    gpu_class: str
    branch: str | None  # newest usable driver branch that drives it
    driver: str | None  # that branch's newest known release
    last_branch: str | None  # the architecture's last branch (R580 for Maxwell, Pascal, Volta), if it has ended
    cuda: str | None  # newest CUDA release it can use with that driver ("12.9")
    cuda_release: str | None  # its newest update that driver supports ("12.9.1")
    cuda13: bool  # whether any CUDA 13.x release still builds for it
    pytorch: str | None  # newest PyTorch release with a wheel for it
    pytorch_variant: str | None  # that wheel's CUDA variant ("cu128")
    modules: tuple[str, ...]  # kernel-module flavours it can use: open, proprietary

    def describe(self) -> str:
        if self.branch is None:
            return "no driver branch in the compatibility data"
        parts = [f"R{self.branch} ({self.driver})"]
        parts.append(f"CUDA {self.cuda} ({self.cuda_release})" if self.cuda else "no CUDA release")
        parts.append(f"PyTorch {self.pytorch} {self.pytorch_variant}" if self.pytorch else "no PyTorch wheel")
        return ", ".join(parts)


def _newest_known(info: DriverBranch) -> str:
    return max([info.default or "0", *info.versions], key=parse)


def _drives(model: GpuModel, info: DriverBranch) -> bool:
    return model.arch in info.architectures and (model.min_driver is None or at_least(_newest_known(info), model.min_driver))


def _cuda_for(model: GpuModel, driver: str, data: CompatData) -> tuple[str, str] | None:
    """The newest (CUDA minor, update) that builds for the model and that ``driver`` supports natively."""
    arch = data.architectures[model.arch]
    for cuda in sorted(data.cuda_releases, key=parse, reverse=True):
        family = data.cuda_families.get(major(cuda))
        updates = data.cuda_releases[cuda].updates_for(driver)
        if family is None or not updates or not at_least(driver, family.min_driver):
            continue
        if parse(model.compute_capability) < parse(family.min_compute_capability):
            continue
        if arch.first_cuda and parse(cuda) < parse(arch.first_cuda):
            continue
        if arch.last_cuda_major and int(major(cuda)) > int(arch.last_cuda_major):
            continue
        return cuda, updates[0]
    return None


def _modules(model: GpuModel, driver: str, data: CompatData) -> tuple[str, ...]:
    out = []
    if model.generation >= data.generation(data.open_min_architecture) and (
            model.first_open_driver is None or at_least(driver, model.first_open_driver)):
        out.append("open")
    if not model.open_required:
        out.append("proprietary")
    return tuple(out)


def newest_stack(model: GpuModel, data: CompatData | None = None) -> NewestStack:
    data = data or compat_data()
    return _packaged(model) if data is compat_data() else _compute(model, data)


@lru_cache(maxsize=256)
def _packaged(model: GpuModel) -> NewestStack:
    """newest_stack on the packaged data, once per model and process (GpuModel is frozen)."""
    return _compute(model, compat_data())


def _compute(model: GpuModel, data: CompatData) -> NewestStack:
    arch = data.architectures[model.arch]
    branches = [b for b in sorted(data.usable_branches, key=int) if _drives(model, data.driver_branches[b])]
    cuda13 = False
    branch = driver = cuda = cuda_release = torch = variant = None
    modules: tuple[str, ...] = ()
    if branches:
        branch = branches[-1]
        driver = _newest_known(data.driver_branches[branch])
        found = _cuda_for(model, driver, data)
        if found:
            cuda, cuda_release = found
        cuda13 = cuda is not None and int(major(cuda)) >= 13
        releases = fitting_releases([model], driver, data)
        if releases:
            torch = releases[0]
            try:
                choice = choose_pytorch([model], torch, driver, data)
            except Incompatible:  # fitting_releases said one fits: cannot happen, but say nothing rather than guess
                choice = None
            variant = choice.variant if choice else None
        modules = _modules(model, driver, data)
    return NewestStack(
        gpu=model.name, arch=model.arch, compute_capability=model.compute_capability, gpu_class=model.gpu_class,
        branch=branch, driver=driver, last_branch=arch.last_branch, cuda=cuda, cuda_release=cuda_release,
        cuda13=cuda13, pytorch=torch, pytorch_variant=variant, modules=modules,
    )


def is_behind(stack: NewestStack, data: CompatData | None = None) -> bool:
    """Whether only an older stack supports the GPU: its newest branch, CUDA major or PyTorch is
    not the newest the data knows."""
    data = data or compat_data()
    newest_branch = max(data.usable_branches, key=int)
    newest_cuda_major = max(int(major(c)) for c in data.cuda_releases)
    newest_torch = pytorch_data().versions[0]
    return (stack.branch != newest_branch or stack.cuda is None or int(major(stack.cuda)) < newest_cuda_major
            or stack.pytorch != newest_torch)


def stack_hint(models: list[GpuModel] | tuple[GpuModel, ...], data: CompatData | None = None) -> str:
    """"; the newest stack for Tesla V100-SXM2-16GB: R580 (...), CUDA 12.9 (12.9.1), PyTorch 2.10 cu128"
    for each model only an older stack supports; "" when none is."""
    out = []
    for model in {m.name: m for m in models}.values():
        stack = newest_stack(model, data)
        if is_behind(stack, data):
            out.append(f"the newest stack for {model.name} ({model.arch}, compute capability "
                       f"{model.compute_capability}) is {stack.describe()}")
    return "".join(f"; {line}" for line in out)
