"""
MIG on each GPU: the mode (current and pending), and the GPU and compute instances it has, as
``nvidia-smi --query-gpu`` and ``nvidia-smi mig -lgi`` / ``-lci`` print them.

A GPU without MIG prints ``N/A`` for its mode (kept as None); with MIG off on every GPU,
``nvidia-smi mig -lgi`` says "No MIG-enabled devices found." and there are no instances.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, fail

MARK = "--gpufleet-mig"

# |   0  MIG 3g.71gb          9        1          0:4     |
_GI = re.compile(r"^\|\s*(?P<gpu>\d+)\s+MIG\s+(?P<name>\S+)\s+(?P<profile>\d+)\s+(?P<id>\d+)\s+"
                 r"(?P<start>\d+):(?P<size>\d+)\s*\|$")
# |   0      1       MIG 3g.71gb          2         0          0:3     |
_CI = re.compile(r"^\|\s*(?P<gpu>\d+)\s+(?P<gi>\d+)\s+MIG\s+(?P<name>\S+)\s+(?P<profile>\d+)\s+(?P<id>\d+)\s+"
                 r"\d+:\d+\s*\|$")
_MODE = re.compile(r"^(?P<index>\d+), (?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]), "
                   r"(?P<current>[^,]*), (?P<pending>[^,]*)$")


@dataclass(frozen=True)
class MigInstance(JsonMixin):
    """One GPU instance: its profile and placement, and how many compute instances it has."""

    gi_id: int
    profile: str  # "3g.71gb"
    profile_id: int
    start: int
    size: int
    compute_instances: int


@dataclass(frozen=True)
class MigGpu(JsonMixin):
    index: int
    bus_id: str
    current: str | None  # "Enabled" | "Disabled"; None: the GPU has no MIG
    pending: str | None
    instances: tuple[MigInstance, ...] = ()

    @property
    def profiles(self) -> tuple[str, ...]:
        """The GPU instances' profile names, sorted: what a layout is compared by."""
        return tuple(sorted(i.profile for i in self.instances))


@dataclass(frozen=True)
class MigStateData(JsonMixin):
    ok: bool  # nvidia-smi answered
    gpus: tuple[MigGpu, ...] = field(default_factory=tuple)

    def gpu(self, index: int) -> MigGpu | None:
        return next((g for g in self.gpus if g.index == index), None)


def _mode(text: str) -> str | None:
    text = text.strip()
    return None if text in ("N/A", "[N/A]", "") else text


def parse_mig(lines: Sequence[str]) -> MigStateData:
    section = "modes"
    modes: list[tuple[int, str, str | None, str | None]] = []
    gis: dict[tuple[int, int], dict[str, int | str]] = {}
    cis: dict[tuple[int, int], int] = {}
    answered = False
    for raw in lines:
        line = raw.rstrip()
        if line.startswith(MARK):
            section = line[len(MARK):].strip()
            continue
        if section == "modes":
            if not line.strip():
                continue
            match = _MODE.match(line.strip())
            if not match:
                raise fail("expected 'index, bus id, MIG mode, pending MIG mode' from nvidia-smi --query-gpu", line)
            answered = True
            modes.append((int(match["index"]), match["bus"], _mode(match["current"]), _mode(match["pending"])))
        elif section == "lgi":
            match = _GI.match(line.strip())
            if match:
                gis[(int(match["gpu"]), int(match["id"]))] = {
                    "profile": match["name"], "profile_id": int(match["profile"]),
                    "start": int(match["start"]), "size": int(match["size"])}
        elif section == "lci":
            match = _CI.match(line.strip())
            if match:
                key = (int(match["gpu"]), int(match["gi"]))
                cis[key] = cis.get(key, 0) + 1
    gpus = []
    for index, bus, current, pending in modes:
        mine = sorted((gi_id, v) for (gpu, gi_id), v in gis.items() if gpu == index)
        instances = tuple(MigInstance(gi_id, str(v["profile"]), int(v["profile_id"]), int(v["start"]), int(v["size"]),
                                      cis.get((index, gi_id), 0)) for gi_id, v in mine)
        gpus.append(MigGpu(index, bus, current, pending, instances if current == "Enabled" else ()))
    return MigStateData(ok=answered, gpus=tuple(gpus))


# Instances exist only on a GPU whose MIG mode is enabled: without one, the two listings
# would say "No MIG-enabled devices found.", so a host without MIG (the usual no-op) pays
# for one nvidia-smi call, not three.
MIG_STATE_COMMAND = ("m=$(nvidia-smi --query-gpu=index,pci.bus_id,mig.mode.current,mig.mode.pending --format=csv,noheader "
                     "2>/dev/null) || exit 0; printf '%s\\n' \"$m\"; case \"$m\" in *Enabled*) ;; *) exit 0 ;; esac; "
                     "echo '--gpufleet-mig lgi'; nvidia-smi mig -lgi 2>&1; echo '--gpufleet-mig lci'; nvidia-smi mig -lci 2>&1; "
                     "true")


class MigState(FactBase[MigStateData]):
    """
    Returns every GPU's MIG mode and instances:

    .. code:: python

        MigStateData(ok=True, gpus=(MigGpu(index=0, bus_id="00000000:00:06.0", current="Enabled",
                     pending="Enabled", instances=(MigInstance(gi_id=1, profile="3g.71gb", ...), ...)),))
    """

    @override
    @staticmethod
    def default() -> MigStateData:
        return MigStateData(ok=False)

    @override
    def command(self) -> str:
        return MIG_STATE_COMMAND

    @override
    def process(self, output: list[str]) -> MigStateData:
        return parse_mig(output)
