"""What one rollout run tells the per-host steps (deploys/upgrade.py), and what they report back.

The runner makes one RolloutContext per run and passes it to every phase; steps record what
they found per host name (survey), why they refused a host (reasons) and special outcomes
(busy, reboot-pending), which the runner turns into the state file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.config.hostcontext import real_object as real_host  # sets of hosts must hold the real one


@dataclass
class RolloutContext:
    target: str
    manifests_dir: Path = Path(".gpufleet/manifests")
    wait_idle: int = 0               # seconds running GPU processes may take to finish
    force: bool = False              # upgrade even while GPU processes run
    stop_containers: bool = False    # stop GPU containers while draining
    reboot_timeout: int = 600
    retune: bool = False             # after the reboot run deploys/tuning.py instead of restoring the record
    survey: dict[str, dict[str, Any]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    outcomes: dict[str, str] = field(default_factory=dict)      # "busy" | "reboot-pending"
    manifests: dict[str, dict[str, Any]] = field(default_factory=dict)  # host -> manifest (this rollout)
    manifest_paths: dict[str, str] = field(default_factory=dict)       # host -> controller copy
    notes: dict[str, list[str]] = field(default_factory=dict)
    #: host -> the CUDA toolkit / cuDNN packages and the exact releases it resolves to: installed
    #: ones that differ move with the driver (or alone), through the same steps
    stack: dict[str, dict[str, str]] = field(default_factory=dict)
    #: the canary batch's hosts: their validation also runs DCGM's diagnostic at the tier's
    #: rollout_canary_diag_level, so a driver that breaks the GPUs stops the rollout there
    canaries: set[str] = field(default_factory=set)

    def refuse(self, host: Any, reason: str, fix: str, outcome: str | None = None, area: str = "rollout") -> None:
        """Refuse `host` for the rest of this phase (gpufleet.config.failures.refuse), with the reason and
        fix the runner reports."""
        from gpufleet.config.failures import refuse

        host = real_host(host)
        self.reasons[host.name] = f"{reason.strip().rstrip('.')}. Fix: {fix}"
        if outcome:
            self.outcomes[host.name] = outcome
        refuse(host, area, reason, fix)

    def note(self, host: Any, message: str) -> None:
        self.notes.setdefault(host.name, []).append(message)
