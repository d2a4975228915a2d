"""Plan view: what gpufleet would install on each host, and why. Changes nothing.

    pyinfra inventories/cloud.py deploys/plan.py

Per host: the tier, the settings the inventory overrides, the hardware found (from PCI, so it
works before any driver is installed), whether it matches the tier, and the exact versions the
resolver picks for these GPUs on this OS. `pyinfra ... deploys/all.py --dry` shows the
operations themselves.

Clocks: where nvidia-smi works, the pair each GPU gets, from its own supported-clocks list (the
same plan deploys/tuning.py applies and the validation gate checks); before that, the compatibility
catalogue's estimate, said to be one.
"""
import click
from pyinfra import host, state

from gpufleet.errors import Incompatible
from gpufleet.hostfacts import hardware, os_name, resolution, tier_mismatches
from gpufleet.pytorch import mixed_gpus
from gpufleet.rollout.snapshot import command_name
from gpufleet.settings import host_settings, validate_inventory
from gpufleet.tuning import Refusal, clocks_summary, host_clocks

validate_inventory(state.inventory)
settings = host_settings(host)
lines = [f"tier: {settings.tier}"]
for key in (k for k in settings.overridden if k != "tier"):
    value = settings[key]
    if key == "rollout_snapshot_command" and value:  # its arguments may hold a token
        words = value.split() if isinstance(value, str) else list(value)
        value = f"{command_name(words)} (arguments not shown)"
    lines.append(f"override: {key} = {value}")
lines.append(f"os: {os_name(host)}")
lines.append(f"hardware: {hardware(host).summary}")
if mixed := mixed_gpus(hardware(host).models):
    lines.append(f"MIXED: {mixed}")
for problem in tier_mismatches(host, settings):
    lines.append(f"MISMATCH ({settings.tier_mismatch}): {problem}")


def host_clock_line() -> str | None:
    """The host's own clock plan, when its nvidia-smi works (else None: the estimate stands)."""
    try:
        plans = host_clocks(host, settings.clock_policy)
    except Refusal as refused:
        return f"REFUSED: {refused}"
    if not plans:
        return None
    return f"{clocks_summary(plans)} (the GPUs' own supported clocks)"


try:
    for key, value in resolution(host, settings).describe().items():
        if key == "notes":
            lines += [f"note: {note}" for note in value]
        elif key == "clocks":
            lines.append(f"clocks: {host_clock_line() or value}")
        else:
            lines.append(f"{key}: {value}")
except Incompatible as refused:
    lines.append(f"REFUSED: {refused.reason}" + (f" (key {refused.key})" if refused.key else ""))
click.echo(f"--> Plan for {host.name}\n    " + "\n    ".join(lines), err=True)
