"""MIG partitions from the tier (``gpu_mig``): its grammar, the profiles each GPU model has
(compat.yaml ``mig_profiles``), and the plan for one host: which GPUs get MIG on or off, and
which GPU instances (each with its full-size compute instance) they get.

A layout names GPU instance profiles per GPU: ``{"all": ["3g.71gb", "3g.71gb"]}``, or by GPU
index (``{0: [...], 1: [...]}``; an index entry wins over ``all``; a GPU a layout does not name
gets MIG off). It is refused at planning, for
that host, when a GPU has no MIG, lacks a profile, or the profiles do not fit: the fit is
decided as the driver places instances (each takes the first free placement of its profile, in
the order given to ``nvidia-smi mig -cgi``), and the plan gives the order that fits.

``none`` turns MIG off where it is on; ``unmanaged`` leaves MIG alone.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from gpufleet.facts.gpu import GpuInfo
from gpufleet.facts.mig import MigGpu, MigStateData

from gpufleet.catalog.compat import UNVERIFIED, compat_data

KEY = "gpu_mig"
NONE = "none"
UNMANAGED = "unmanaged"
ALL = "all"
PROFILE_NAME = re.compile(r"[1-8]g\.[1-9][0-9]{0,3}gb(\+me)?", re.ASCII)
MAX_INSTANCES = 8
MAX_GPU_INDEX = 63
GRAMMAR = ('none | unmanaged | {"all": [profile, ...]} and/or {GPU index: [profile, ...]}, '
           "profiles such as 3g.71gb or 1g.18gb+me (1 to 8 per GPU)")


class MigRefusal(Exception):
    """A layout this host cannot have: the catalog's own word, below the config floor; the MIG plan
    (gpufleet.plans.tuning.host_mig) turns it into the one Refusal (gpufleet.config.failures)."""

    def __init__(self, problem: str, allowed: str):
        super().__init__(problem)
        self.problem, self.allowed = problem, allowed


@dataclass(frozen=True)
class MigProfile:
    name: str  # "3g.71gb"
    id: int
    instances: int  # at most this many per GPU
    starts: tuple[int, ...]  # placement starts, in -lgipp order
    size: int  # memory slices


# --- grammar ------------------------------------------------------------------------------------


def check_setting(value: Any) -> Any:
    """The grammar of gpu_mig: the normalised value, or ValueError(problem). Profiles are checked
    against each GPU's model later, at planning (plan_mig)."""
    if isinstance(value, str):
        if value in (NONE, UNMANAGED):
            return value
        raise ValueError(f"unknown value {value!r}")
    if not isinstance(value, Mapping) or not value:
        raise ValueError(f"expected none, unmanaged or a mapping of GPUs to profile lists, got {value!r}")
    out: dict[Any, tuple[str, ...]] = {}
    for gpu, profiles in value.items():
        if gpu == ALL:
            key: Any = ALL
        elif isinstance(gpu, int) and not isinstance(gpu, bool) and 0 <= gpu <= MAX_GPU_INDEX:
            key = gpu
        elif isinstance(gpu, str) and gpu.isdigit() and int(gpu) <= MAX_GPU_INDEX:
            key = int(gpu)
        else:
            raise ValueError(f"GPU {gpu!r} is neither 'all' nor a GPU index 0-{MAX_GPU_INDEX}")
        if key in out:
            raise ValueError(f"GPU {gpu!r} is named twice")
        if not isinstance(profiles, (list, tuple)) or not 1 <= len(profiles) <= MAX_INSTANCES:
            raise ValueError(f"GPU {gpu!r}: expected a list of 1 to {MAX_INSTANCES} profiles, got {profiles!r}")
        for name in profiles:
            if not isinstance(name, str) or not PROFILE_NAME.fullmatch(name):
                raise ValueError(f"GPU {gpu!r}: {name!r} is not a MIG profile name (such as 3g.71gb)")
        out[key] = tuple(profiles)
    return MappingProxyType(out)


