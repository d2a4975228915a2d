"""The host's Slurm node as slurmctld sees it: its name, state, drain reason and features."""
from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, with_values


# The reason every drain gpufleet sets starts with this: a node drained for another reason (by an
# admin, by Slurm's health check) is never resumed by gpufleet.
SLURM_REASON_TAG = "gpufleet"


@dataclass(frozen=True)
class SlurmNodeData(JsonMixin):
    scontrol: str | None      # path of scontrol, None when Slurm's client is not installed
    node: str                 # the Slurm node name (rollout_slurm_node_name, default the short host name)
    state: str | None = None  # sinfo's long state: idle, mixed, allocated, draining, drained, down*...; None = unknown
    reason: str = ""          # the drain/down reason Slurm shows (sinfo -R)
    error: str = ""           # why the state could not be read (slurmctld unreachable, node unknown)
    available_features: tuple[str, ...] = ()   # scontrol show node: AvailableFeatures
    active_features: tuple[str, ...] = ()      # ActiveFeatures

    @property
    def drain_set(self) -> bool:
        """Drain requested (draining: jobs still running; or drained)."""
        return bool(self.state and self.state.startswith(("drain", "drng")))

    @property
    def drained(self) -> bool:
        """Drained and no job left on it (sinfo: drained, not draining)."""
        return bool(self.state and self.state.startswith("drained"))

    @property
    def ours(self) -> bool:
        """Drained by gpufleet (the reason carries its tag)."""
        return self.reason.startswith(SLURM_REASON_TAG)


class SlurmNode(FactBase[SlurmNodeData]):
    """Whether Slurm's `scontrol` exists on the host, the host's Slurm node name, its state and
    drain reason (from sinfo, which asks slurmctld)."""

    @override
    def command(self, node: str = "") -> str:
        if node and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", node):
            raise ValueError(f"not a Slurm node name: {node!r}")
        return with_values(
                "n=${node:-$(hostname -s)}; echo \"node $n\"; "
                "if p=$(command -v scontrol); then echo \"scontrol $p\"; "
                "out=$(sinfo -h -N -n \"$n\" -o '%T|%E' 2>&1); rc=$?; "
                "if [ $rc -ne 0 ]; then echo \"error $out\" | head -1; "
                "elif [ -z \"$out\" ]; then echo \"error node $n is not in the Slurm cluster\"; "
                "else echo \"$out\" | head -1 | sed 's/^/state /'; "
                "scontrol show node -o \"$n\" 2>/dev/null | tr ' ' '\\n' | sed -n 's/^\\(Available\\|Active\\)Features=/features \\1 /p'; "
                "fi; fi", node=node)

    @override
    def process(self, output: list[str]) -> SlurmNodeData:
        node, scontrol, state, reason, error = "", None, None, "", ""
        available: tuple[str, ...] = ()
        active: tuple[str, ...] = ()
        for line in output:
            key, _, value = line.strip().partition(" ")
            if key == "node":
                node = value
            elif key == "scontrol":
                scontrol = value
            elif key == "state":
                state, _, reason = value.partition("|")
                reason = "" if reason == "none" else reason
            elif key == "error":
                error = value
            elif key == "features":
                kind, _, names = value.partition(" ")
                found = tuple(f for f in names.split(",") if f and f != "(null)")
                if kind == "Available":
                    available = found
                elif kind == "Active":
                    active = found
        return SlurmNodeData(scontrol, node, state, reason, error, available, active)
