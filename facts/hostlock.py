"""The host lock's generation (gpufleet/controller/hostlock.py): which runs have held the lock since boot."""

from __future__ import annotations

import re

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import fail

#: written by the lock's holder (root, in its root-only 0700 folder), bumped when a run takes the
#: lock and again when its holder ends
GENERATION_FILE = "/run/gpufleet-lock/generation"
_LINE = re.compile(r"[0-9a-f-]{36} \d{1,18}")


class LockGeneration(FactBase[str]):
    """
    Returns the boot id and how many times the gpufleet lock was taken or given back since
    boot (0: never), as the lock's holder compares them:

    .. code:: python

        "4c1f6a4e-0d0e-4bb5-9a6e-3c3f0e5c2c11 4"

    A run reads it while it plans; when it takes the lock, the holder refuses if another run
    has held the lock since (gpufleet/controller/hostlock.py), so no plan made on facts another run
    changed is ever applied.
    """

    @override
    def command(self) -> str:
        return ('g=$(cat ' + GENERATION_FILE + ' 2>/dev/null); case $g in ""|*[!0-9]*) g=0;; esac; '
                'echo "$(cat /proc/sys/kernel/random/boot_id) $g"')

    @override
    def process(self, output: list[str]) -> str:
        lines = [line.strip() for line in output if line.strip()]
        if len(lines) != 1 or not _LINE.fullmatch(lines[0]):
            raise fail("expected '<boot id> <generation>'", lines[0] if lines else None)
        return lines[0]
