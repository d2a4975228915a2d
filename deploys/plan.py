"""Plan view: what gpufleet would install on each host, and why. Changes nothing.

    pyinfra inventories/cloud.py deploys/plan.py

Per host: the tier, the settings the inventory overrides, the hardware found (from PCI, so it
works before any driver is installed), whether it matches the tier, and the exact versions the
resolver picks for these GPUs on this OS. `pyinfra ... deploys/all.py --dry` shows the
operations themselves.
"""
import click
from pyinfra import host, state

from gpufleet.errors import Incompatible
from gpufleet.hostfacts import hardware, os_name, resolution, tier_mismatches
from gpufleet.pytorch import mixed_gpus
from gpufleet.rollout.snapshot import command_name
from gpufleet.settings import host_settings, validate_inventory

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
try:
    for key, value in resolution(host, settings).describe().items():
        if key == "notes":
            lines += [f"note: {note}" for note in value]
        else:
            lines.append(f"{key}: {value}")
except Incompatible as refused:
    lines.append(f"REFUSED: {refused.reason}" + (f" (key {refused.key})" if refused.key else ""))
click.echo(f"--> Plan for {host.name}\n    " + "\n    ".join(lines), err=True)
