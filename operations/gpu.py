"""GPU operations: read the host's facts (as they were before this run), compare with what the tier
asks, and yield only the nvidia-smi commands still needed; say so with host.noop otherwise.

* ``clocks``: application clocks (-ac) or locked clocks (-lgc/-lmc) per GPU, or a reset;
* ``persistence_enabled``: check, after the daemon has started, that every GPU reports
  persistence mode Enabled (nothing to check when it already did before the run);
* ``legacy_persistence``: ``nvidia-smi -pm 1`` for the GPUs without it (driver_persistence: legacy);
* ``mig_partitions``: MIG on/off and the GPU and compute instances gpu_mig asks for, through the
  gate: the idle check is in the very command that starts the change; busy = pending, not applied.
"""
from __future__ import annotations

import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation

from gpufleet.config.hostfacts import gpu_state, locked_clocks, mig_state
from gpufleet.catalog.mig import plan_mig
from gpufleet.operations import as_op
from gpufleet.operations.drain import BUSY_MARK, idle_check
from gpufleet.printable import printable
from gpufleet.plans.tuning import plan_clocks
from gpufleet.facts.gpu_tuning import LOCKED_CLOCKS_DIR

NVIDIA_SMI = "nvidia-smi"


def _smi(*args: str) -> StringCommand:
    return StringCommand(NVIDIA_SMI, *(QuoteString(a) for a in args))


@operation()
def clocks(policy: Any, ac_deprecated_from: int, skip: Sequence[str] = ()) -> Generator[StringCommand, None, None]:
    """Bring every GPU's clocks to the policy's target; nothing for GPUs already there.

    + skip: bus ids of GPUs in MIG mode (their clocks are not settable)
    Refusals (an unsupported pair, a GPU without settable clocks) are raised at planning time
    by the deploy before this operation is added."""
    state = gpu_state(host)
    plans = plan_clocks(policy, [g for g in state.gpus if g.bus_id not in skip], state.supported_clocks,
                        state.driver_version, locked_clocks(host), ac_deprecated_from)
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


MIG_SCRIPT = "/usr/local/sbin/gpufleet-gpu-mig"
# the idle check and the MIG change as one command: a job started after planning is seen, not broken;
# per GPU: work on a GPU the change does not touch does not hold it up
MIG_IDLE_CHECK = idle_check("not changing its mig partitions", per_gpu=True)
#: how the MIG script's line starts for a mode change left pending because the GPU reset that makes
#: it effective was refused (fixed text of the script, followed by the GPU index and the mode)
REBOOT_MARK = "gpufleet-gpu-mig: REBOOT NEEDED:"


def mig_command(script: str, entries: Sequence[str], cdi: str = "") -> StringCommand:
    """The gated command: the idle check, then the MIG script's text (the boot unit's script,
    templates/usr/local/sbin/gpufleet-gpu-mig.j2) with its INDEX=... arguments."""
    # --reset: a mode change left pending is made effective by a GPU reset, which this command's
    # idle check (right before, per GPU) allows; the boot unit runs the script without it
    args = ([f"--cdi={cdi}"] if cdi else []) + ["--reset"] + list(entries)
    return StringCommand("sh", "-c", QuoteString(MIG_IDLE_CHECK + "\n" + script), "gpufleet-gpu-mig",
                         *(QuoteString(a) for a in args))


@dataclass(frozen=True)
class MigOutcome:
    """What the gated MIG command reported: `ok` is the command's success (a command that changed
    nothing because every GPU it names was busy is not ok); `busy`: per busy GPU what runs on it
    (\"GPU 0: 4242, python3\"); `reboot`: GPUs whose mode change waits for a reboot."""

    ok: bool
    busy: tuple[str, ...]
    reboot: tuple[str, ...]
    lines: tuple[str, ...]

    @property
    def only_busy(self) -> bool:
        return not self.ok and bool(self.busy) and all(
            line.startswith(BUSY_MARK) or not line.strip() for line in self.lines)


_BUSY_GPU = re.compile(r"^GPU work is running on GPU (\d+), not changing its mig partitions: (.*)$")


def read_mig_outcome(ok: bool, lines: Sequence[str]) -> MigOutcome:
    """The outcome, from lines the check and the script print themselves: each starts with fixed
    text (BUSY_MARK, REBOOT_MARK) and names the GPU by its index; what follows on a busy line (GPU
    processes' names, which users choose) is only passed on for the message."""
    busy, reboot = [], []
    for line in lines:
        if line.startswith(BUSY_MARK):
            match = _BUSY_GPU.match(line[len(BUSY_MARK):].strip())
            busy.append(f"GPU {match[1]}: {match[2].strip()}" if match else line[len(BUSY_MARK):].strip())
        elif line.startswith(REBOOT_MARK):
            reboot.append(line[len(REBOOT_MARK):].strip())
    return MigOutcome(ok, tuple(busy), tuple(reboot), tuple(lines))


def _mig_if_idle(state: State, host: Host, script: str, entries: tuple[str, ...], cdi: str,
                 if_busy: Callable[[Host, str], bool], if_reboot: Callable[[Host, str], bool] | None) -> bool:
    ok, out = as_op.run(host, mig_command(script, entries, cdi))
    outcome = read_mig_outcome(ok, [printable(line.line) for line in out] if out else [])
    if outcome.only_busy:  # every GPU it names runs work: nothing was changed
        return bool(if_busy(host, "; ".join(outcome.busy)))
    for line in outcome.lines:
        if line.startswith(BUSY_MARK):
            continue
        if ok:
            host.log_styled(line, log_func=logger.info)
        else:
            host.log_styled(line, fg="red", log_func=logger.error)
    if outcome.reboot and if_reboot is not None:
        ok = bool(if_reboot(host, "; ".join(outcome.reboot))) and ok
    if outcome.busy:  # the idle GPUs were changed, the busy ones are pending
        ok = bool(if_busy(host, "; ".join(outcome.busy))) and ok
    return ok


@operation(is_idempotent=False)
def mig_partitions(setting: Any, script: str, cdi: str, if_busy: Callable[[Host, str], bool],
                   if_reboot: Callable[[Host, str], bool] | None = None) -> Generator[FunctionCommand, None, None]:
    """MIG mode and GPU/compute instances as gpu_mig sets them, on the GPUs not there yet; each GPU
    only while no GPU work runs on it (checked right before, in the same command).

    + setting: gpu_mig (checked at planning: a refused layout never reaches this operation)
    + script: the MIG script's text (fixed; its values are its arguments)
    + cdi: the CDI spec to regenerate after a change ("" = none)
    + if_busy: called as if_busy(host, what runs, per GPU) when GPU work runs on GPUs to change;
      those are not changed (the others are); its answer is the operation's success
    + if_reboot: called as if_reboot(host, which GPUs) when a MIG mode change stays pending because
      the GPU reset that makes it effective was refused; None: reported by the script's lines only
    """
    plan = plan_mig(setting, gpu_state(host).gpus, mig_state(host))
    if not plan.managed:
        host.noop("gpu_mig: unmanaged: MIG is left alone")
        return
    if not plan.changes:
        host.noop(f"MIG partitions as gpu_mig sets them: {plan.summary()}")
        return
    yield FunctionCommand(_mig_if_idle, (script, tuple(g.entry for g in plan.changes), cdi, if_busy, if_reboot), {})
