"""Pick driver, kernel-module flavour, CUDA, cuDNN and Fabric Manager for one host.

Pure functions: inputs are the host's GPUs (models or raw PCI ids), its wishes (`Wishes`: read
once, typed, from a Settings or any mapping with the same keys) and its OS release; every fact
comes from compat.yaml via compat.py.
A wish the data cannot satisfy raises Incompatible naming the key to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Self, Sequence

from gpufleet.facts.gpu import ClockPair

from gpufleet.catalog.compat import CompatData, DistroOffer, DriverBranch, compat_data
from gpufleet.errors import Incompatible
from gpufleet.catalog.gpu_support import stack_hint
from gpufleet.catalog.gpus import GpuModel, to_models
from gpufleet.catalog.pytorch import PytorchChoice, choose_pytorch, pytorch_data
from gpufleet.versions import at_least, branch_of, major, normalise_branch, parse

AUTO = "auto"
NONE = "none"

GpuList = Sequence[GpuModel] | Sequence[str] | Sequence[GpuModel | str]


@dataclass(frozen=True)
class Resolution:
    """What to install on one host. Versions are exact; package names are for apt."""

    source: str  # nvidia | distro
    os_release: str  # "debian-12"
    gpus: tuple[str, ...]  # model names, one per GPU
    driver_branch: str
    driver_version: str
    flavour: str  # open | proprietary
    driver_packages: tuple[str, ...]
    repo_os_dir: str | None  # CUDA repo directory for the OS (nvidia source)
    cuda_version: str | None
    cuda_package: str | None
    cudnn_version: str | None
    cudnn_package: str | None
    fabricmanager_needed: bool
    fabricmanager_package: str | None
    fabricmanager_version: str | None  # always == driver_version when needed
    fabric_extra_packages: tuple[str, ...]  # e.g. NVLink Subnet Manager on 4th-gen NVSwitch
    clock_method: str  # ac (nvidia-smi -ac) | lgc (-lgc/-lmc, R595+) | reset | none
    #: per model: the pair clock_policy asks for. Under `max` it is only the catalogue's estimate
    #: (None: no estimate): the host gets each GPU's own highest supported pair (gpufleet/plans/tuning.py)
    application_clocks: Mapping[str, ClockPair | None] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    #: NVIDIA's version-locking package for this exact driver (nvidia source, R580+), else None
    pinning_package: str | None = None
    #: upstream version each driver package must have once installed (driver packages, Fabric
    #: Manager and, for distro packages built from another source, their own version)
    package_versions: Mapping[str, str] = field(default_factory=dict)
    #: DCGM packages when driver_dcgm asks for them
    dcgm_packages: tuple[str, ...] = ()
    #: exact CUDA toolkit release cuda_package is installed and held at ("13.0.2"; nvidia source)
    cuda_release: str | None = None
    #: exact build of the cuDNN packages ("9.17.0.29") and the packages: runtime, -dev, -headers
    cudnn_release: str | None = None
    cudnn_packages: tuple[str, ...] = ()
    #: the PyTorch wheel (release, CUDA variant) that runs on every GPU with this driver, when asked for
    pytorch: PytorchChoice | None = None
    #: clock_policy max: application_clocks are the catalogue's estimate, not what is applied
    clocks_estimated: bool = False
    #: kernel modules packaged apart from driver_packages (Ubuntu's distro drivers): the prebuilt,
    #: signed package with "{kernel}" (`uname -r` or the kernel flavour), and the DKMS fallback;
    #: which one a host gets depends on its kernel (gpufleet/catalog/kernels.py module_packages)
    prebuilt_modules: str | None = None
    dkms_modules: str | None = None

    @property
    def stack_versions(self) -> dict[str, str]:
        """CUDA toolkit and cuDNN packages -> the exact upstream version each must have."""
        out = {self.cuda_package: self.cuda_release} if self.cuda_package and self.cuda_release else {}
        if self.cudnn_release:
            out.update((p, self.cudnn_release) for p in self.cudnn_packages)
        return out

    def describe(self) -> dict[str, Any]:
        """Ordered, printable summary for plan views."""
        return {
            "source": self.source,
            "os_release": self.os_release,
            "gpus": ", ".join(_count_names(self.gpus)),
            "driver": f"R{self.driver_branch} {self.driver_version} ({self.flavour})",
            "driver_packages": " ".join(self.driver_packages)
            + (f" (locked by {self.pinning_package})" if self.pinning_package else ""),
            **({"kernel_modules": f"{self.prebuilt_modules.format(kernel='<kernel>')} (prebuilt, signed), "
                                  f"else {self.dkms_modules} (DKMS)"} if self.prebuilt_modules else {}),
            "cuda": (f"{self.cuda_version} ({self.cuda_package})"
                     + (f" at {self.cuda_release}" if self.cuda_release else "")) if self.cuda_version else NONE,
            "cudnn": (f"{self.cudnn_version} ({' '.join(self.cudnn_packages) or self.cudnn_package})"
                      + (f" at {self.cudnn_release}" if self.cudnn_release else "")) if self.cudnn_version else NONE,
            "fabricmanager": (
                f"{self.fabricmanager_package} {self.fabricmanager_version}"
                + "".join(f" + {p}" for p in self.fabric_extra_packages)
                if self.fabricmanager_needed
                else "not needed"
            ),
            "clocks": self.clock_method
            + "".join(
                f"; {name} {pair.mem},{pair.gfx}" if pair else f"; {name} {MAX_UNKNOWN}"
                for name, pair in self.application_clocks.items()
            )
            + (f" ({MAX_ESTIMATE})" if self.clocks_estimated and any(self.application_clocks.values()) else ""),
            "pytorch": self.pytorch.describe() if self.pytorch else NONE,
            "notes": list(self.notes),
        }


#: clock_policy max has one meaning: each GPU's highest supported pair as its nvidia-smi reports
#: it (what -ac / -lgc,-lmc can apply). The catalogue's pair only estimates it before a host is seen.
MAX_ESTIMATE = "catalogue estimate; each GPU gets its own highest supported pair"
MAX_UNKNOWN = "its own highest supported pair (no catalogue estimate)"


def _count_names(names: Iterable[str]) -> list[str]:
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return [f"{n} x {name}" for name, n in counts.items()]


@dataclass(frozen=True)
class _FromSettings:
    """Built from a Settings (or any object with the fields' names as attributes) or from a
    mapping that may name only some of them: the rest keep their defaults."""

    @classmethod
    def of(cls, source: Any) -> Self:
        if isinstance(source, cls):
            return source
        names = {f.name for f in fields(cls)}
        if isinstance(source, Mapping):
            return cls(**{k: v for k, v in source.items() if k in names})
        return cls(**{k: getattr(source, k) for k in names if hasattr(source, k)})


@dataclass(frozen=True)
class Wishes(_FromSettings):
    """The settings the resolver reads (Settings has them all; a plain mapping, as tools/compat
    and the tests give, may name only some: the rest take these defaults)."""

    driver_source: str = "nvidia"
    driver_branch: str = AUTO
    driver_version: str = AUTO
    driver_flavour: str = AUTO
    driver_dcgm: bool = False
    cuda_version: str = NONE
    cuda_driver_compat: str = "toolkit"
    cudnn_version: str = NONE
    pytorch_version: str = NONE
    clock_policy: str | Mapping[str, int] = "default"
    monitoring_dcgm_exporter: bool = False


@dataclass(frozen=True)
class TierHardware(_FromSettings):
    """What a tier says its hosts have (the validate_* settings)."""

    tier: str = "?"
    validate_gpu_models: tuple[str, ...] = ()
    validate_gpu_count: int | tuple[int, int] | None = None
    validate_nvswitch: str = "any"  # required | absent | any
    validate_rdma: str = "any"
    validate_nvlink: str = "any"


def normalise_os(os_release: str | Sequence[str]) -> str:
    """("debian", "12") or "debian-12" -> "debian-12"."""
    if isinstance(os_release, str):
        return os_release.strip().lower().replace(" ", "-")
    name, version = os_release[0], os_release[1]
    return f"{str(name).strip().lower()}-{str(version).strip()}"


def _names(models: Iterable[GpuModel]) -> str:
    return ", ".join(sorted({m.name for m in models}))


# --- driver -------------------------------------------------------------------------------------


def _branches_for(models: Sequence[GpuModel], data: CompatData) -> list[str]:
    out = []
    for branch in sorted(data.usable_branches, key=int):
        info = data.driver_branches[branch]
        version = _newest_known(info)  # the default may be older than a GPU's first driver: a newer one fits
        if all(m.arch in info.architectures and (m.min_driver is None or at_least(version, m.min_driver)) for m in models):
            out.append(branch)
    return out


def _newest_known(info: DriverBranch) -> str:
    return max([info.default or "0", *info.versions], key=parse)


def driver_candidates(info: DriverBranch) -> list[str]:
    """The releases of a branch a `driver_version: auto` may resolve to, in the order tried: the
    branch's default, then each newer known release, oldest first. A toolkit update, a GPU or a
    cuDNN build may need a newer driver of the same branch than its default (CUDA 13.2 Update 2
    needs 595.71.05, R595's default is 595.45.04): the first release that fits is the one closest
    to the default, which is what NVIDIA's tables then support."""
    default = info.default or ""
    return [default, *sorted((v for v in info.versions if parse(v) > parse(default)), key=parse)]


def _check_driver(models: Sequence[GpuModel], info: DriverBranch, version: str, data: CompatData) -> None:
    allowed = ", ".join(f"R{b}" for b in _branches_for(models, data)) or "none"
    for model in models:
        if model.arch not in info.architectures:
            arch = data.architectures[model.arch]
            why = f"; the last branch for {model.arch} is R{arch.last_branch}" if arch.last_branch else ""
            raise Incompatible(
                f"{model.name} ({model.arch}) is not supported by driver branch R{info.branch}{why}"
                + stack_hint([model], data),
                key="driver_branch",
                allowed=allowed,
            )
        if model.min_driver and not at_least(version, model.min_driver):
            newest = _newest_known(info)
            raise Incompatible(
                f"{model.name} needs driver >= {model.min_driver}; "
                + (f"R{info.branch} resolves to {version}" if at_least(newest, model.min_driver)
                   else f"the newest known R{info.branch} release is {newest}"),
                key="driver_branch",
                allowed=allowed,
            )


def _pick_flavour(models: Sequence[GpuModel], branch: str, version: str, wish: str, data: CompatData) -> str:
    turing = data.generation(data.open_min_architecture)
    too_old = [m for m in models if m.generation < turing]
    not_listed = [m for m in models if m.first_open_driver and not at_least(version, m.first_open_driver)]
    needs_open = [m for m in models if m.open_required]
    open_ok = not too_old and not not_listed
    why_not_open = (
        f"open kernel modules need {data.open_min_architecture} or newer; {_names(too_old)} "
        f"{'is' if len(too_old) == 1 else 'are'} older"
        if too_old
        else "open kernel modules support "
        + ", ".join(f"{m.name} only from {m.first_open_driver}" for m in not_listed)
        + f" (resolved driver {version})"
    )
    if wish == "open":
        if not open_ok:
            raise Incompatible(why_not_open, key="driver_flavour", allowed="proprietary, auto")
        return "open"
    if wish == "proprietary":
        if needs_open:
            raise Incompatible(
                f"{_names(needs_open)} must use the open kernel modules (proprietary is unsupported there)",
                key="driver_flavour",
                allowed="open, auto",
            )
        return "proprietary"
    # auto
    if needs_open:
        if not open_ok:
            raise Incompatible(
                f"{_names(needs_open)} need open kernel modules but {why_not_open}; these GPUs cannot share a host",
                key="driver_flavour",
                allowed="one GPU generation per host",
            )
        return "open"
    if open_ok and int(branch) >= int(data.open_default_from_branch):
        return "open"
    return "proprietary"


def _nvidia_driver_packages(branch: str, flavour: str, data: CompatData) -> tuple[str, ...]:
    for scheme in data.nvidia_repo["driver_packages"]:
        if int(branch) >= int(scheme["from_branch"]):
            return tuple(p.format(branch=branch) for p in scheme[flavour])
    raise Incompatible(f"no package scheme for R{branch} in compat.yaml", key="driver_branch")


def _by_branch(schemes: Sequence[Mapping[str, Any]], branch: str, **fill: str) -> str | None:
    """The `name` of the first scheme whose from_branch <= branch, filled in; None if none fits."""
    for scheme in schemes or ():
        if int(branch) >= int(scheme["from_branch"]):
            return str(scheme["name"]).format(branch=branch, **fill)
    return None


# --- CUDA / cuDNN -------------------------------------------------------------------------------


def _check_cuda(models: Sequence[GpuModel], cuda: str, update: str | None, version: str, mode: str,
                data: CompatData) -> tuple[list[str], str | None]:
    """Check CUDA minor ``cuda`` (at the asked ``update``, or None) on driver ``version``; return the
    notes and the update to install: the asked one, else the newest the driver supports (S1 Table 3)."""
    notes: list[str] = []
    family = data.cuda_families.get(major(cuda))
    release = data.cuda_releases[cuda]
    if family is None:
        raise Incompatible(f"CUDA {major(cuda)}.x has no verified driver floor", key="cuda_version")
    supported = [c for c in data.cuda_releases if _cuda_fits(models, c, None, version, mode, data)]
    if update is not None:  # the other updates of the asked minor this driver takes
        supported += [u for u in release.updates if _cuda_fits(models, cuda, u, version, mode, data)]
    allowed = "none, " + ", ".join(sorted(supported, key=parse, reverse=True)) if supported else NONE
    if not at_least(version, family.min_driver):
        raise Incompatible(
            f"CUDA {cuda} needs driver >= {family.min_driver} (CUDA {family.major}.x family); driver is {version}",
            key="cuda_version",
            allowed=allowed,
        )
    native = release.updates_for(version)
    chosen = update or (native[0] if native else release.release)
    floor = release.updates.get(chosen or "", release.toolkit_driver)
    if mode == "toolkit" and not at_least(version, floor):
        floors = ", ".join(f"{u} >= {d}" for u, d in release.updates.items())
        lowest = floor if update else min(release.updates.values(), key=parse, default=floor)
        raise Incompatible(
            f"CUDA {chosen if update else cuda} needs driver >= {lowest}; driver is {version} (NVIDIA's Table 3: "
            f"{floors}; cuda_driver_compat: minor accepts the family floor with limited features)",
            key="cuda_version",
            allowed=allowed,
        )
    if mode == "minor" and not at_least(version, floor):
        notes.append(f"CUDA {chosen} runs in minor-version compatibility (driver {version} < {floor})")
    for model in models:
        if parse(model.compute_capability) < parse(family.min_compute_capability):
            raise Incompatible(
                f"CUDA {family.major}.x drops compute capability < {family.min_compute_capability}; "
                f"{model.name} is {model.compute_capability}" + stack_hint([model], data),
                key="cuda_version",
                allowed=allowed,
            )
        arch = data.architectures[model.arch]
        if arch.first_cuda and parse(cuda) < parse(arch.first_cuda):
            raise Incompatible(
                f"{model.name} ({model.arch}) needs CUDA >= {arch.first_cuda}", key="cuda_version", allowed=allowed
            )
        if arch.last_cuda_major and int(major(cuda)) > int(arch.last_cuda_major):
            raise Incompatible(
                f"{model.arch} GPUs end with CUDA {arch.last_cuda_major}.x; {model.name} cannot use CUDA {cuda}"
                + stack_hint([model], data),
                key="cuda_version",
                allowed=allowed,
            )
    return notes, chosen


def _cuda_fits(models: Sequence[GpuModel], cuda: str, update: str | None, version: str, mode: str,
               data: CompatData) -> bool:
    try:
        _check_cuda_quiet(models, cuda, update, version, mode, data)
    except Incompatible:
        return False
    return True


def _check_cuda_quiet(models: Sequence[GpuModel], cuda: str, update: str | None, version: str, mode: str,
                      data: CompatData) -> None:
    family = data.cuda_families.get(major(cuda))
    release = data.cuda_releases[cuda]
    if family is None or not at_least(version, family.min_driver):
        raise Incompatible("driver")
    if mode == "toolkit" and not (at_least(version, release.updates[update]) if update else release.updates_for(version)):
        raise Incompatible("driver")
    for model in models:
        arch = data.architectures[model.arch]
        if parse(model.compute_capability) < parse(family.min_compute_capability):
            raise Incompatible("cc")
        if arch.first_cuda and parse(cuda) < parse(arch.first_cuda):
            raise Incompatible("first")
        if arch.last_cuda_major and int(major(cuda)) > int(arch.last_cuda_major):
            raise Incompatible("last")


def cudnn_covers(listed: Sequence[str], cc: str) -> bool:
    """Whether a cuDNN build whose support-matrix row lists compute capabilities ``listed`` runs on
    a GPU of ``cc``: listed, or a listed one of the same major and a lower minor (CUDA's binary
    compatibility: SASS for X.y runs on X.z, z >= y). The matrix names architectures beside the
    CCs ("NVIDIA Blackwell": 10.0, 12.0) and is silent on 10.3 (B300) and 12.1; this rule reads
    them as their architecture's row does."""
    have = parse(cc)
    return any(c == cc or (major(c) == major(cc) and parse(c) <= have) for c in listed)


def _check_cudnn(models: Sequence[GpuModel], cudnn: str, cuda: str, version: str, data: CompatData) -> None:
    same_major = [b for b in data.cudnn_builds if b.cuda_major == major(cuda)]
    builds = [b for b in same_major if b.version == cudnn]
    fitting = sorted(
        {
            b.version
            for b in same_major
            if cuda in b.cuda_versions
            and at_least(version, b.min_driver)
            and all(cudnn_covers(b.compute_capabilities, m.compute_capability) for m in models)
        },
        key=parse,
        reverse=True,
    )
    allowed = "none, " + ", ".join(fitting) if fitting else NONE
    if not builds:
        raise Incompatible(f"cuDNN {cudnn} has no verified build for CUDA {major(cuda)}.x", key="cudnn_version", allowed=allowed)
    for_cuda = [b for b in builds if cuda in b.cuda_versions]
    if not for_cuda:
        listed = sorted({v for b in builds for v in b.cuda_versions}, key=parse)
        raise Incompatible(
            f"cuDNN {cudnn} supports CUDA {', '.join(listed)}, not {cuda}", key="cudnn_version", allowed=allowed
        )
    problems = []
    for build in for_cuda:
        missing = [m for m in models if not cudnn_covers(build.compute_capabilities, m.compute_capability)]
        if missing:
            problems.append(
                f"cuDNN {cudnn} for CUDA {cuda} does not support compute capability "
                + ", ".join(sorted({f"{m.compute_capability} ({m.name})" for m in missing}))
            )
        elif not at_least(version, build.min_driver):
            problems.append(f"cuDNN {cudnn} for CUDA {cuda} needs driver >= {build.min_driver}; driver is {version}")
        else:
            return
    raise Incompatible(problems[-1], key="cudnn_version", allowed=allowed)


def exact_cuda(cuda: str, data: CompatData) -> str:
    """The CUDA minor a user's `cuda_version` names: "13.2", or one of its updates "13.2.0" / "13.2.2"."""
    return cuda_wish(cuda, data)[0]


def cuda_wish(cuda: str, data: CompatData) -> tuple[str, str | None]:
    """A `cuda_version` as (minor, asked update or None): "13.2" -> ("13.2", None), "13.2.0" (GA)
    -> ("13.2", "13.2.0"). An update not in NVIDIA's Table 3 rows of compat.yaml is refused."""
    if cuda in data.cuda_releases:
        return cuda, None
    minor = ".".join(cuda.split(".")[:2])
    release = data.cuda_releases.get(minor)
    if release is not None and cuda in release.updates:
        return minor, cuda
    raise Incompatible(
        f"CUDA {cuda} is not a release in the compatibility data"
        + (f" (CUDA {minor}'s updates: {', '.join(release.updates)})" if release and release.updates else ""),
        key="cuda_version",
        allowed="none, " + ", ".join(sorted(data.cuda_releases, key=parse, reverse=True))
        + ("".join(f", {u}" for u in reversed(list(release.updates))) if release else ""),
    )


def exact_cudnn(cudnn: str, data: CompatData) -> str:
    """The cuDNN release a user's `cudnn_version` names: "9.17.0", or "9.17" = newest 9.17.x."""
    known = data.cudnn_versions
    if cudnn in known:
        return cudnn
    matches = [v for v in known if v.startswith(cudnn + ".")]
    if matches:
        return matches[0]
    raise Incompatible(f"cuDNN {cudnn} is not a release in the compatibility data", key="cudnn_version",
                       allowed="none, " + ", ".join(known))


def _cudnn_build(cudnn: str, cuda: str, data: CompatData) -> str:
    """The exact package build of cuDNN ``cudnn`` for CUDA ``cuda`` (package_version in compat.yaml)."""
    builds = {b.package_version for b in data.cudnn_builds
              if b.version == cudnn and cuda in b.cuda_versions and b.package_version}
    if not builds:
        known = sorted({b.version for b in data.cudnn_builds if b.package_version and cuda in b.cuda_versions},
                       key=parse, reverse=True)
        raise Incompatible(f"cuDNN {cudnn} has no known package build for CUDA {cuda} in compat.yaml, so no exact "
                           "version to install", key="cudnn_version", allowed="none, " + ", ".join(known))
    return max(builds, key=parse)


# --- clocks -------------------------------------------------------------------------------------


def _clocks(models: Sequence[GpuModel], policy: Any, branch: str, data: CompatData) -> tuple[str, dict[str, Any], list[str]]:
    notes: list[str] = []
    method = "lgc" if int(branch) >= int(data.app_clocks_deprecated_from_branch) else "ac"
    if policy == "unmanaged":
        return "none", {}, notes
    if policy == "default":
        return "reset", {}, notes
    pairs: dict[str, ClockPair | None] = {}
    for model in {m.name: m for m in models}.values():
        if policy == "max":
            pairs[model.name] = model.max_clocks
            if model.max_clocks is None:
                notes.append(f"no catalogue clocks for {model.name}: its highest supported pair is read from the "
                             "GPU when tuning runs")
            continue
        wanted = ClockPair(int(policy["memory"]), int(policy["graphics"]))
        top = model.max_clocks
        if top and (wanted.mem > top.mem or wanted.gfx > top.gfx):
            raise Incompatible(
                f"clock pair {wanted.mem},{wanted.gfx} exceeds {model.name} max "
                f"{top.mem},{top.gfx}",
                key="clock_policy",
                allowed=f"memory <= {top.mem} and graphics <= {top.gfx}, or max | default | unmanaged",
            )
        if model.supported_memory_mhz and wanted.mem not in model.supported_memory_mhz:
            raise Incompatible(
                f"{model.name} supports memory clocks {', '.join(map(str, model.supported_memory_mhz))} MHz, "
                f"not {wanted.mem}",
                key="clock_policy",
                allowed=", ".join(map(str, model.supported_memory_mhz)),
            )
        if top is None:
            notes.append(f"no verified clocks for {model.name}: pair {wanted.mem},{wanted.gfx} unchecked")
        pairs[model.name] = wanted
    if method == "lgc":
        notes.append(f"application clocks are deprecated from R{data.app_clocks_deprecated_from_branch}: lock clocks with -lgc/-lmc")
    return method, pairs, notes


def _eol_note(info: DriverBranch, data: CompatData) -> list[str]:
    if info.eol == "EOL":
        return [f"driver branch R{info.branch} is end of life"]
    if info.eol and parse(info.eol.replace("-", ".")) < parse(data.as_of.replace("-", ".")):
        return [f"driver branch R{info.branch} reached end of life in {info.eol}"]
    return []


# --- entry points -------------------------------------------------------------------------------


def resolve(
    gpus: GpuList,
    wishes: Wishes | Mapping[str, Any] | object,
    os_release: str | Sequence[str],
    *,
    nvswitch: bool | None = None,
    data: CompatData | None = None,
) -> Resolution:
    """Resolve what to install for ``gpus`` given ``wishes`` on ``os_release``.

    gpus: GpuModel objects, raw PCI device ids ("0x2335") or nvidia-smi names; NVSwitch PCI ids in
    the list count as an NVSwitch fabric. ``nvswitch`` overrides that detection when given.
    Raises Incompatible with the reason and the key to change.
    """
    data = data or compat_data()
    models, unknown, seen_nvswitch = to_models(gpus)
    if unknown:
        raise Incompatible(f"unknown GPU PCI id(s) {', '.join(unknown)}: not in compat.yaml", key=None)
    if not models:
        raise Incompatible("no NVIDIA GPU given", key=None)
    os_name = normalise_os(os_release)
    has_nvswitch = seen_nvswitch if nvswitch is None else nvswitch
    wishes = Wishes.of(wishes)
    # A fleet's hosts share a few (hardware, settings, OS) combinations: each is resolved once
    # per process (a Resolution is frozen), not once per host (bench/controller.py: ~0.5 ms a
    # host). Refusals are not remembered: they stop a run.
    try:
        key: Any = (tuple(models), wishes, os_name, has_nvswitch, id(data))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _RESOLVED and _RESOLVED[key][0] is data:
        return _RESOLVED[key][1]
    found = _resolve(models, wishes, os_name, has_nvswitch, data)
    if key is not None:
        _RESOLVED[key] = (data, found)
    return found


#: (models, wishes, OS, NVSwitch, id(data)) -> (data, its resolution); data kept so its id stays its own
_RESOLVED: dict[Any, tuple[CompatData, Resolution]] = {}


def _resolve(models: list[GpuModel], wishes: Wishes, os_name: str, has_nvswitch: bool, data: CompatData) -> Resolution:
    source = wishes.driver_source
    branch_wish = AUTO if wishes.driver_branch == AUTO else normalise_branch(wishes.driver_branch)

    if source == "nvidia" and branch_wish == AUTO:
        refusals: list[tuple[str, Incompatible]] = []
        for branch in data.auto_branch_preference:
            try:
                return _resolve_on(models, wishes, os_name, has_nvswitch, data, source, branch, auto=True)
            except Incompatible as exc:
                refusals.append((branch, exc))
        hint = stack_hint(models, data)  # said once, not once per branch
        reason = ("no driver branch fits: " + "; ".join(f"R{b}: {exc.reason.replace(hint, '') if hint else exc.reason}"
                                                        for b, exc in refusals) + hint)
        fitting = _branches_for(models, data)
        keys = dict.fromkeys(exc.key for b, exc in refusals if b in fitting and exc.key)
        for key in keys:
            values = _values_that_fit(key, models, wishes, os_name, has_nvswitch, data)
            if values:  # every branch is already tried: the key whose change fixes it is another one
                raise Incompatible(reason, key=key, allowed=", ".join(values))
        # every branch that drives the GPUs refused for one other wish (driver_flavour: open on
        # Pascal, proprietary on Blackwell): that wish is the key, with what it allows
        if len(keys) == 1 and (only := next(iter(keys))) not in ("driver_branch", None):
            first = next(exc for b, exc in refusals if b in fitting and exc.key == only)
            raise Incompatible(reason, key=only, allowed=first.allowed)
        raise Incompatible(reason, key="driver_branch", allowed=", ".join(f"R{b}" for b in fitting) or "none")
    return _resolve_on(models, wishes, os_name, has_nvswitch, data, source, branch_wish, auto=False)


def _values_that_fit(key: str, models: list[GpuModel], wishes: Wishes, os_name: str, has_nvswitch: bool,
                     data: CompatData) -> list[str]:
    """The values of ``key`` (a version wish) with which some driver branch fits, the other
    wishes unchanged; [] for other keys, or when no value of it helps."""
    candidates = {
        "cuda_version": lambda: sorted(data.cuda_releases, key=parse, reverse=True),
        "cudnn_version": lambda: list(data.cudnn_versions),
        "pytorch_version": lambda: list(pytorch_data().versions),
    }.get(key)
    if candidates is None:
        return []
    fits = []
    for value in [NONE, *candidates()]:
        changed = replace(wishes, **{key: value})  # type: ignore[arg-type]  # key: one of the version wishes (str)
        for branch in data.auto_branch_preference:
            try:
                _resolve_on(models, changed, os_name, has_nvswitch, data, "nvidia", branch, auto=True)
            except Incompatible:
                continue
            fits.append(value)
            break
    return fits


def _distro_candidates(os_name: str, data: CompatData, branch_wish: str | None, version_wish: str,
                       cuda: str, update: str | None, cudnn: str) -> tuple[DistroOffer, str, list[str]]:
    """driver_source distro: the OS's one offer, its branch and its one driver (or why not)."""
    offer = data.distro_offers.get(os_name)
    if offer is None:
        raise Incompatible(
            f"{os_name} has no distribution driver packages in compat.yaml",
            key="driver_source",
            allowed="nvidia, or distro on " + ", ".join(data.distro_offers),
        )
    if branch_wish not in (AUTO, offer.driver_branch):
        raise Incompatible(
            f"{os_name} ships driver branch R{offer.driver_branch} only, not R{branch_wish}",
            key="driver_branch",
            allowed=f"auto, {offer.driver_branch}",
        )
    if version_wish not in (AUTO, offer.driver_version):
        raise Incompatible(
            f"{os_name} ships driver {offer.driver_version} only, not {version_wish}",
            key="driver_version",
            allowed=f"auto, {offer.driver_version}",
        )
    if cuda != NONE and offer.cuda_version is None:
        raise Incompatible(
            f"{os_name}'s own CUDA toolkit has no verified driver floor in compat.yaml: a host CUDA "
            "toolkit needs driver_source nvidia (NVIDIA's CUDA repository)",
            key="cuda_version",
            allowed="none",
        )
    if cuda not in (NONE, offer.cuda_version) or update is not None:
        raise Incompatible(
            f"{os_name} ships CUDA toolkit {offer.cuda_version} only (its own build), not "
            f"{update or cuda}",
            key="cuda_version",
            allowed=f"none, {offer.cuda_version}",
        )
    if cudnn != NONE and not offer.cudnn:
        raise Incompatible(f"{os_name} does not package cuDNN", key="cudnn_version", allowed="none")
    return offer, offer.driver_branch, [offer.driver_version]


def _nvidia_candidates(os_name: str, data: CompatData, branch_wish: str | None, version_wish: str,
                       auto: bool) -> tuple[str, list[str]]:
    """driver_source nvidia: the branch and the drivers to try, newest first (or why not)."""
    if os_name not in data.nvidia_repo["os_dirs"]:
        raise Incompatible(
            f"the NVIDIA CUDA repo has no {os_name} directory in compat.yaml",
            key="validate_os_release",
            allowed=", ".join(data.nvidia_repo["os_dirs"]),
        )
    branch = branch_wish or ""
    info = data.driver_branches.get(branch)
    if info is None or not info.usable:
        raise Incompatible(
            f"driver branch R{branch} is not usable from the compatibility data",
            key="driver_branch",
            allowed=", ".join(data.usable_branches),
        )
    if version_wish == AUTO or auto:
        candidates = driver_candidates(info)
    else:
        candidates = [str(version_wish)]
        if version_wish not in info.versions or branch_of(version_wish) != branch:
            raise Incompatible(
                f"driver {version_wish} is not a known R{branch} release",
                key="driver_version",
                allowed="auto, " + ", ".join(info.versions),
            )
    return branch, candidates


def _resolve_on(
    models: list[GpuModel],
    wishes: Wishes,
    os_name: str,
    has_nvswitch: bool,
    data: CompatData,
    source: str,
    branch_wish: str | None,
    auto: bool,
) -> Resolution:
    version_wish = wishes.driver_version
    cuda = wishes.cuda_version
    cudnn = wishes.cudnn_version
    cuda, update = (cuda, None) if cuda == NONE else cuda_wish(cuda, data)
    cudnn = cudnn if cudnn == NONE else exact_cudnn(cudnn, data)
    offer: DistroOffer | None = None

    if source == "distro":
        offer, branch, candidates = _distro_candidates(os_name, data, branch_wish, version_wish, cuda, update, cudnn)
    elif source == "nvidia":
        branch, candidates = _nvidia_candidates(os_name, data, branch_wish, version_wish, auto)
    else:
        raise Incompatible(f"unknown driver source {source!r}", key="driver_source", allowed="nvidia, distro")

    refusals: list[Incompatible] = []
    for version in candidates:
        try:
            return _resolve_at(models, wishes, os_name, has_nvswitch, data, source, branch, version, offer,
                               cuda, update, cudnn)
        except Incompatible as exc:
            refusals.append(exc)
    # every release of the branch refused: the newest one's reason is what the branch cannot do
    raise refusals[-1]


def _host_cuda(models: list[GpuModel], cuda: str, update: str | None, version: str, mode: str,
               offer: DistroOffer | None, data: CompatData) -> tuple[list[str], str | None, str | None, str | None]:
    """(notes, CUDA toolkit version, package, exact release) of the host's toolkit (Nones: none)."""
    if cuda == NONE:
        return [], None, None, None
    notes, chosen_update = _check_cuda(models, cuda, update, version, mode, data)
    if offer is not None:
        return notes, cuda, offer.cuda_package, None  # Debian's own version, whatever the release ships
    cuda_major, cuda_minor = cuda.split(".")[:2]
    if chosen_update is None:
        raise Incompatible(f"CUDA {cuda} has no exact release in compat.yaml", key="cuda_version")
    return (notes, cuda, data.nvidia_repo["cuda_package"].format(cuda_major=cuda_major, cuda_minor=cuda_minor),
            chosen_update)


def _host_cudnn(models: list[GpuModel], cudnn: str, cuda: str, version: str, data: CompatData
                ) -> tuple[str | None, str | None, str | None, tuple[str, ...]]:
    """(cuDNN version, package, exact build, packages) of the host's cuDNN (Nones: none)."""
    if cudnn == NONE:
        return None, None, None, ()
    if cuda == NONE:
        raise Incompatible(
            "a host cuDNN needs a host CUDA toolkit; cuda_version is none", key="cudnn_version", allowed="none"
        )
    _check_cudnn(models, cudnn, cuda, version, data)
    package = data.nvidia_repo["cudnn_package"].format(cudnn_major=major(cudnn), cuda_major=major(cuda))
    packages = tuple(p.format(cudnn_major=major(cudnn), cuda_major=major(cuda))
                     for p in data.nvidia_repo.get("cudnn_packages", [data.nvidia_repo["cudnn_package"]]))
    return cudnn, package, _cudnn_build(cudnn, cuda, data), packages


def _fabric(models: list[GpuModel], has_nvswitch: bool, offer: DistroOffer | None, os_name: str, branch: str,
            version: str, data: CompatData) -> tuple[bool, str | None, str | None, tuple[str, ...], list[str]]:
    """(Fabric Manager needed, its package, its version, extra fabric packages, notes)."""
    off_host = [m for m in models if m.fabric == "off_host"]
    fm_needed = has_nvswitch and not off_host
    fm_package = fm_version = None
    fabric_extra: tuple[str, ...] = ()
    notes: list[str] = []
    if fm_needed:
        if offer is not None:
            raise Incompatible(
                f"NVSwitch systems need Fabric Manager {version}, which {os_name} does not package",
                key="driver_source",
                allowed="nvidia",
            )
        fm_package = _by_branch(data.nvidia_repo["fabricmanager_packages"], branch)
        fm_version = version  # must equal the driver version exactly [S17]
        if any(m.needs_nvlsm for m in models):
            fabric_extra = (data.nvidia_repo["nvlsm_package"],)
    if off_host and has_nvswitch:
        notes.append(f"{_names(off_host)}: NVSwitch fabric is managed off-host; no Fabric Manager on the host")
    return fm_needed, fm_package, fm_version, fabric_extra, notes


def _pinned_versions(offer: DistroOffer | None, driver_packages: Sequence[str], branch: str, version: str,
                     fm_package: str | None, data: CompatData) -> tuple[str | None, dict[str, str]]:
    """(the pinning package, package -> version) of the driver's packages."""
    pinning = None
    if offer is not None:
        versions = {p: offer.package_versions.get(p, version) for p in driver_packages}
    else:
        pinning = _by_branch(data.nvidia_repo.get("pinning_packages", ()), branch, version=version)
        versions = {p: version for p in driver_packages}
    if fm_package:
        versions[fm_package] = version
    return pinning, versions


def _dcgm_packages(wishes: Wishes, offer: DistroOffer | None, os_name: str, cuda_version: str | None, branch: str,
                   data: CompatData) -> tuple[str, ...]:
    # the DCGM exporter (monitoring_dcgm_exporter) needs the host engine: installed and held here, with the driver
    if not (wishes.driver_dcgm or wishes.monitoring_dcgm_exporter):
        return ()
    if offer is not None:
        key = "driver_dcgm" if wishes.driver_dcgm else "monitoring_dcgm_exporter"
        raise Incompatible(f"{os_name} does not package DCGM (NVIDIA's CUDA repository does)", key=key,
                           allowed="false, or driver_source nvidia")
    dcgm_cuda = major(cuda_version) if cuda_version else major(_branch_cuda(branch, data))
    return tuple(p.format(cuda_major=dcgm_cuda) for p in data.nvidia_repo["dcgm_packages"])


def _pytorch_for(models: list[GpuModel], wishes: Wishes, version: str, offer: DistroOffer | None, cuda: str,
                 data: CompatData) -> PytorchChoice | None:
    # every GPU must be covered by the wheel: in auto mode a branch whose driver is too old for it is skipped
    try:
        host_cuda = (offer.cuda_version if offer is not None else cuda) if cuda != NONE else None
        return choose_pytorch(models, wishes.pytorch_version, version, data, host_cuda=host_cuda)
    except Incompatible as refused:  # a GPU only an older stack supports: say which stack
        hint = stack_hint(models, data) if "no kernel image" in refused.reason else ""
        raise Incompatible(refused.reason + hint, key=refused.key, allowed=refused.allowed) from None


def _resolve_at(
    models: list[GpuModel],
    wishes: Wishes,
    os_name: str,
    has_nvswitch: bool,
    data: CompatData,
    source: str,
    branch: str,
    version: str,
    offer: DistroOffer | None,
    cuda: str,
    update: str | None,
    cudnn: str,
) -> Resolution:
    """The resolution on one exact driver ``version`` of ``branch``; Incompatible if it cannot be."""
    mode = wishes.cuda_driver_compat
    notes: list[str] = []
    info = data.driver_branches[branch]
    _check_driver(models, info, version, data)
    notes += _eol_note(info, data)
    flavour = _pick_flavour(models, branch, version, wishes.driver_flavour, data)
    if offer is not None:
        driver_packages = offer.driver_packages.get(flavour)
        if not driver_packages:
            raise Incompatible(f"{os_name} has no {flavour} kernel-module package", key="driver_flavour")
    else:
        driver_packages = _nvidia_driver_packages(branch, flavour, data)

    cuda_notes, cuda_version, cuda_package, cuda_release = _host_cuda(models, cuda, update, version, mode, offer, data)
    notes += cuda_notes
    cudnn_version, cudnn_package, cudnn_release, cudnn_packages = _host_cudnn(models, cudnn, cuda, version, data)

    fm_needed, fm_package, fm_version, fabric_extra, fabric_notes = _fabric(models, has_nvswitch, offer, os_name,
                                                                           branch, version, data)
    notes += fabric_notes

    method, pairs, clock_notes = _clocks(models, wishes.clock_policy, branch, data)
    notes += clock_notes

    pinning, versions = _pinned_versions(offer, driver_packages, branch, version, fm_package, data)
    dcgm = _dcgm_packages(wishes, offer, os_name, cuda_version, branch, data)
    pytorch = _pytorch_for(models, wishes, version, offer, cuda, data)
    notes += pytorch.notes if pytorch else ()

    return Resolution(
        source=source,
        os_release=os_name,
        gpus=tuple(m.name for m in models),
        driver_branch=branch,
        driver_version=version,
        flavour=flavour,
        driver_packages=tuple(driver_packages),
        repo_os_dir=data.nvidia_repo["os_dirs"].get(os_name) if offer is None else None,
        cuda_version=cuda_version,
        cuda_package=cuda_package,
        cudnn_version=cudnn_version,
        cudnn_package=cudnn_package,
        fabricmanager_needed=fm_needed,
        fabricmanager_package=fm_package,
        fabricmanager_version=fm_version,
        fabric_extra_packages=fabric_extra,
        clock_method=method,
        application_clocks=MappingProxyType(pairs),
        clocks_estimated=wishes.clock_policy == "max",
        notes=tuple(notes),
        pinning_package=pinning,
        package_versions=MappingProxyType(versions),
        dcgm_packages=dcgm,
        cuda_release=cuda_release,
        cudnn_release=cudnn_release,
        cudnn_packages=cudnn_packages,
        pytorch=pytorch,
        prebuilt_modules=offer.prebuilt_modules.get(flavour) if offer is not None else None,
        dkms_modules=offer.dkms_modules.get(flavour) if offer is not None else None,
    )


def _branch_cuda(branch: str, data: CompatData) -> str:
    """The newest CUDA release whose family floor this branch meets (DCGM build to pick)."""
    fitting = [c for c, rel in data.cuda_releases.items()
               if (fam := data.cuda_families.get(major(c))) and at_least(data.driver_branches[branch].default or "0", fam.min_driver)]
    return max(fitting, key=parse) if fitting else "12.0"


def check_tier_hardware(
    settings: TierHardware | Mapping[str, Any] | object,
    gpus: GpuList,
    nvswitch: bool,
    rdma: bool,
    nvlink: bool | None = None,
) -> list[str]:
    """Compare the host's declared tier with what facts found; one message per mismatch.

    An empty list means the hardware matches. What to do with mismatches is ``tier_mismatch``.
    """
    hw = TierHardware.of(settings)
    tier = hw.tier
    problems: list[str] = []
    models, unknown, seen_nvswitch = to_models(gpus)
    nvswitch = nvswitch or seen_nvswitch
    for pci in unknown:
        problems.append(f"tier {tier}: GPU with PCI id {pci} is not in the compatibility data")
    expected = tuple(hw.validate_gpu_models or ())
    found = _count_names(m.name for m in models)
    if expected:
        wrong = sorted({m.name for m in models if m.name not in expected})
        if wrong:
            problems.append(
                f"tier {tier} expects GPU models {', '.join(expected)}; found {', '.join(found)}"
            )
    count = hw.validate_gpu_count
    if count is not None:
        low, high = (count, count) if isinstance(count, int) else tuple(count)
        total = len(models) + len(unknown)
        if not low <= total <= high:
            want = f"{low}" if low == high else f"{low}-{high}"
            problems.append(f"tier {tier} expects {want} GPUs; found {total}" + (f" ({', '.join(found)})" if found else ""))
    for want, label, present in (
        (hw.validate_nvswitch, "an NVSwitch fabric (PCI class 0x0680)", nvswitch),
        (hw.validate_rdma, "RDMA NICs (InfiniBand/RoCE)", rdma),
        (hw.validate_nvlink, "NVLink between GPUs", nvlink),
    ):
        if present is None or want == "any":
            continue
        if want == "required" and not present:
            problems.append(f"tier {tier} expects {label}; none found")
        elif want == "absent" and present:
            problems.append(f"tier {tier} expects no {label}; found one")
    return problems
