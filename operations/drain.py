"""Taking a GPU host out of service for maintenance, and giving it back: Slurm drain/resume,
waiting for running GPU processes, stopping GPU containers."""
from __future__ import annotations

import re
from collections.abc import Generator

from pyinfra import host
from pyinfra.api import Host, QuoteString, StringCommand, operation

from gpufleet.facts._common import GPU_WORK
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.docker import GpuContainers
from gpufleet.facts.driver import GpuDeviceUsers
from gpufleet.facts.slurm import SLURM_REASON_TAG, SlurmNode
from gpufleet.config.failures import refuse


def gpu_work(h: Host) -> list[str]:
    """GPU work running now, as planning sees it ("PID NAME" each): nvidia-smi's compute processes,
    and processes holding a /dev/nvidiaN open (still visible when NVML fails, e.g. on a
    driver/library mismatch). The names are their users' text, for messages only; what decides is
    that the list is not empty. The same test runs again in the command that makes the change
    (idle_check): a job started after planning is seen there."""
    state = h.get_fact(GpuState)  # with its compute processes (the shared gpu_state has none)
    found = [f"{p.pid} {p.process_name or '?'}" for p in state.processes]
    seen = {p.pid for p in state.processes}
    found += [f"{pid} (holds /dev/nvidia*)" for pid in h.get_fact(GpuDeviceUsers) if pid not in seen]
    return found


@operation()
def slurm_node(drained: bool = True, reason: str = "gpufleet maintenance", node: str = ""
               ) -> Generator[StringCommand, None, None]:
    """Drain the host's Slurm node (no new jobs; running ones finish), or resume it.

    + drained: True = `scontrol update state=drain reason=...`, False = `state=resume`
    + reason: the drain reason Slurm shows (sinfo -R); must start with "gpufleet" (SLURM_REASON_TAG)
    + node: the Slurm node name (default: the host's short host name)
    Does nothing when `scontrol` is not installed. Leaves alone a node someone else drained: it
    is not drained again (its reason stays) and never resumed.
    """
    if drained and not reason.startswith(SLURM_REASON_TAG):
        raise ValueError(f"a gpufleet drain reason starts with {SLURM_REASON_TAG!r}: {reason!r}")
    info = host.get_fact(SlurmNode, node=node)
    if not info.scontrol:
        host.noop("Slurm is not installed (no scontrol): nothing to drain")
        return
    if info.error:
        if drained:
            refuse(host, "rollout_slurm_node_name", f"cannot drain Slurm node {info.node}: {info.error}",
                   "set rollout_slurm_node_name if the node has another name in Slurm")
        else:
            host.noop(f"Slurm node {info.node}: state unknown ({info.error}): not resumed")
        return
    if drained and info.drain_set:
        host.noop(f"Slurm node {info.node} is drained already ({info.state}: {info.reason or 'no reason'})")
        return
    # DOWN after `scontrol reboot ASAP nextstate=DOWN` (rollout_slurm_reboot: slurm): resumed
    # like a drain, once gpufleet validated the node
    down = bool(info.state and info.state.startswith("down"))
    if not drained and not info.drain_set and not down:
        host.noop(f"Slurm node {info.node} is not drained ({info.state})")
        return
    if not drained and not info.ours:
        how = "drained" if info.drain_set else "down"
        host.noop(f"Slurm node {info.node} was {'drained' if info.drain_set else 'set down'} by someone else "
                  f"({info.reason or 'no reason'}): left {how}")
        return
    args = [QuoteString(info.scontrol), "update", QuoteString(f"nodename={info.node}")]
    args += [QuoteString("state=drain"), QuoteString(f"reason={reason}")] if drained else [QuoteString("state=resume")]
    yield StringCommand(*args)


DRIVER_FEATURE = "gpufleet_driver_"


def driver_feature(version: str) -> str:
    """The Slurm node feature naming the loaded driver, e.g. gpufleet_driver_580.126.09 (Slurm
    22.05 takes dots in feature names and in --constraint: checked on the e2e cluster)."""
    return DRIVER_FEATURE + version


