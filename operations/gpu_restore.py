"""Give the GPUs back the persistence mode and application clocks they had before a reboot."""
from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.facts.gpu import GpuState


@operation()
def gpu_settings_restored(gpus: list[dict[str, Any]], skip: Sequence[str] = ()) -> Generator[StringCommand, None, None]:
    """Re-apply recorded per-GPU persistence and application clocks (from a manifest).

    + gpus: [{"uuid": ..., "index": 0, "persistence": true, "app_clocks": [mem, gfx] | None}, ...]
    + skip: UUIDs of GPUs whose clocks are left alone (in MIG mode: not settable there)
    """
    state = host.get_fact(GpuState)
    if not state.ok:
        host.noop(f"nvidia-smi is not usable ({state.status}): nothing to restore")
        return
    now = {g.uuid: g for g in state.gpus}
    changed = False
    for want in gpus:
        gpu = now.get(str(want.get("uuid")))
        if gpu is None:
            continue
        if want.get("persistence") and not gpu.persistence:
            changed = True
            yield StringCommand("nvidia-smi", "-i", QuoteString(gpu.uuid), "-pm", "1")
        clocks = want.get("app_clocks")
        if clocks and gpu.app_clocks and tuple(gpu.app_clocks) != tuple(clocks) and gpu.uuid not in skip:
            changed = True
            yield StringCommand("nvidia-smi", "-i", QuoteString(gpu.uuid), "-ac", QuoteString(f"{int(clocks[0])},{int(clocks[1])}"))
    if not changed:
        host.noop("persistence and application clocks are as recorded")
