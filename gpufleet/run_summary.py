"""What a run leaves for later, per host, said once at the end of the run: a driver, CUDA
toolkit or cuDNN upgrade all.py leaves to tools/rollout, a CUDA toolkit or cuDNN changed by
hand, a reboot still needed, a Docker configuration change waiting for a restart.

The deploys and operations that find these record them here (while the run plans, or for a
reboot, while it executes); the end-of-run summary and the fleet report
(gpufleet/apps/report/gather.py) read the same records. Nobody reads a deploy's globals, and the
one hook at the interpreter's exit is this module's.
"""
from __future__ import annotations

import atexit
from dataclasses import dataclass, field

import click

from gpufleet.cuda_stack import pending_message, stack_pending_message


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

    def pending(self, name: str) -> list[str]:
        """What all.py leaves alone on this host: drift all the same, each for tools/rollout."""
        versions = self.driver_pending.get(name)
        return ([pending_message(*versions)] if versions else []) + [
            stack_pending_message(what, *moves) for what, moves in self.stack_pending.get(name, {}).items()] + [
            message for messages in self.stack_by_hand.get(name, {}).values() for message in messages]

    def forget(self, name: str) -> None:
        """Drop every record of one host (a test's observation, taken)."""
        for records in (self.driver_pending, self.stack_pending, self.stack_by_hand, self.needs_reboot,
                        self.docker_pending, self.mig_pending, self.mig_reboot, self.profiling_pending):
            records.pop(name, None)
        self.busy_at_reboot.discard(name)

    def report(self) -> str:
        """The end-of-run summary ("" when the run leaves nothing)."""
        out = []
        if self.driver_pending:
            lines = "\n".join(f"    {name}: {pending_message(*versions)}"
                              for name, versions in sorted(self.driver_pending.items()))
            out.append(f"\n--> gpufleet: {len(self.driver_pending)} host(s) with a DRIVER UPGRADE PENDING; "
                       "deploys/all.py changed no driver (driver_upgrade_in_place: false). Roll it out with canary "
                       f"and batches: tools/rollout INVENTORY\n{lines}\n")
        if self.stack_pending:
            lines = "\n".join(f"    {name}: " + "; ".join(stack_pending_message(what, *v) for what, v in pending.items())
                              for name, pending in sorted(self.stack_pending.items()))
            out.append(f"\n--> gpufleet: {len(self.stack_pending)} host(s) with a CUDA/cuDNN UPGRADE PENDING; "
                       "deploys/all.py changed neither (driver_upgrade_in_place: false). Roll it out with canary "
                       f"and batches: tools/rollout INVENTORY\n{lines}\n")
        if self.stack_by_hand:
            lines = "\n".join(f"    {name}: " + "; ".join(m for messages in drift.values() for m in messages)
                              for name, drift in sorted(self.stack_by_hand.items()))
            out.append(f"\n--> gpufleet: {len(self.stack_by_hand)} host(s) whose CUDA toolkit or cuDNN was CHANGED BY "
                       "HAND; deploys/all.py left it (the validation gate fails it). tools/rollout INVENTORY puts it "
                       f"back at the resolved release:\n{lines}\n")
        if self.needs_reboot:
            lines = "\n".join(f"    {name}: {why}" for name, why in sorted(self.needs_reboot.items()))
            out.append(f"\n--> gpufleet: {len(self.needs_reboot)} host(s) NEED A REBOOT to load the installed NVIDIA "
                       f"driver:\n{lines}\n")
        if self.docker_pending:
            lines = "\n".join(f"    {name}: {', '.join(keys)} ({why})"
                              for name, (keys, why) in sorted(self.docker_pending.items()))
            out.append(f"\n--> gpufleet: {len(self.docker_pending)} host(s) have a Docker configuration change "
                       f"PENDING (needs a Docker restart, not done under running GPU containers):\n{lines}\n")
        if self.mig_pending:
            lines = "\n".join(f"    {name}: {layout} (GPU work running: {running})"
                              for name, (layout, running) in sorted(self.mig_pending.items()))
            out.append(f"\n--> gpufleet: {len(self.mig_pending)} host(s) with MIG partitions PENDING (not changed: GPU "
                       f"work was running right before the change); re-run deploys/all.py once the GPUs are idle:\n{lines}\n")
        if self.mig_reboot:
            lines = "\n".join(f"    {name}: {gpus}" for name, gpus in sorted(self.mig_reboot.items()))
            out.append(f"\n--> gpufleet: {len(self.mig_reboot)} host(s) NEED A REBOOT for a MIG mode change (the GPU "
                       "reset that makes it effective was refused); the boot unit makes the partitions after it:\n"
                       f"{lines}\n")
        if self.profiling_pending:
            lines = "\n".join(f"    {name}: {what}" for name, what in sorted(self.profiling_pending.items()))
            out.append(f"\n--> gpufleet: {len(self.profiling_pending)} host(s) with GPU profiling PENDING (the nvidia "
                       "module gets it at its next load; deploys/all.py does not reboot for it): reboot them through "
                       f"the gate: tools/rollout INVENTORY\n{lines}\n")
        return "".join(out)


#: This run's records (one pyinfra run per process).
SUMMARY = RunSummary()


def _say_at_exit() -> None:
    text = SUMMARY.report()
    if text:
        click.echo(text, err=True)


atexit.register(_say_at_exit)
