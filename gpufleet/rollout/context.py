"""What one rollout run tells the per-host steps (deploys/upgrade.py), and what they report back.

The runner makes one RolloutContext per run and passes it to every phase; steps record what
they found per host name (survey), why they refused a host (reasons) and special outcomes
(busy, reboot-pending), which the runner turns into the state file.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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

    def refuse(self, host: Any, message: str, outcome: str | None = None) -> None:
        """Fail `host` for the rest of this phase, with the reason the runner reports."""
        from gpufleet.failures import fail_host

        host = real_host(host)
        self.reasons[host.name] = message
        if outcome:
            self.outcomes[host.name] = outcome
        fail_host(host, "rollout", message)

    def note(self, host: Any, message: str) -> None:
        self.notes.setdefault(host.name, []).append(message)


def real_host(host: Any) -> Any:
    """The Host object behind pyinfra's `host` context proxy (sets of hosts must hold the real one)."""
    from pyinfra.context import ctx_host

    return ctx_host.get() if host is ctx_host.context else host