def setting_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "; ".join(f"{'all GPUs' if k == ALL else f'GPU {k}'}: {', '.join(v)}" for k, v in value.items())


# --- profiles per model -------------------------------------------------------------------------


@cache
def _profiles_by_model() -> Mapping[str, tuple[MigProfile, ...]]:
    out = {}
    for name, entry in compat_data().mig_profiles_raw.items():
        if entry.get("status") == UNVERIFIED:
            continue
        out[name] = tuple(MigProfile(str(p[0]), int(p[1]), int(p[2]), tuple(int(s) for s in p[3]), int(p[4]))
                          for p in entry["profiles"])
    return MappingProxyType(out)


def mig_models() -> tuple[str, ...]:
    return tuple(_profiles_by_model())


def model_profiles(gpu_name: str) -> tuple[MigProfile, ...] | None:
    """The MIG profiles of a GPU model by its nvidia-smi name (None: no MIG known for it)."""
    return _profiles_by_model().get(gpu_name)


def _first_fit(order: Sequence[MigProfile]) -> bool:
    taken: set[int] = set()
    for profile in order:
        spot = next((s for s in profile.starts if not taken & set(range(s, s + profile.size))), None)
        if spot is None:
            return False
        taken |= set(range(spot, spot + profile.size))
    return True


def creation_order(wanted: Sequence[str], profiles: Sequence[MigProfile]) -> tuple[str, ...] | None:
    """An order of `wanted` in which each instance finds a free placement as the driver picks it
    (largest first, else the first order that fits); None when no order fits."""
    by_name = {p.name: p for p in profiles}
    chosen = [by_name[n] for n in wanted]
    largest_first = sorted(chosen, key=lambda p: (-p.size, p.id))
    if _first_fit(largest_first):
        return tuple(p.name for p in largest_first)
    seen = set()
    for order in itertools.permutations(chosen):
        names = tuple(p.name for p in order)
        if names in seen:
            continue
        seen.add(names)
        if _first_fit(order):
            return names
    return None


# --- the plan for one host -------------------------------------------------------------------------


@dataclass(frozen=True)
class MigGpuPlan:
    index: int
    bus_id: str
    label: str  # "GPU 0 NVIDIA H200 (00000000:00:06.0)"
    wanted: tuple[str, ...] | None  # creation order; None: MIG off
    found: str  # what the GPU has now, in words
    change: bool  # the gate must run the MIG script for this GPU

    @property
    def entry(self) -> str:
        """How the script and the boot unit name this GPU's layout: INDEX=PROFILE,... or INDEX=none."""
        return f"{self.index}=" + (",".join(self.wanted) if self.wanted is not None else NONE)

    @property
    def mig_on(self) -> bool:
        return self.wanted is not None


@dataclass(frozen=True)
class MigPlan:
    setting: Any
    gpus: tuple[MigGpuPlan, ...] = ()

    @property
    def managed(self) -> bool:
        return bool(self.setting != UNMANAGED)

    @property
    def changes(self) -> tuple[MigGpuPlan, ...]:
        return tuple(g for g in self.gpus if g.change)

    @property
    def mig_buses(self) -> frozenset[str]:
        """GPUs in MIG mode once the plan is applied: their clocks are not settable."""
        return frozenset(g.bus_id for g in self.gpus if g.mig_on)

    @property
    def boot_entries(self) -> tuple[str, ...]:
        """What the boot unit re-applies: only GPUs gpufleet partitions, and those it turns off."""
        return tuple(g.entry for g in self.gpus)

    def summary(self) -> str:
        if not self.managed:
            return "gpu_mig: unmanaged (MIG left alone)"
        on = [g for g in self.gpus if g.mig_on]
        if not on:
            return "MIG off" + (f" ({len(self.gpus)} MIG-capable GPUs)" if self.gpus else "")
        groups: dict[tuple[str, ...], list[str]] = {}
        for g in on:
            groups.setdefault(tuple(sorted(g.wanted or ())), []).append(str(g.index))
        return "; ".join(f"GPU {', '.join(ix)}: {' + '.join(layout)}" for layout, ix in groups.items())


