"""GPU operations: read the host's facts (as they were before this run), compare with what the tier
asks, and yield only the nvidia-smi commands still needed; say so with host.noop otherwise.

* ``clocks``: application clocks (-ac) or locked clocks (-lgc/-lmc) per GPU, or a reset;
* ``persistence_enabled``: check, after the daemon has started, that every GPU reports
  persistence mode Enabled (nothing to check when it already did before the run);
* ``legacy_persistence``: ``nvidia-smi -pm 1`` for the GPUs without it (driver_persistence: legacy).
"""
from __future__ import annotations

from collections.abc import Generator
from typing import Any

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.hostfacts import gpu_state, locked_clocks
from gpufleet.tuning import plan_clocks
from gpufleet.facts.gpu_tuning import LOCKED_CLOCKS_DIR

NVIDIA_SMI = "nvidia-smi"


def _smi(*args: str) -> StringCommand:
    return StringCommand(NVIDIA_SMI, *(QuoteString(a) for a in args))


@operation()
def clocks(policy: Any, ac_deprecated_from: int) -> Generator[StringCommand, None, None]:
    """Bring every GPU's clocks to the policy's target; nothing for GPUs already there.

    Refusals (an unsupported pair, a GPU without settable clocks) are raised at planning time
    by the deploy before this operation is added."""
    state = gpu_state(host)
    plans = plan_clocks(policy, state.gpus, state.supported_clocks, state.driver_version,
                        locked_clocks(host), ac_deprecated_from)
    changed = False
    for plan in plans:
        for args in plan.commands:
            changed = True
            yield _smi(*args)
        if plan.record == "":
            yield StringCommand("rm", "-f", QuoteString(f"{LOCKED_CLOCKS_DIR}/{plan.bus_id}"))
        elif plan.record:
            path = f"{LOCKED_CLOCKS_DIR}/{plan.bus_id}"
            yield StringCommand("mkdir", "-p", LOCKED_CLOCKS_DIR, "&&", "echo", QuoteString(plan.record), ">",
                                QuoteString(path))
    if not changed:
        targets = sorted({f"{p.target.mem},{p.target.gfx}" if p.target else "default" for p in plans})
        host.noop(f"all {len(plans)} GPUs are already at their clocks ({', '.join(targets)}; "
                  f"{plans[0].method if plans else '-'})")


# $1 nvidia-smi, $2 seconds to wait for every GPU to report persistence mode Enabled.
_PERSISTENCE_WAIT = (
    "i=0; while [ $i -lt \"$2\" ]; do "
    "out=$(\"$1\" --query-gpu=pci.bus_id,persistence_mode --format=csv,noheader); "
    "if [ -n \"$out\" ] && ! echo \"$out\" | grep -qv ', Enabled$'; then exit 0; fi; "
    "i=$((i+1)); sleep 1; done; "
    "echo \"persistence mode is not Enabled on every GPU:\" >&2; echo \"$out\" >&2; exit 1"
)


@operation()
def persistence_enabled(daemon_was_running: bool, wait_seconds: int = 15) -> Generator[StringCommand, None, None]:
    """Every GPU must report persistence mode Enabled (the daemon may take a moment after start)."""
    state = gpu_state(host)
    if daemon_was_running and state.gpus and all(g.persistence for g in state.gpus):
        host.noop(f"persistence mode is Enabled on all {len(state.gpus)} GPUs")
        return
    # Fails (and fails the host) unless every GPU says Enabled within wait_seconds.
    yield StringCommand("sh", "-c", QuoteString(_PERSISTENCE_WAIT), "gpufleet-persistence",
                        QuoteString(NVIDIA_SMI), str(int(wait_seconds)))


@operation()
def legacy_persistence() -> Generator[StringCommand, None, None]:
    """nvidia-smi -pm 1 on the GPUs without persistence mode (driver_persistence: legacy)."""
    state = gpu_state(host)
    missing = [g for g in state.gpus if not g.persistence]
    for gpu in missing:
        yield _smi("-i", gpu.bus_id, "-pm", "1")
    if not missing:
        host.noop(f"persistence mode is Enabled on all {len(state.gpus)} GPUs")
