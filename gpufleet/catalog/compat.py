"""Typed, read-only view of gpufleet/data/compat.yaml.

Every driver, CUDA, cuDNN and GPU fact the resolver uses comes from that file; this module only
parses it. Values whose status is ``unverified`` are dropped here, so no decision can rest on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from gpufleet import yamlload
from gpufleet.errors import CompatDataError
from gpufleet.versions import at_least, is_version, parse

SUPPORTED_SCHEMA = 1
UNVERIFIED = "unverified"


@dataclass(frozen=True)
class CudaFamily:
    major: str
    min_driver: str
    min_compute_capability: str


@dataclass(frozen=True)
class CudaRelease:
    version: str  # "13.0"
    ga_driver: str
    toolkit_driver: str  # driver of the newest update of this minor
    release: str | None = None  # that update ("13.0.2"): the version cuda-toolkit-X-Y is held at
    #: every update of the minor ("13.0.0" GA, "13.0.1", ...) -> its Table 3 driver, oldest first
    updates: Mapping[str, str] = field(default_factory=dict)

    def updates_for(self, driver: str) -> tuple[str, ...]:
        """The updates whose Table 3 driver ``driver`` meets, newest first."""
        return tuple(u for u in reversed(list(self.updates)) if at_least(driver, self.updates[u]))


@dataclass(frozen=True)
class CudnnBuild:
    version: str
    cuda_major: str
    cuda_versions: tuple[str, ...]
    min_driver: str
    compute_capabilities: tuple[str, ...]
    package_version: str | None = None  # the apt packages' build ("9.17.0.29"); None: not installable


@dataclass(frozen=True)
class Architecture:
    name: str
    generation: int
    last_branch: str | None = None
    last_cuda_major: str | None = None
    first_cuda: str | None = None
    open_required: bool = False


@dataclass(frozen=True)
class DriverBranch:
    branch: str
    usable: bool
    type: str | None = None
    eol: str | None = None
    architectures: tuple[str, ...] = ()
    default: str | None = None
    versions: Mapping[str, str] = field(default_factory=dict)  # full version -> status
    note: str | None = None


@dataclass(frozen=True)
class DistroOffer:
    os: str  # "debian-12"
    driver_branch: str
    driver_version: str
    cuda_version: str | None  # None: the distribution's toolkit is not offered (no verified row)
    cuda_package: str | None
    driver_packages: Mapping[str, tuple[str, ...]]  # flavour -> packages
    fabricmanager: bool
    cudnn: bool
    # packages from other source packages, with their own upstream version (e.g. nvidia-persistenced)
    package_versions: Mapping[str, str] = field(default_factory=dict)
    # archive components the packages need besides main (Debian: contrib, non-free, ...)
    components: tuple[str, ...] = ()
    # kernel modules apart from driver_packages (Ubuntu), per flavour: the prebuilt, signed
    # package with "{kernel}" for `uname -r` or the kernel flavour, and the DKMS fallback
    prebuilt_modules: Mapping[str, str] = field(default_factory=dict)
    dkms_modules: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CompatData:
    schema_version: int
    data_version: str
    as_of: str
    cuda_families: Mapping[str, CudaFamily]
    cuda_releases: Mapping[str, CudaRelease]
    cudnn_builds: tuple[CudnnBuild, ...]
    architectures: Mapping[str, Architecture]
    driver_branches: Mapping[str, DriverBranch]
    auto_branch_preference: tuple[str, ...]
    open_min_architecture: str
    open_default_from_branch: str
    open_required_platforms: tuple[str, ...]
    app_clocks_deprecated_from_branch: str
    nvidia_repo: Mapping[str, Any]
    distro_offers: Mapping[str, DistroOffer]
    pytorch_alloc_options: tuple[str, ...]
    nccl_profiles: Mapping[str, Mapping[str, Any]]
    gpus_raw: tuple[Mapping[str, Any], ...]
    nvswitch_pci_ids: Mapping[str, str]
    mig_profiles_raw: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # gpufleet/catalog/mig.py reads it
    nsight_tools_raw: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # gpufleet/plans/profiling.py reads it

    @property
    def cudnn_versions(self) -> tuple[str, ...]:
        return tuple(sorted({b.version for b in self.cudnn_builds}, key=parse, reverse=True))

    @property
    def usable_branches(self) -> tuple[str, ...]:
        return tuple(b for b, info in self.driver_branches.items() if info.usable)

    def generation(self, arch: str) -> int:
        return self.architectures[arch].generation


def _verified(entry: Any) -> bool:
    return not (isinstance(entry, Mapping) and (entry.get("status") == UNVERIFIED or entry.get("unverified")))


def _req(mapping: Mapping[str, Any], key: str, where: str) -> Any:
    try:
        return mapping[key]
    except (KeyError, TypeError):
        raise CompatDataError(f"compat.yaml: {where}: missing '{key}'") from None


def _version(value: Any, where: str) -> str:
    if not is_version(value):
        raise CompatDataError(f"compat.yaml: {where}: {value!r} is not a quoted dotted version")
    return value


def _branches(raw: Mapping[str, Any]) -> dict[str, DriverBranch]:
    out: dict[str, DriverBranch] = {}
    for branch, info in raw.items():
        branch = str(branch)
        versions = {
            _version(v, f"driver_branches.{branch}"): str(meta.get("status", ""))
            for v, meta in (info.get("versions") or {}).items()
            if _verified(meta)
        }
        default = info.get("default")
        usable = bool(info.get("usable", True)) and _verified(info) and default is not None
        if default is not None and default not in versions:
            raise CompatDataError(f"compat.yaml: driver_branches.{branch}: default {default} not in versions")
        out[branch] = DriverBranch(
            branch=branch,
            usable=usable,
            type=info.get("type"),
            eol=info.get("eol"),
            architectures=tuple(info.get("architectures") or ()),
            default=default,
            versions=versions,
            note=info.get("note"),
        )
    return out


def _cuda_release(minor: str, raw: Mapping[str, Any]) -> CudaRelease:
    release = _version(raw["release"], minor) if raw.get("release") is not None else None
    toolkit = _version(raw["toolkit_driver"], minor)
    ga = _version(raw["ga_driver"], minor)
    updates = {_version(u, minor): _version(d, minor) for u, d in (raw.get("updates") or {}).items()}
    if not updates and release is not None:
        updates = {release: toolkit}
    updates = dict(sorted(updates.items(), key=lambda item: parse(item[0])))
    # the three summary fields must say what the update table says (one fact, written twice)
    if updates and (release != list(updates)[-1] or toolkit != updates[list(updates)[-1]]):
        raise CompatDataError(f"compat.yaml: cuda_releases.{minor}: release {release} / toolkit_driver {toolkit} "
                              f"is not the newest of its updates {updates}")
    if updates and any(".".join(u.split(".")[:2]) != minor for u in updates):
        raise CompatDataError(f"compat.yaml: cuda_releases.{minor}: updates {list(updates)} are not all of {minor}")
    if updates and list(updates)[0].endswith(".0") and updates[list(updates)[0]] != ga:
        raise CompatDataError(f"compat.yaml: cuda_releases.{minor}: ga_driver {ga} is not the GA update's driver")
    return CudaRelease(minor, ga, toolkit, release, updates)


def _cudnn_build(row: Mapping[str, Any]) -> CudnnBuild:
    return CudnnBuild(
        version=_version(row["version"], "cudnn_releases"),
        cuda_major=str(row["cuda_major"]),
        cuda_versions=tuple(row["cuda_versions"]),
        min_driver=_version(row["min_driver"], "cudnn_releases"),
        compute_capabilities=tuple(row["compute_capabilities"]),
        package_version=(_version(row["package_version"], "cudnn_releases")
                         if row.get("package_version") is not None else None),
    )


def _distro_offer(os_name: str, info: Mapping[str, Any]) -> DistroOffer:
    return DistroOffer(
        os=os_name,
        driver_branch=str(info["driver_branch"]),
        driver_version=_version(info["driver_version"], f"distro_offers.{os_name}"),
        cuda_version=(_version(info["cuda_version"], f"distro_offers.{os_name}")
                      if info.get("cuda_version") is not None else None),
        cuda_package=info.get("cuda_package"),
        driver_packages={k: tuple(v) for k, v in info["driver_packages"].items()},
        fabricmanager=bool(info.get("fabricmanager", False)),
        cudnn=bool(info.get("cudnn", False)),
        package_versions={
            str(k): _version(v, f"distro_offers.{os_name}.package_versions")
            for k, v in (info.get("package_versions") or {}).items()
        },
        components=tuple(info.get("components") or ()),
        prebuilt_modules={str(k): str(v) for k, v in (info.get("prebuilt_modules") or {}).items()},
        dkms_modules={str(k): str(v) for k, v in (info.get("dkms_modules") or {}).items()},
    )


def _from_mapping(data: Mapping[str, Any]) -> CompatData:
    if data.get("schema_version") != SUPPORTED_SCHEMA:
        raise CompatDataError(
            f"compat.yaml: schema_version {data.get('schema_version')!r} unsupported; allowed: {SUPPORTED_SCHEMA}"
        )
    families = {
        str(k): CudaFamily(str(k), _version(v["min_driver"], f"cuda_families.{k}"), v["min_compute_capability"])
        for k, v in _req(data, "cuda_families", "top").items()
        if _verified(v)
    }
    releases = {
        str(k): _cuda_release(str(k), v) for k, v in _req(data, "cuda_releases", "top").items() if _verified(v)
    }
    cudnn = tuple(_cudnn_build(row) for row in _req(data, "cudnn_releases", "top") if _verified(row))
    archs = {
        name: Architecture(
            name=name,
            generation=int(info["generation"]),
            last_branch=info.get("last_branch"),
            last_cuda_major=info.get("last_cuda_major"),
            first_cuda=info.get("first_cuda"),
            open_required=bool(info.get("open_required", False)),
        )
        for name, info in _req(data, "architectures", "top").items()
    }
    modules = _req(data, "kernel_modules", "top")
    offers = {os_name: _distro_offer(os_name, info) for os_name, info in (data.get("distro_offers") or {}).items()
              if _verified(info)}
    return CompatData(
        schema_version=data["schema_version"],
        data_version=str(_req(data, "data_version", "top")),
        as_of=str(_req(data, "as_of", "top")),
        cuda_families=families,
        cuda_releases=releases,
        cudnn_builds=cudnn,
        architectures=archs,
        driver_branches=_branches(_req(data, "driver_branches", "top")),
        auto_branch_preference=tuple(str(b) for b in data.get("auto_branch_preference", ())),
        open_min_architecture=modules["open_min_architecture"],
        open_default_from_branch=str(modules["open_default_from_branch"]),
        open_required_platforms=tuple(modules.get("open_required_platforms", ())),
        app_clocks_deprecated_from_branch=str(data["clocks"]["app_clocks_deprecated_from_branch"]),
        nvidia_repo=data["nvidia_repo"],
        distro_offers=offers,
        pytorch_alloc_options=tuple(data.get("pytorch_alloc_options", ())),
        nccl_profiles=data.get("nccl_profiles", {}),
        gpus_raw=tuple(data.get("gpus", ())),
        nvswitch_pci_ids={str(k).lower(): v for k, v in data["nvswitch"]["pci_ids"].items()},
        mig_profiles_raw=data.get("mig_profiles") or {},
        nsight_tools_raw=data.get("nsight_tools") or {},
    )


def load_compat_file(path: Path | str) -> CompatData:
    """Parse a compat.yaml at ``path`` (tests use this for variant data)."""
    with open(path, encoding="utf-8") as handle:
        return _from_mapping(yamlload.safe_load(handle))


@lru_cache(maxsize=1)
def packaged_mapping() -> Mapping[str, Any]:
    """gpufleet/data/compat.yaml as parsed, once per process, for compat_data() and the PyTorch
    tables (gpufleet/catalog/pytorch.py), which used to read and parse it again each. Read only."""
    text = resources.files("gpufleet").joinpath("data/compat.yaml").read_text(encoding="utf-8")
    data: Mapping[str, Any] = yamlload.safe_load(text)
    return data


@lru_cache(maxsize=1)
def compat_data() -> CompatData:
    """The packaged compatibility data, parsed once per process."""
    return _from_mapping(packaged_mapping())
