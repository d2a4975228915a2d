"""What a run leaves for later, per host, said once at the end of the run: a driver, CUDA
toolkit or cuDNN upgrade all.py leaves to tools/rollout, a CUDA toolkit or cuDNN changed by
hand, a reboot still needed, a Docker configuration change waiting for a restart.

The deploys and operations that find these record them in the host's context
(`outcome(host)`, a gpufleet.config.hostcontext.HostOutcome) while the run plans, or for a
reboot while it executes; the gate, the fleet report (gpufleet/apps/report/gather.py) and
the end-of-run summary read them there. `RunSummary` is a reader of the host contexts: the
summary is said when the run's last host disconnects (gpufleet/controller/run_end.py), not
at the interpreter's exit.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import click

from gpufleet.catalog.cuda_stack import pending_message, stack_pending_message
from gpufleet.config.hostcontext import HostOutcome, host_context, real_object
from gpufleet.controller.run_end import at_run_end
from gpufleet.controller.run_result import ACCEPTS_NEXT

T = TypeVar("T")


@dataclass
class RunSummary:
    #: host name -> (installed, resolved) driver
    driver_pending: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: host name -> {"CUDA toolkit" | "cuDNN": (installed, resolved)}
    stack_pending: dict[str, dict[str, tuple[str, str]]] = field(default_factory=dict)
    #: host name -> {"CUDA toolkit" | "cuDNN": [what changed by hand]}: left as found, the gate FAILs them
    stack_by_hand: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    #: host name -> why it needs a reboot
    needs_reboot: dict[str, str] = field(default_factory=dict)
    #: hosts whose reboot found GPU work right before it (started after planning): not rebooted
    busy_at_reboot: set[str] = field(default_factory=set)
    #: host name -> (daemon.json keys, why): a Docker restart not done under running GPU containers
    docker_pending: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    #: host name -> (the MIG layout not applied, what ran): GPU work found right before the change
    mig_pending: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: host name -> the GPUs whose MIG mode change waits for a reboot (the GPU reset was refused)
    mig_reboot: dict[str, str] = field(default_factory=dict)
    #: host name -> the tuning_profiling setting the loaded nvidia module does not have yet (next boot)
    profiling_pending: dict[str, str] = field(default_factory=dict)
    #: host name -> the old mount points of a scratch that moved (storage_scratch_path), left mounted
    scratch_moved: dict[str, str] = field(default_factory=dict)
    #: host name -> why the converged host is not accepted (no acceptance on record for its driver and CUDA)
    not_accepted: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, hosts: Iterable[Any]) -> RunSummary:
        """The records of these hosts' contexts (a host that leaves nothing has none)."""
        summary = cls()
        for host in hosts:
            done, name = host_context(host).outcome, real_object(host).name
            for kind in _KINDS:
                value = getattr(done, kind)
                if value:
                    getattr(summary, kind)[name] = value
            if done.busy_at_reboot:
                summary.busy_at_reboot.add(name)
        return summary

    def pending(self, name: str) -> list[str]:
        """What all.py leaves alone on this host: drift all the same, each for tools/rollout."""
        versions = self.driver_pending.get(name)
        return ([pending_message(*versions)] if versions else []) + [
            stack_pending_message(what, *moves) for what, moves in self.stack_pending.get(name, {}).items()] + [
            message for messages in self.stack_by_hand.get(name, {}).values() for message in messages]

    def forget(self, name: str) -> None:
        """Drop every record of one host (a test's observation, taken)."""
        for records in (self.driver_pending, self.stack_pending, self.stack_by_hand, self.needs_reboot,
                        self.docker_pending, self.mig_pending, self.mig_reboot, self.profiling_pending,
                        self.scratch_moved, self.not_accepted):
            records.pop(name, None)
        self.busy_at_reboot.discard(name)

    def report(self, accepts_next: bool = False) -> str:
        """The end-of-run summary ("" when the run leaves nothing). `accepts_next`: gpufleet-deploy
        runs the acceptance of the converged hosts right after this run."""
        return "".join((
            _section(self.driver_pending, lambda versions: pending_message(*versions),
                     "with a DRIVER UPGRADE PENDING; deploys/all.py changed no driver (driver_upgrade_in_place: "
                     "false). Roll it out with canary and batches: tools/rollout INVENTORY"),
            _section(self.stack_pending,
                     lambda pending: "; ".join(stack_pending_message(what, *v) for what, v in pending.items()),
                     "with a CUDA/cuDNN UPGRADE PENDING; deploys/all.py changed neither (driver_upgrade_in_place: "
                     "false). Roll it out with canary and batches: tools/rollout INVENTORY"),
            _section(self.stack_by_hand, lambda drift: "; ".join(m for messages in drift.values() for m in messages),
                     "whose CUDA toolkit or cuDNN was CHANGED BY HAND; deploys/all.py left it (the validation gate "
                     "fails it). tools/rollout INVENTORY puts it back at the resolved release:"),
            _section(self.needs_reboot, str, "NEED A REBOOT to load the installed NVIDIA driver:"),
            _section(self.docker_pending, lambda record: f"{', '.join(record[0])} ({record[1]})",
                     "have a Docker configuration change PENDING (needs a Docker restart, not done under running "
                     "GPU containers):"),
            _section(self.mig_pending, lambda record: f"{record[0]} (GPU work running: {record[1]})",
                     "with MIG partitions PENDING (not changed: GPU work was running right before the change); "
                     "re-run deploys/all.py once the GPUs are idle:"),
            _section(self.mig_reboot, str,
                     "NEED A REBOOT for a MIG mode change (the GPU reset that makes it effective was refused); "
                     "the boot unit makes the partitions after it:"),
            _section(self.profiling_pending, str,
                     "with GPU profiling PENDING (the nvidia module gets it at its next load; deploys/all.py does "
                     "not reboot for it): reboot them through the gate: tools/rollout INVENTORY"),
            _section(self.scratch_moved, str,
                     "whose scratch MOVED (storage_scratch_path) and is STILL MOUNTED at the old path too (jobs may "
                     "use it; gpufleet does not unmount it): unmount it once nothing uses it, or reboot:"),
            _section(self.not_accepted, str, NOT_ACCEPTED_NEXT if accepts_next else NOT_ACCEPTED),
        ))


