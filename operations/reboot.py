"""Reboot a host and wait until it is back, booted for real (not just answering SSH)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Generator
from typing import Any, Callable

from pyinfra import logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation

from gpufleet.config.failures import fail_now
from gpufleet.config.hostcontext import host_context
from gpufleet.operations import as_op

from gpufleet.operations.drain import BUSY_MARK, idle_check

# Right before the reboot, in the same command: no process holds a GPU device node, and nvidia-smi
# (when it can answer: not during a driver/library mismatch) lists no compute process.
IDLE_CHECK = idle_check("not rebooting")

# /run is a tmpfs on every systemd host: a marker written there is gone after a real reboot.
# (Uptime and boot_id do not change when a container reboots; this works for both.)
MARKER = "/run/gpufleet-reboot-marker"


def _marker(host: Host) -> str | None:
    """The marker's text on the connection `host` has now, None when it did not answer. Not a
    change: no host lock, no reload guard (gpufleet/controller/hostlock.py), which on a host
    still going down would fail the reboot instead of waiting; no sudo either (the marker is
    world-readable), so no password goes to a host that may be mid-shutdown."""
    context = host_context(host)
    context.lock_in_fact += 1
    try:
        ok, out = host.run_shell_command(StringCommand("cat", MARKER, "2>/dev/null", "||", "echo", "gone"))
    except Exception:  # the connection dropped under it: not back yet
        return None
    finally:
        context.lock_in_fact -= 1
    lines = [line.line for line in out] if out else []
    return lines[-1].strip() if ok and lines else None


def _wait_for_reboot(state: State, host: Host, nonce: str, timeout: float, delay: float) -> bool:
    time.sleep(delay)
    host.disconnect()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            marker = _marker(host)
            if marker is not None and marker != nonce:
                # booted again: wait for systemd to finish (units that apply settings at boot);
                # the first command that may change something takes the lock again
                as_op.run(host, StringCommand("timeout 120 systemctl is-system-running --wait || true"))
                return True
            host.disconnect()
        time.sleep(1)
    return fail_now(state, host, "reboot", f"the host did not come back within {timeout:g} s of the reboot",
                           "look at its console (did it boot? is sshd up?); once it is back, re-run"
                           )


# $1 the marker's nonce. Written by a command of its own, before the reboot's: a reboot can cut
# the SSH connection before its command's exit status comes back (a loaded controller, a fast
# host), and then only a marker known to have been written tells "rebooted" from "never ran".
_MARK = 'echo "$1" > ' + MARKER
# $1 the journal line: the reason and the reboot in one command
_REBOOT = ('[ -z "$1" ] || logger -t gpufleet -- "$1"; '
           "( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
_REBOOT_IF_IDLE = IDLE_CHECK + "; " + _REBOOT


def _reboot(state: State, host: Host, nonce: str, note: str, timeout: float, delay: float, require_idle: bool,
            if_busy: Callable[[Host, str], bool] | None) -> bool:
    """Executing: (the idle check and) the reboot as one command, then the wait. Busy ->
    `if_busy(host, message)` says whether the operation still succeeds (nothing rebooted either
    way); without if_busy, busy fails. A command that failed saying nothing lost its connection
    to the reboot it started: the marker, written before, decides."""
    script, label = (_REBOOT_IF_IDLE, "reboot-if-idle") if require_idle else (_REBOOT, "reboot")
    ok, out = as_op.run(host, StringCommand("sh", "-c", QuoteString(script), label, QuoteString(note)))
    lines = [line.line for line in out] if out else []
    busy = next((line for line in lines if line.startswith(BUSY_MARK)), None)
    if busy and if_busy is not None:
        return bool(if_busy(host, busy[len(BUSY_MARK):].strip()))
    if not ok and lines:
        for line in lines:
            host.log_styled(line, fg="red", log_func=logger.error)
        return False
    if not ok:
        logger.warning(f"{host.name}: the connection dropped as the reboot began; waiting for the host")
    return _wait_for_reboot(state, host, nonce, timeout, delay)


@operation(is_idempotent=False)
def rebooted(reason: str = "", timeout: int = 600, delay: int = 2, require_idle: bool = False,
             if_busy: Callable[[Any, str], bool] | None = None
             ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """Reboot now and wait for the host to come back (checked with a marker in /run).

    + reason: logged in the journal before the reboot
    + timeout: seconds to wait for the host to be back
    + delay: seconds before the first reconnection attempt
    + require_idle: check for GPU work in the command that starts the reboot, and refuse if any runs
      (the operation fails naming it)
    + if_busy: with require_idle, instead of failing: called as if_busy(host, what runs) when GPU
      work runs; its result is the operation's (True: reported, not a failure; not rebooted)
    """
    nonce = uuid.uuid4().hex
    note = f"reboot: {reason}" if reason else ""
    yield StringCommand("sh", "-c", QuoteString(_MARK), "reboot-mark", QuoteString(nonce))
    yield FunctionCommand(_reboot, (nonce, note, timeout, delay, require_idle, if_busy), {})


# $1 node, $2 reason, $3 the marker's nonce. nextstate=DOWN, not RESUME: Slurm would put the node
# back in service as soon as its slurmd registers, before gpufleet validated the new driver
# (Slurm 22.05 knows only RESUME and DOWN); ASAP drains it, so no job starts before the reboot.
_SLURM_REBOOT = 'echo "$3" > ' + MARKER + '; scontrol reboot ASAP nextstate=DOWN reason="$2" "$1"'

# $1 node, $2 seconds: until slurmctld has seen the node's slurmd register after the reboot
# (DOWN, its reason ending in "reboot complete"); "reboot timed out" (ResumeTimeout) fails.
_WAIT_REGISTERED = (
    'end=$(( $(date +%s) + $2 )); while :; do s=$(sinfo -h -N -n "$1" -o "%T|%E" | head -1); '
    'case $s in "down|"*"reboot complete"*) echo "Slurm node $1 registered after its reboot: $s"; exit 0;; '
    '*"reboot timed out"*) echo "Slurm node $1: $s (ResumeTimeout in slurm.conf)" >&2; exit 1;; esac; '
    'if [ "$(date +%s)" -ge $end ]; then echo "Slurm node $1 is $s $2 s after its reboot: its slurmd did not '
    'register with slurmctld" >&2; exit 1; fi; sleep 2; done'
)


@operation(is_idempotent=False)
def slurm_rebooted(node: str, reason: str, timeout: int = 600, delay: int = 2, require_idle: bool = False
                   ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """Let Slurm reboot the node (`scontrol reboot ASAP nextstate=DOWN`, through slurm.conf's
    RebootProgram) and wait until the host is back (marker in /run gone) and its slurmd has
    registered; the node stays DOWN for gpufleet to validate and resume (drain.slurm_node).

    + node: the Slurm node name
    + reason: the node's reason while it reboots; starts with "gpufleet" so that the resume finds it ours
    + timeout: seconds for the reboot, and again for the registration
    + require_idle: refuse if GPU work runs, checked in the command that asks for the reboot
    """
    if not reason.startswith("gpufleet"):
        raise ValueError(f"a gpufleet reboot reason starts with 'gpufleet': {reason!r}")
    nonce = uuid.uuid4().hex
    script = (IDLE_CHECK + "; " if require_idle else "") + _SLURM_REBOOT
    yield StringCommand("logger", "-t", "gpufleet", QuoteString(f"reboot by Slurm: {reason}"))
    yield StringCommand("sh", "-c", QuoteString(script), "slurm-reboot", QuoteString(node), QuoteString(reason),
                        QuoteString(nonce))
    yield FunctionCommand(_wait_for_reboot, (nonce, timeout, delay), {})
    yield StringCommand("sh", "-c", QuoteString(_WAIT_REGISTERED), "wait-registered", QuoteString(node),
                        str(int(timeout)))