@operation()
def slurm_driver_feature(version: str, node: str = "") -> Generator[StringCommand, None, None]:
    """Give the Slurm node the feature naming its loaded driver (and drop an older one), keeping
    its other features, so that `--constraint=gpufleet_driver_<version>` keeps a multi-node job
    on nodes of one driver.

    + version: the loaded driver version; empty = no driver loaded: the feature is only dropped
    + node: the Slurm node name (default: the host's short host name)
    Set with `scontrol update availablefeatures=... activefeatures=...`: slurmctld keeps it until
    a restart or `scontrol reconfigure` rereads slurm.conf's Feature= for the node.
    """
    if version and not re.fullmatch(r"[0-9][0-9.]*", version):
        raise ValueError(f"not a driver version: {version!r}")
    info = host.get_fact(SlurmNode, node=node)
    if not info.scontrol or info.error:
        host.noop("no Slurm node to label")
        return
    wanted = [driver_feature(version)] if version else []

    def relabel(features: tuple[str, ...]) -> list[str]:
        return [f for f in features if not f.startswith(DRIVER_FEATURE)] + wanted

    available, active = relabel(info.available_features), relabel(info.active_features)
    if available == list(info.available_features) and active == list(info.active_features):
        host.noop(f"Slurm node {info.node} has the feature {wanted[0] if wanted else '(none)'}")
        return
    yield StringCommand(QuoteString(info.scontrol), "update", QuoteString(f"nodename={info.node}"),
                        QuoteString(f"availablefeatures={','.join(available)}"),
                        QuoteString(f"activefeatures={','.join(active)}"))


#: exit status of a command refused because GPU work runs (EX_TEMPFAIL: not a failure, try later)
BUSY_EXIT = 75
#: how such a refusal's line starts: the rollout tells "busy, pending" from a failure by it
BUSY_MARK = "gpufleet: BUSY:"


def _busy_text(script: str) -> str:
    """`script` with MARK and BUSY_EXIT filled in: a wait that times out with work still running
    ends like a refused change (the rollout tells busy from failed by the mark, never by names)."""
    return script.replace("MARK", BUSY_MARK).replace("BUSY_EXIT", str(BUSY_EXIT))


# Polls sinfo until the node's state is drained (no job left); $1 node, $2 timeout in seconds.
_WAIT_DRAINED = _busy_text(
    "end=$(( $(date +%s) + $2 )); "
    "while :; do s=$(sinfo -h -N -n \"$1\" -o %T | head -1); "
    "case $s in drained*) echo \"Slurm node $1: $s\"; exit 0;; esac; "
    "if [ \"$(date +%s)\" -ge $end ]; then squeue -h -w \"$1\" -o '%i %u %j %M' | tr '\\n' ' ' >&2; echo >&2; "
    "echo \"MARK Slurm node $1 is still $s after $2 s: its jobs did not finish (rollout_drain_timeout)\" >&2; "
    "exit BUSY_EXIT; fi; "
    "sleep 2; done"
)


@operation(is_idempotent=False)
def slurm_node_drained(node: str = "", timeout: int = 3600) -> Generator[StringCommand, None, None]:
    """Wait until the host's Slurm node is DRAINED (its running jobs have finished).

    + node: the Slurm node name (default: the host's short host name)
    + timeout: seconds to wait; then the operation fails, listing the jobs still running
    """
    info = host.get_fact(SlurmNode, node=node)
    if not info.scontrol or info.error:
        host.noop("no Slurm node to wait for")
        return
    yield StringCommand("sh", "-c", QuoteString(_WAIT_DRAINED), "wait-drained", QuoteString(info.node),
                        str(int(timeout)))