def _found(state: MigGpu | None) -> str:
    if state is None or state.current is None:
        return "no MIG"
    if state.current != "Enabled":
        return "MIG off" + (f" (pending: {state.pending})" if state.pending and state.pending != state.current else "")
    if not state.instances:
        return "MIG on, no instances"
    text = "MIG on: " + " + ".join(state.profiles)
    lacking = sum(1 for i in state.instances if i.compute_instances == 0)
    return text + (f" ({lacking} without a compute instance)" if lacking else "")


def _wanted_for(setting: Mapping[Any, tuple[str, ...]], index: int) -> tuple[str, ...] | None:
    if index in setting:
        return setting[index]
    return setting.get(ALL)


def plan_mig(setting: Any, gpus: Sequence[GpuInfo], state: MigStateData) -> MigPlan:
    """Per GPU: the layout wanted, what it has, whether the MIG script must run for it; raises
    MigRefusal (the problem and what is allowed) for a layout a GPU cannot have."""
    if setting == UNMANAGED:
        return MigPlan(setting)
    if isinstance(setting, Mapping):
        setting = check_setting(setting)  # GPU indices as numbers, however they were written
    plans = []
    if isinstance(setting, Mapping):
        unknown = sorted(k for k in setting if k != ALL and k not in {g.index for g in gpus})
        if unknown and gpus:
            raise MigRefusal(f"names GPU {', '.join(map(str, unknown))}, which this host does not have "
                             f"(it has GPU {', '.join(str(g.index) for g in gpus)})",
                             "all, or the host's GPU indices")
    for gpu in gpus:
        label = f"GPU {gpu.index} {gpu.name} ({gpu.bus_id})"
        mine = state.gpu(gpu.index)
        found = _found(mine)
        wanted = None if setting == NONE else _wanted_for(setting, gpu.index)
        if wanted is None:
            on = mine is not None and "Enabled" in (mine.current, mine.pending)
            if mine is not None and mine.current is not None or on:
                plans.append(MigGpuPlan(gpu.index, gpu.bus_id, label, None, found, on))
            continue
        profiles = model_profiles(gpu.name)
        if profiles is None or (mine is not None and mine.current is None):
            known = ", ".join(mig_models())
            raise MigRefusal(f"{label} has no MIG (MIG models with profile data: {known})",
                             "none | unmanaged, or name only GPUs of those models by index")
        names = [p.name for p in profiles]
        for name in wanted:
            if name not in names:
                raise MigRefusal(f"{label} has no MIG profile {name}", f"none | unmanaged | {', '.join(names)}")
        for p in profiles:
            if wanted.count(p.name) > p.instances:
                raise MigRefusal(f"{label} takes at most {p.instances} x {p.name}, not {wanted.count(p.name)}",
                                 f"none | unmanaged | {', '.join(f'{q.name} (at most {q.instances})' for q in profiles)}")
        order = creation_order(wanted, profiles)
        if order is None:
            sizes = ", ".join(f"{p.name} = {p.size}" for p in profiles)
            raise MigRefusal(f"{' + '.join(wanted)} does not fit {label} (its {max(p.size for p in profiles)} memory "
                             f"slices: {sizes})", "a layout whose slices fit, such as " +
                             " + ".join([profiles[-1].name]) + f" or {profiles[0].name} x {profiles[0].instances}")
        ok = (mine is not None and mine.current == "Enabled" and mine.pending in (None, "Enabled")
              and mine.profiles == tuple(sorted(order))
              and all(i.compute_instances >= 1 for i in mine.instances))
        plans.append(MigGpuPlan(gpu.index, gpu.bus_id, label, order, found, not ok))
    return MigPlan(setting, tuple(plans))


CLOCKS_NOTE = ("application and locked clocks are not settable in MIG mode: clock_policy is not applied to "
               "{gpus}, which keep the driver's clocks")
