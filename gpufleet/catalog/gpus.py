"""GPU catalog: maps the raw PCI device ids and nvidia-smi names that facts return to GpuModel."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable, Mapping

from gpufleet.facts.gpu import ClockPair

from gpufleet.catalog.compat import UNVERIFIED, compat_data
from gpufleet.errors import CompatDataError


@dataclass(frozen=True)
class GpuModel:
    name: str  # exactly as nvidia-smi prints "Product Name"
    pci_ids: tuple[str, ...]  # "0x2335"
    arch: str
    compute_capability: str
    generation: int
    form_factor: str | None = None
    platform: str | None = None  # grace_hopper / grace_blackwell
    fabric: str = "none"  # none | when_nvswitch | off_host
    needs_nvlsm: bool = False
    open_required: bool = False
    min_driver: str | None = None
    first_open_driver: str | None = None
    default_clocks: ClockPair | None = None
    max_clocks: ClockPair | None = None
    supported_memory_mhz: tuple[int, ...] = ()
    aliases: tuple[str, ...] = ()
    #: datacenter | workstation | geforce: NVIDIA's product lines (CUDA forward compatibility,
    #: cuda-compat, is for data-centre GPUs only [S4])
    gpu_class: str = "datacenter"

    @property
    def cc_tuple(self) -> tuple[int, ...]:
        return tuple(int(p) for p in self.compute_capability.split("."))

    def __str__(self) -> str:
        return self.name


def normalise_pci_id(device_id: str | int) -> str:
    """"2335", "0x2335", "0X2335", 0x2335 -> "0x2335"."""
    if isinstance(device_id, int):
        return f"0x{device_id:04x}"
    text = str(device_id).strip().lower()
    if text.startswith("0x"):
        text = text[2:]
    if not text or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"not a PCI device id: {device_id!r}")
    return f"0x{int(text, 16):04x}"


def _clock(entry: Any) -> ClockPair | None:
    if not isinstance(entry, Mapping) or entry.get("status") == UNVERIFIED:
        return None
    if entry.get("memory") is None or entry.get("graphics") is None:
        return None
    return ClockPair(int(entry["memory"]), int(entry["graphics"]))


def _model(raw: Mapping[str, Any]) -> GpuModel:
    data = compat_data()
    arch = raw["arch"]
    if arch not in data.architectures:
        raise CompatDataError(f"compat.yaml: gpu {raw.get('name')!r}: unknown arch {arch!r}")
    platform = raw.get("platform")
    mem = raw.get("supported_memory_mhz") or {}
    min_driver = raw.get("min_driver") if raw.get("min_driver_status") != UNVERIFIED else None
    return GpuModel(
        name=raw["name"],
        pci_ids=tuple(normalise_pci_id(p) for p in raw["pci_ids"]),
        arch=arch,
        compute_capability=str(raw["cc"]),
        generation=data.generation(arch),
        form_factor=raw.get("form_factor"),
        platform=platform,
        fabric=raw.get("fabric", "none"),
        needs_nvlsm=bool(raw.get("needs_nvlsm", False)),
        open_required=data.architectures[arch].open_required or platform in data.open_required_platforms,
        min_driver=min_driver,
        first_open_driver=raw.get("first_open_driver"),
        default_clocks=_clock(raw.get("default_clocks")),
        max_clocks=_clock(raw.get("max_clocks")),
        supported_memory_mhz=tuple(mem.get("values", ())) if mem.get("status") != UNVERIFIED else (),
        aliases=tuple(raw.get("aliases", ())),
        gpu_class=str(raw.get("class", "datacenter")),
    )


@lru_cache(maxsize=1)
def catalog() -> tuple[GpuModel, ...]:
    """Every GPU model gpufleet knows, in compat.yaml order."""
    return tuple(_model(raw) for raw in compat_data().gpus_raw)


@lru_cache(maxsize=1)
def _by_pci() -> dict[str, GpuModel]:
    return {pci: model for model in catalog() for pci in model.pci_ids}


@lru_cache(maxsize=1)
def _by_name() -> dict[str, GpuModel]:
    names: dict[str, GpuModel] = {}
    for model in catalog():
        for name in (model.name, *model.aliases):
            names[name.casefold()] = model
    return names


def model_for_pci(device_id: str | int) -> GpuModel | None:
    """GPU model for a raw PCI device id (vendor 10de), or None if gpufleet does not know it."""
    try:
        return _by_pci().get(normalise_pci_id(device_id))
    except ValueError:
        return None


def model_for_name(name: str) -> GpuModel | None:
    """GPU model for an nvidia-smi "Product Name" (case-insensitive) or a catalog alias."""
    return _by_name().get(name.strip().casefold())


def is_nvswitch_pci(device_id: str | int) -> bool:
    """True for the NVSwitch bridge ids in the catalog (class 0x0680 devices)."""
    try:
        return normalise_pci_id(device_id) in compat_data().nvswitch_pci_ids
    except ValueError:
        return False


def model_names() -> tuple[str, ...]:
    return tuple(model.name for model in catalog())


def to_models(items: Iterable[GpuModel | str | int]) -> tuple[list[GpuModel], list[str], bool]:
    """Split a mixed list of GpuModel / PCI ids / names into (models, unknown ids, nvswitch seen)."""
    models: list[GpuModel] = []
    unknown: list[str] = []
    nvswitch = False
    for item in items:
        if isinstance(item, GpuModel):
            models.append(item)
            continue
        if is_nvswitch_pci(item):
            nvswitch = True
            continue
        found = model_for_pci(item) or (model_for_name(item) if isinstance(item, str) else None)
        if found is None:
            unknown.append(str(item))
        else:
            models.append(found)
    return models, unknown, nvswitch
