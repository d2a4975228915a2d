"""systemd's daemon-reload, and the /dev/char links that keep GPU containers' devices across one.

A reload re-applies every unit's device policy; a container whose NVIDIA devices its unit does
not name (`DeviceAllow=/dev/char/MAJ:MIN`, missing when the container started before the links
existed) loses them: "Failed to initialize NVML: Unknown Error" until it is recreated (see
facts/devchar.py). So:

* ``dev_char_links``: NVIDIA's fix, installed with the container toolkit: its udev rule
  (`nvidia-ctk system create-dev-char-symlinks --create-all` whenever the driver binds, so at
  every boot) and the links now where some are missing.
* ``daemon_reload``: gpufleet's every reload, through one gate (gpufleet/controller/reload_guard.py's
  script, `reload` mode). Right before it, on the host, the links are made, and every container
  unit (a system scope whose processes live in a mount namespace of their own) that sees an
  NVIDIA device its DeviceAllow does not name gets it named (`systemctl set-property
  --runtime`). A unit that cannot be fixed (its /dev/char link is not to that device) is a
  reason to defer: the reload is not done, the units are recorded
  (/run/gpufleet/daemon-reload-pending, root's) and said, and the next run reloads once they
  are gone, as a pending Docker restart. What a unit sees is read from the kernel (/proc) and
  systemd, never from a file another user writes.

Reloads that others do during a run (package postinsts, `systemctl enable`) are made safe by
the same script before the run's first change (gpufleet/controller/reload_guard.py, `hold` mode).
"""
from __future__ import annotations

from collections.abc import Generator
from io import StringIO
from typing import Any

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.operations import files

from gpufleet.explain import explained
from gpufleet.facts.devchar import DaemonReloadPending, DevCharLinks
from gpufleet.operations import as_op
from gpufleet.operations.notice import say
from gpufleet.printable import printable
from gpufleet.config.hostcontext import host_context
from gpufleet.controller.reload_guard import guard_command, parse_guard, repaired, repaired_text

UDEV_RULE = "/etc/udev/rules.d/71-nvidia-dev-char.rules"
UDEV_RULE_TEXT = (
    "# Managed by gpufleet (deploys/docker.py). Do not edit: changes are reverted.\n"
    "# /dev/char links to every NVIDIA device node whenever the driver binds (so at every boot):\n"
    "# without them a systemd daemon-reload cuts running GPU containers off their GPUs\n"
    "# (NVIDIA's fix: NVIDIA/nvidia-docker#1671, #1730).\n"
    'ACTION=="add", DEVPATH=="/bus/pci/drivers/nvidia", '
    'RUN+="/usr/bin/nvidia-ctk system create-dev-char-symlinks --create-all"\n'
)
CREATE_LINKS = ("nvidia-ctk", "system", "create-dev-char-symlinks", "--create-all")

def _reload(state: Any, host: Any) -> bool:
    ok, out = as_op.run(host, guard_command("reload"))
    lines = out.stdout_lines if out else []
    try:
        reloaded, units = parse_guard(lines)
    except ValueError as exc:
        errors = " ".join(out.stderr_lines if out else []).strip()
        logger.error(f"{host.print_prefix}systemctl daemon-reload failed: {printable(errors) or exc}")
        return False
    fixed = repaired(lines)
    if fixed:
        logger.warning(f"{host.print_prefix}gpufleet: named the GPU devices of running containers in their systemd "
                       f"scopes before the daemon-reload, which would have cut them off: {repaired_text(fixed)}")
    if reloaded:
        return bool(ok)
    logger.warning(f"{host.print_prefix}systemd daemon-reload PENDING (not done): it would cut {', '.join(units)} "
                   "off its GPU devices (no /dev/char link when it started); the first run after it stops reloads")
    return True


@operation(is_idempotent=False)
def daemon_reload() -> Generator[FunctionCommand, None, None]:
    """systemctl daemon-reload, unless it would cut a running container off its GPUs (then
    deferred, recorded and said). Use it through `reload_when()`."""
    yield FunctionCommand(_reload, (), {})


def reload_when(name: str, *changed: Any) -> Any:
    """The gated daemon-reload, run when one of `changed` (operations) changed, or when an earlier
    run deferred one and the containers it was deferred for are gone (the first such call of
    this run takes that over). While they run, nothing else changed: said, and not retried."""
    pending = host.get_fact(DaemonReloadPending)
    context = host_context(host)  # this run's: a second run in the process takes it over again
    take_over = pending.deferred and not pending.active and not context.reload_claimed
    if pending.deferred and not context.reload_claimed:
        context.reload_claimed = True
        if pending.active:
            still_pending(name=explained("Deferred daemon-reload", "Say the daemon-reload an earlier run deferred"), units=pending.active)
    return daemon_reload(name=name + (" (+ deferred)" if take_over else ""),
                         _if=lambda: take_over or any(op.did_change() for op in changed))


@operation()
def still_pending(units: list[str]) -> Generator[None, None, None]:
    """Nothing to do but say it: the containers a reload was deferred for still run."""
    say(f"systemd daemon-reload still PENDING: {', '.join(units)} still run with GPU devices that a reload "
        "would take from them; done by the first run after they stop")
    if False:  # a generator, as every operation
        yield


@operation()
def dev_char_links() -> Generator[StringCommand, None, None]:
    """NVIDIA's udev rule for the /dev/char links, and the links now where some are missing."""
    yield from files.put._inner(src=StringIO(UDEV_RULE_TEXT), dest=UDEV_RULE, mode="644")
    links = host.get_fact(DevCharLinks)
    if links.missing:
        yield StringCommand(*CREATE_LINKS)
    else:
        host.noop(f"every NVIDIA device has its /dev/char link ({len(links.devices)} devices)")
