"""Which PyTorch wheel runs on a host: its GPUs and its driver against the `pytorch` section of
compat.yaml.

A pip wheel of PyTorch bundles its CUDA runtime and kernels compiled for a fixed list of compute
capabilities. Two things then fail at run time, long after an install looked fine:

- a GPU whose compute capability the wheel was not built for: CUDA kernels fail with
  "no kernel image is available for execution on the device";
- a driver older than the CUDA family of the wheel allows (minor-version compatibility floor):
  torch.cuda says "The NVIDIA driver on your system is too old".

This module answers both before any host is touched. Pure functions: models and driver version
in, a PytorchChoice or Incompatible out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Mapping, Sequence

from gpufleet.catalog.compat import UNVERIFIED, CompatData, compat_data, packaged_mapping
from gpufleet.errors import CompatDataError, Incompatible
from gpufleet.catalog.gpus import GpuModel
from gpufleet.versions import at_least, major, major_minor, parse

NONE = "none"
KEY = "pytorch_version"


@dataclass(frozen=True)
class Variant:
    """One CUDA variant of one PyTorch release, e.g. 2.11 cu130."""

    release: str  # "2.11"
    name: str  # "cu130"
    cuda: str  # "13.0"
    archs: tuple[str, ...]  # TORCH_CUDA_ARCH_LIST entries: "9.0", "12.0+PTX"
    experimental: bool = False

    @property
    def sm_list(self) -> str:
        return ", ".join(_sm(a) for a in self.archs)


@dataclass(frozen=True)
class PytorchData:
    index_url: str  # with {variant}
    releases: Mapping[str, tuple[Variant, ...]]  # newest CUDA first
    status: Mapping[str, str]  # release -> verified | derived | secondary

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(sorted(self.releases, key=parse, reverse=True))


@dataclass(frozen=True)
class PytorchChoice:
    """The wheel to install: `pip install torch==<version>.* --index-url <index_url>`."""

    version: str  # "2.11"
    variant: str  # "cu130"
    cuda: str  # "13.0"
    index_url: str
    archs: tuple[str, ...]
    experimental: bool
    data_status: str
    notes: tuple[str, ...] = ()

    @property
    def pip(self) -> str:
        return f"pip install torch=={self.version}.* --index-url {self.index_url}"

    def describe(self) -> str:
        what = f"{self.version} {self.variant}" + (" (experimental in PyTorch's matrix)" if self.experimental else "")
        return f"{what}: {self.pip}"


def _sm(arch: str) -> str:
    base, _, ptx = arch.partition("+")
    return "sm_" + base.replace(".", "") + ("+PTX" if ptx else "")


def _variant_cuda(name: str) -> str:
    digits = name[2:]
    if not name.startswith("cu") or not digits.isdigit() or len(digits) < 3:
        raise CompatDataError(f"compat.yaml: pytorch: variant {name!r} is not cuXYZ")
    return f"{digits[:-1]}.{digits[-1]}"


def parse_pytorch(raw: Mapping[str, Any], data: CompatData | None = None) -> PytorchData:
    """The `pytorch` section of compat.yaml; releases marked unverified are dropped."""
    data = data or compat_data()
    section = raw.get("pytorch") or {}
    releases: dict[str, tuple[Variant, ...]] = {}
    status: dict[str, str] = {}
    for version, info in (section.get("releases") or {}).items():
        if not isinstance(version, str):
            raise CompatDataError(f"compat.yaml: pytorch.releases: {version!r} must be a quoted version")
        if info.get("status") == UNVERIFIED:
            continue
        variants = []
        for experimental, group in ((False, info.get("variants") or {}), (True, info.get("experimental") or {})):
            for name, archs in group.items():
                cuda = _variant_cuda(name)
                if cuda not in data.cuda_releases:
                    raise CompatDataError(f"compat.yaml: pytorch {version} {name}: CUDA {cuda} not in cuda_releases")
                if not archs:
                    raise CompatDataError(f"compat.yaml: pytorch {version} {name}: empty arch list")
                variants.append(Variant(version, name, cuda, tuple(str(a) for a in archs), experimental))
        releases[version] = tuple(sorted(variants, key=lambda v: parse(v.cuda), reverse=True))
        status[version] = str(info.get("status", ""))
    return PytorchData(index_url=str(section.get("index_url", "")), releases=releases, status=status)


@lru_cache(maxsize=1)
def pytorch_data() -> PytorchData:
    """The packaged PyTorch wheel data, parsed once per process."""
    return parse_pytorch(packaged_mapping())


@lru_cache(maxsize=1)
def unverified_releases() -> tuple[str, ...]:
    """Releases compat.yaml names but cannot decide on (so the grammar can say why). Parsed once
    per process, as pytorch_data(): the grammar asks for every host, and parsing compat.yaml
    took a third of a second each time."""
    releases = (packaged_mapping().get("pytorch") or {}).get("releases") or {}
    return tuple(v for v, info in releases.items() if info.get("status") == UNVERIFIED)


# --- coverage -----------------------------------------------------------------------------------


def _cc(text: str) -> tuple[int, int]:
    a, b = text.split(".")[:2]
    return int(a), int(b)


def kernel_for(model: GpuModel, variant: Variant) -> str | None:
    """"sass" if the wheel has a binary for the GPU, "ptx" if only PTX it can JIT, else None.

    SASS for X.Y runs on X.Z with Z >= Y (same major); PTX for X.Y runs, JIT-compiled, on any
    later compute capability."""
    cc = _cc(model.compute_capability)
    ptx = False
    for arch in variant.archs:
        base, _, extra = arch.partition("+")
        have = _cc(base)
        if have[0] == cc[0] and have[1] <= cc[1]:
            return "sass"
        if extra.upper() == "PTX" and have <= cc:
            ptx = True
    return "ptx" if ptx else None


def _driver_floor(variant: Variant, data: CompatData) -> str:
    family = data.cuda_families.get(major(variant.cuda))
    if family is None:
        raise Incompatible(f"CUDA {major(variant.cuda)}.x has no verified driver floor", key=KEY)
    return family.min_driver


def _why_not(models: Sequence[GpuModel], variant: Variant, driver: str, data: CompatData) -> str | None:
    """None if the variant runs on every GPU with this driver, else the reason `import torch` users meet."""
    floor = _driver_floor(variant, data)
    if not at_least(driver, floor):
        return (f"driver too old: CUDA {major(variant.cuda)}.x wheels need driver >= {floor}, the resolved driver "
                f"is {driver} (torch.cuda would fail with \"The NVIDIA driver on your system is too old\")")
    toolkit = data.cuda_releases[variant.cuda].toolkit_driver
    missing = []
    for model in _unique(models):
        kind = kernel_for(model, variant)
        if kind is None or (kind == "ptx" and not at_least(driver, toolkit)):
            missing.append(f"{model.name} (compute capability {model.compute_capability}) needs "
                           f"{_sm(model.compute_capability)}")
    if missing:
        return (f"no kernel image: built for {variant.sm_list}, " + ", ".join(missing)
                + " (CUDA kernels would fail with \"no kernel image is available for execution on the device\")")
    return None


def _unique(models: Sequence[GpuModel]) -> list[GpuModel]:
    return list({m.name: m for m in models}.values())


def fitting_releases(models: Sequence[GpuModel], driver: str, data: CompatData | None = None,
                     torch: PytorchData | None = None) -> list[str]:
    """PyTorch releases with at least one wheel that runs on every GPU with this driver."""
    data, torch = data or compat_data(), torch or pytorch_data()
    return [r for r in torch.versions
            if any(_why_not(models, v, driver, data) is None for v in torch.releases[r])]


#: torch/utils/cpp_extension.py _check_cuda_version: the host nvcc's CUDA against torch.version.cuda
#: (PT5 in compat.yaml): another major raises, another minor only warns
EXTENSION_MISMATCH = "The detected CUDA version ({0}) mismatches the version that was used to compile PyTorch ({1})"


def choose_pytorch(models: Sequence[GpuModel], wish: Any, driver: str, data: CompatData | None = None,
                   torch: PytorchData | None = None, host_cuda: str | None = None) -> PytorchChoice | None:
    """The newest CUDA variant of PyTorch ``wish`` that runs on every GPU of the host with
    ``driver`` (stable variants before experimental ones); None for ``wish`` none. Raises Incompatible naming the GPU, its compute capability
    and the missing architecture, or the driver floor.

    ``host_cuda``: the CUDA toolkit the host gets ("12.8"), or None. A wheel runs on its own
    bundled runtime whatever the host has, but CUDA extensions (torch.utils.cpp_extension) are
    built by the host's nvcc, which must have the wheel's CUDA major: a variant of that major
    is preferred, and a note says when none fits."""
    if wish in (None, NONE):
        return None
    data, torch = data or compat_data(), torch or pytorch_data()
    version = str(wish)
    variants = torch.releases.get(version)
    if variants is None:
        raise Incompatible(f"PyTorch {version} is not in the compatibility data", key=KEY,
                           allowed="none, " + ", ".join(torch.versions))
    reasons: dict[str, list[str]] = {}  # reason -> variants, so a shared reason is said once
    # stable variants first (newest CUDA first); an experimental one only when no stable one fits
    def rank(v: Variant) -> tuple[bool, bool]:
        return v.experimental, host_cuda is not None and major(v.cuda) != major(host_cuda)

    for variant in sorted(variants, key=rank):
        why = _why_not(models, variant, driver, data)
        if why is None:
            choice = _choice(variant, driver, data, torch)
            if host_cuda is not None and major(variant.cuda) != major(host_cuda):
                shown = ", ".join(v.name for v in variants if major(v.cuda) == major(host_cuda)) or "none"
                note = (f"PyTorch {version} {variant.name} (CUDA {variant.cuda}) and the host's CUDA toolkit "
                        f"{host_cuda} differ in major: building CUDA extensions with the host's nvcc fails "
                        f"(\"{EXTENSION_MISMATCH.format(host_cuda, variant.cuda)}\"); {version}'s CUDA "
                        f"{major(host_cuda)} variants: {shown}")
                choice = replace(choice, notes=(*choice.notes, note))
            return choice
        reasons.setdefault(why, []).append(variant.name)
    allowed = fitting_releases(models, driver, data, torch)
    said = "; ".join(f"{', '.join(names)}: {why}" for why, names in reasons.items())
    raise Incompatible(f"no PyTorch {version} wheel runs on this host: {said}", key=KEY,
                       allowed="none, " + ", ".join(allowed) if allowed else NONE)


def _choice(variant: Variant, driver: str, data: CompatData, torch: PytorchData) -> PytorchChoice:
    notes = []
    toolkit = data.cuda_releases[variant.cuda].toolkit_driver
    if not at_least(driver, toolkit):
        notes.append(f"PyTorch {variant.release} {variant.name} runs under CUDA minor-version compatibility "
                     f"(driver {driver} < {toolkit} of CUDA {variant.cuda}): kernels JIT-compiled from PTX may "
                     "fail with \"the provided PTX was compiled with an unsupported toolchain\"")
    status = torch.status.get(variant.release, "")
    return PytorchChoice(
        version=variant.release,
        variant=variant.name,
        cuda=variant.cuda,
        index_url=torch.index_url.format(variant=variant.name),
        archs=variant.archs,
        experimental=variant.experimental,
        data_status=status,
        notes=tuple(notes),
    )


# --- the build installed on a host --------------------------------------------------------------

NO_KERNEL_TEXT = "no kernel image is available for execution on the device"
TOO_OLD_TEXT = "The NVIDIA driver on your system is too old"


@dataclass(frozen=True)
class BuildVerdict:
    """What a host's installed PyTorch build means for its GPUs and driver (validation gate)."""

    status: str  # "pass" | "fail" | "unknown" (the arch list could not be read)
    message: str
    problems: tuple[str, ...] = ()  # one per failed rule: "driver too old: ..." / "no kernel image: ..."


