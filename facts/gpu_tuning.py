"""
GPU clocks that gpufleet locked (``nvidia-smi -lgc``/``-lmc``) since the last boot.

nvidia-smi cannot read locked clocks back (there is no query field for them), so whoever locks
them (the tuning deploy, or gpufleet-gpu-clocks.service at boot) records the pair in
``/run/gpufleet/gpu-clocks/<bus id>``. /run is wiped by a reboot, exactly when the GPU forgets
the locks, so a missing record means "not locked".
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import fail, with_values

LOCKED_CLOCKS_DIR = "/run/gpufleet/gpu-clocks"

_LINE = re.compile(r"^(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]) (?P<pair>\d+,\d+)$")


def parse_locked_clocks(lines: Sequence[str]) -> dict[str, str]:
    """'<bus id> <mem>,<gfx>' lines -> {bus id: 'mem,gfx'}."""
    out = {}
    for line in lines:
        if not line.strip():
            continue
        match = _LINE.match(line.strip())
        if not match:
            raise fail("expected '<bus id> <memory>,<graphics>' in a locked-clocks record", line)
        out[match.group("bus")] = match.group("pair")
    return out


class LockedClocks(FactBase[dict[str, str]]):
    """
    Returns the clock locks gpufleet recorded since boot, by nvidia-smi bus id:

    .. code:: python

        {"00000000:00:06.0": "1215,1410"}
    """

    @override
    @staticmethod
    def default() -> dict[str, str]:
        return {}

    @override
    def command(self) -> str:
        return with_values('for f in "$dir"/*; do [ -f "$f" ] || continue; '
                           'echo "${f##*/} $(cat "$f")"; done; true', dir=LOCKED_CLOCKS_DIR)

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        return parse_locked_clocks(output)
