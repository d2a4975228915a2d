"""Taking a GPU host out of service for maintenance, and giving it back: Slurm drain/resume,
waiting for running GPU processes, stopping GPU containers."""
from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.gpu import GpuState
from facts.rollout import GpuContainers, SlurmNode


@operation()
def slurm_node(drained: bool = True, reason: str = "gpufleet maintenance"):
    """Drain the host's Slurm node (no new jobs; running ones finish), or resume it.

    + drained: True = `scontrol update state=drain reason=...`, False = `state=resume`
    + reason: the drain reason Slurm shows (sinfo -R)
    Does nothing when `scontrol` is not installed.
    """
    node = host.get_fact(SlurmNode)
    if not node.scontrol:
        host.noop("Slurm is not installed (no scontrol): nothing to drain")
        return
    state = (node.state or "").upper()
    if drained and "DRAIN" in state:
        host.noop(f"Slurm node {node.node} is draining already ({node.state})")
        return
    if not drained and state and "DRAIN" not in state:
        host.noop(f"Slurm node {node.node} is not drained ({node.state})")
        return
    args = [QuoteString(node.scontrol), "update", QuoteString(f"nodename={node.node}")]
    args += [QuoteString("state=drain"), QuoteString(f"reason={reason}")] if drained else [QuoteString("state=resume")]
    yield StringCommand(*args)


# $1 polls, $2 seconds between polls, $3 the wait in seconds (for the message)
_WAIT_IDLE = r"""
busy() { [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]; }
for i in $(seq "$1"); do busy || exit 0; sleep "$2"; done
if busy; then
  echo "GPU processes still running after $3 s:" >&2
  nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader >&2
  exit 1
fi
"""


@operation()
def gpus_idle(wait_seconds: int = 0, poll_seconds: int = 5):
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


@operation()
def gpu_containers_stopped(timeout: int = 60):
    """Stop the running Docker containers that use GPUs (NVIDIA runtime or GPU device requests)."""
    ids = host.get_fact(GpuContainers)
    if not ids:
        host.noop("no GPU container is running")
        return
    yield StringCommand("docker", "stop", "--time", str(int(timeout)), *(QuoteString(i) for i in ids))