# $1 polls, $2 seconds between polls, $3 the wait in seconds (for the message). What runs is told
# by pid alone; the names (their users' text, newlines and all) are for the message, on one line.
_WAIT_IDLE = _busy_text(r"""
busy() { [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]; }
for i in $(seq "$1"); do busy || exit 0; sleep "$2"; done
if busy; then
  { echo "MARK GPU processes still running after $3 s:"; nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader; } \
    | tr '\n' ' ' >&2; echo >&2
  exit BUSY_EXIT
fi
""")


@operation()
def gpus_idle(wait_seconds: int = 0, poll_seconds: int = 5) -> Generator[StringCommand, None, None]:
    """Wait until no process runs on the GPUs; fail when some still run after `wait_seconds`.

    + wait_seconds: how long running jobs may take to finish (0 = do not wait: fail now)
    + poll_seconds: how often nvidia-smi is asked
    """
    processes = host.get_fact(GpuState).processes
    if not processes:
        host.noop("no process runs on the GPUs")
        return
    polls = max(1, wait_seconds // max(1, poll_seconds))
    yield StringCommand("sh", "-c", QuoteString(_WAIT_IDLE), "gpufleet-gpus-idle",
                        str(int(polls)), str(int(poll_seconds)), str(int(wait_seconds)))


_REFUSED = re.compile(r"^not [a-z ]+$")


def idle_check(refused: str, per_gpu: bool = False) -> str:
    """Fixed shell text that ends its command with BUSY_EXIT and a BUSY_MARK line when GPU work
    runs (GPU_WORK), else goes on. Put first in the very command that reboots or swaps packages,
    the check belongs to the action: a job started after planning is seen, not killed.

    + refused: what the refusal says was not done ("not rebooting"): fixed text of the caller
    + per_gpu: the command's INDEX=... arguments name the GPUs it changes (the MIG script's); only
      work on those GPUs counts (GPU_WORK_ON), a busy GPU's argument is dropped with a BUSY_MARK
      line naming it, and the command ends with BUSY_EXIT only when no GPU is left to change.
      False: any GPU work on the host counts (a driver change or a reboot touches every GPU)
    """
    if not _REFUSED.match(refused):
        raise ValueError(f"not a fixed 'not ...' phrase: {refused!r}")
    if per_gpu:
        return GPU_WORK_ON + "\n" + _busy_text(_DROP_BUSY.replace("REFUSED", refused))
    return (GPU_WORK + "; if [ -n \"$pids$apps\" ]; then echo \"" + BUSY_MARK + " GPU work is running, " + refused
            + ": ${apps:+$apps }${pids:+processes holding /dev/nvidia*: $pids}\" | tr '\\n' ' ' >&2; echo >&2; "
            "exit " + str(BUSY_EXIT) + "; fi")


#: Shell function gpu_work INDEX: prints what runs on that one GPU (empty: idle). Read when it runs,
#: from what users cannot write: the GPU's PCI address (nvidia-smi --query-gpu), its device minor
#: (the driver's /proc/driver/nvidia/gpus/<address>/information, root's), the processes holding its
#: device node /dev/nvidia<minor> (the kernel's fd links, matched whole by find -lname), and the
#: compute processes nvidia-smi lists on that address (gpu_bus_id and pid only; their names, which
#: a user chooses, are looked up afterwards for the message alone). What cannot be read counts as
#: busy: a GPU nvidia-smi does not name, or (no device minor) a holder of any GPU's device node.
GPU_WORK_ON = r"""
gpu_holders=$(find /proc/[0-9]*/fd -maxdepth 1 -lname '/dev/nvidia[0-9]*' -printf '%h %l\n' 2>/dev/null)
gpu_apps=$(nvidia-smi --query-compute-apps=gpu_bus_id,pid --format=csv,noheader 2>/dev/null) || gpu_apps=
gpu_work() {
  bus=$(nvidia-smi -i "$1" --query-gpu=pci.bus_id --format=csv,noheader 2>/dev/null | tr 'A-F' 'a-f')
  case $bus in *:*:*.[0-7]) ;; *) echo "nvidia-smi does not name GPU $1"; return;; esac
  minor=$(sed -n 's/^Device Minor:[[:space:]]*\([0-9][0-9]*\)$/\1/p' \
    "/proc/driver/nvidia/gpus/${bus#????}/information" 2>/dev/null)
  held=$(printf '%s\n' "$gpu_holders" | while read -r dir target; do
    if [ -n "$minor" ]; then [ "$target" = "/dev/nvidia$minor" ] || continue
    else case "$target" in /dev/nvidia[0-9]*) ;; *) continue;; esac; fi
    dir=${dir#/proc/}; echo "${dir%/fd}"
  done | sort -un | tr '\n' ' ')
  run=$(printf '%s\n' "$gpu_apps" | awk -F', *' -v b="$bus" 'tolower($1) == b && $2 ~ /^[0-9]+$/ { print $2 }' \
    | sort -un | tr '\n' ' ')
  names=""
  for p in $run; do
    names="$names$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null \
      | awk -F', ' -v p="$p" '$1 == p { print; exit }' | tr -d '\n'); "
  done
  names=${names%; }
  node="/dev/nvidia${minor:-*}"
  echo "${names}${held:+${names:+ }processes holding $node: ${held% }}"
}
"""


# The per-GPU check's decision: each INDEX=... argument on a busy GPU is dropped (and named on a
# BUSY_MARK line); nothing left to change ends the command with BUSY_EXIT.
_DROP_BUSY = r"""busy_gpus=""
n=$#
while [ "$n" -gt 0 ]; do
  arg=$1; shift; n=$((n-1))
  case $arg in
    [0-9]*=*)
      i=${arg%%=*}
      case $i in *[!0-9]*) set -- "$@" "$arg"; continue;; esac
      what=$(gpu_work "$i")
      if [ -n "$what" ]; then
        echo "MARK GPU work is running on GPU $i, REFUSED: $what" | tr '\n' ' ' >&2; echo >&2
        busy_gpus="$busy_gpus $i"
        continue
      fi
      todo=1;;
  esac
  set -- "$@" "$arg"
done
if [ -n "$busy_gpus" ] && [ -z "${todo:-}" ]; then exit BUSY_EXIT; fi
"""


# $1 seconds to wait, $2 seconds between checks
_IDLE_LOOP = (
    "end=$(( $(date +%s) + $1 )); while :; do " + GPU_WORK + "; "
    "[ -z \"$pids$apps\" ] && exit 0; " + _busy_text(
    "if [ \"$(date +%s)\" -ge $end ]; then echo \"MARK GPU processes still running after $1 s:"
    " ${apps:+$apps }${pids:+processes holding /dev/nvidia*: $pids}\" | tr '\\n' ' ' >&2; echo >&2; exit BUSY_EXIT; fi; ")
    + "sleep $2; done"
)


@operation(is_idempotent=False)
def gpus_idle_now(wait_seconds: int = 0, poll_seconds: int = 5) -> Generator[StringCommand, None, None]:
    """Like gpus_idle, but checked when it runs rather than when planned: after a Slurm drain has
    waited for the node's jobs, what still runs on the GPUs is not Slurm's.

    + wait_seconds: how long such processes may take to finish (0 = do not wait: fail now)
    + poll_seconds: how often to look again
    """
    yield StringCommand("sh", "-c", QuoteString(_IDLE_LOOP), "gpus-idle", str(int(wait_seconds)),
                        str(int(max(1, poll_seconds))))


@operation()
def gpu_containers_stopped(timeout: int = 60) -> Generator[StringCommand, None, None]:
    """Stop the running Docker containers that use GPUs (NVIDIA runtime or GPU device requests)."""
    ids = host.get_fact(GpuContainers)
    if not ids:
        host.noop("no GPU container is running")
        return
    yield StringCommand("docker", "stop", "--time", str(int(timeout)), *(QuoteString(i) for i in ids))