def arch_entries(arch_list: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """torch.cuda.get_arch_list() -> (coverage entries in compat.yaml's form, arch-specific
    compute capabilities). "sm_86" -> "8.6", "sm_100f" -> "10.0" (a family build runs where
    the generic one does), "compute_120" -> "12.0+PTX"; "sm_90a" runs on 9.0 only, so it is
    returned apart. Entries not understood are left out."""
    archs: list[str] = []
    exact: list[str] = []
    for entry in arch_list:
        kind, _, code = str(entry).strip().partition("_")
        suffix = code[-1:] if code[-1:] in ("a", "f") else ""
        digits = code[:-1] if suffix else code
        if kind not in ("sm", "compute") or not digits.isdigit() or len(digits) < 2:
            continue
        cc = f"{int(digits[:-1])}.{digits[-1]}"
        if suffix == "a":
            exact.append(cc)
        else:
            archs.append(cc + ("+PTX" if kind == "compute" else ""))
    return tuple(archs), tuple(exact)


def check_build(models: Sequence[GpuModel], torch_version: str, cuda: str, arch_list: Sequence[str],
                driver: str | None, data: CompatData | None = None) -> BuildVerdict:
    """Does the installed CUDA build of PyTorch run on every GPU with the host's driver?

    The same rules as choose_pytorch, on what the host reports (torch.version.cuda and
    torch.cuda.get_arch_list()) instead of the published matrix: the driver must meet the CUDA
    family's floor; every GPU needs SASS of its major at a minor <= its own, or PTX of an older
    compute capability with a driver at least the one of the build's CUDA release."""
    data = data or compat_data()
    archs, exact = arch_entries(arch_list)
    built = ", ".join(arch_list)
    what = f"torch {torch_version} (CUDA {cuda}, built for {built or 'nothing listed'})"
    problems: list[str] = []
    family = data.cuda_families.get(major(cuda))
    if family is not None and driver and not at_least(driver, family.min_driver):
        problems.append(f"driver too old: CUDA {major(cuda)}.x builds need driver >= {family.min_driver}, the host "
                        f"runs {driver} (torch.cuda fails with \"{TOO_OLD_TEXT}\")")
    if not archs and not exact:
        if problems:
            return BuildVerdict("fail", f"{what}: " + "; ".join(problems), tuple(problems))
        return BuildVerdict("unknown", f"{what}: its architecture list is empty or not understood")
    release = data.cuda_releases.get(major_minor(cuda))
    variant = Variant(torch_version, "installed", cuda, archs or ("0.0",))
    missing, jit = [], []
    for model in _unique(models):
        if model.compute_capability in exact:
            continue
        kind = kernel_for(model, variant) if archs else None
        if kind == "ptx" and driver and release is not None and not at_least(driver, release.toolkit_driver):
            kind = None  # PTX of a newer toolkit than the driver: "unsupported toolchain"
        if kind is None:
            missing.append(f"{model.name} (compute capability {model.compute_capability}) needs "
                           f"{_sm(model.compute_capability)}")
        elif kind == "ptx":
            jit.append(model.name)
    if missing:
        problems.append("no kernel image: " + ", ".join(missing)
                        + f" (CUDA kernels fail with \"{NO_KERNEL_TEXT}\")")
    if problems:
        return BuildVerdict("fail", f"{what}: " + "; ".join(problems), tuple(problems))
    notes = [] if family is not None else [f"no verified driver floor for CUDA {major(cuda)}.x"]
    notes += [f"{', '.join(jit)} run{'s' if len(jit) == 1 else ''} by JIT from PTX (slow first start)"] if jit else []
    shown = ", ".join(f"{m.name} ({m.compute_capability})" for m in _unique(models))
    return BuildVerdict("pass", f"{what} runs on {shown} with driver {driver or '?'}"
                        + "".join(f"; {n}" for n in notes))


# --- mixed GPUs ---------------------------------------------------------------------------------


def mixed_gpus(models: Sequence[GpuModel]) -> str | None:
    """What a host with more than one GPU model means for jobs; None when all GPUs are alike."""
    counts: dict[str, int] = {}
    by_name: dict[str, GpuModel] = {}
    for m in models:
        counts[m.name] = counts.get(m.name, 0) + 1
        by_name[m.name] = m
    if len(counts) < 2:
        return None
    indices: dict[str, list[str]] = {}
    for i, m in enumerate(models):
        indices.setdefault(m.name, []).append(str(i))
    parts = ", ".join(f"{n} x {name} (compute capability {by_name[name].compute_capability})"
                      for name, n in counts.items())
    pins = "; ".join(f"{name}: CUDA_VISIBLE_DEVICES={','.join(idx)}" for name, idx in indices.items())
    return (f"mixed GPUs: {parts}. Different compute capability and memory: DDP and other collective jobs "
            f"run at the slowest GPU's pace and the smallest memory bounds the batch; every library must "
            f"cover every compute capability. Pin jobs to one model with CUDA_DEVICE_ORDER=PCI_BUS_ID and "
            f"{pins}")
