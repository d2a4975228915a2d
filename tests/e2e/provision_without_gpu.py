"""Test-only deploy: deploys/all.py minus the driver and docker steps, for GPU-less test hosts.

The driver deploy refuses a host with no supported NVIDIA GPU at planning time, so all.py can
no longer provision the cheap sshd-only hosts the report test uses for "provisioned"; these are
all.py's other steps, in all.py's order, ending with the same validation gate.
"""
from pyinfra import host, state

from gpufleet.deploys.base import base
from gpufleet.deploys.hardening import hardening
from gpufleet.deploys.tuning import tuning
from gpufleet.deploys.validate import validate
from gpufleet.config.failures import host_failed
from gpufleet.config.settings import validate_inventory

validate_inventory(state.inventory)
for step in (base, tuning, hardening, validate):
    if host_failed(host):
        break
    step()