def _section(records: Mapping[str, T], line: Callable[[T], str], headline: str) -> str:
    """One kind of record: how many hosts and what to do, then a line per host ("" for none)."""
    if not records:
        return ""
    lines = "\n".join(f"    {name}: {line(record)}" for name, record in sorted(records.items()))
    return f"\n--> gpufleet: {len(records)} host(s) {headline}\n{lines}\n"


NOT_ACCEPTED = ("converged but NOT ACCEPTED: no acceptance on record for their driver and CUDA (a new node "
                "proves itself with a peer before it takes jobs). Accept them: gpufleet-deploy INVENTORY --accept")
NOT_ACCEPTED_NEXT = "converged, NOT ACCEPTED yet: gpufleet-deploy runs their acceptance now:"


#: The kinds of record: HostOutcome's fields, each a dict of RunSummary's (busy_at_reboot: a set).
_KINDS = ("driver_pending", "stack_pending", "stack_by_hand", "needs_reboot", "docker_pending", "mig_pending",
          "mig_reboot", "profiling_pending", "scratch_moved", "not_accepted")


def outcome(host: Any) -> HostOutcome:
    """What this run leaves for later on `host`, to record into; the run says it at its end."""
    state = getattr(real_object(host), "state", None)
    if hasattr(state, "add_callback_handler"):  # a stand-in outside any pyinfra run has no end to say it at
        at_run_end(state, say_at_run_end)
    return host_context(host).outcome


def pending(host: Any) -> list[str]:
    """What all.py leaves alone on this host this run (RunSummary.pending)."""
    return RunSummary.of([host]).pending(real_object(host).name)


def say_at_run_end(state: Any) -> None:
    """The end-of-run summary of every host of the run (nothing when they leave nothing)."""
    text = RunSummary.of(state.inventory).report(accepts_next=os.environ.get(ACCEPTS_NEXT) == "1")
    if text:
        click.echo(text, err=True)
