"""Test runner: all.py's steps the exporters and their firewall stand on (inventory check,
preflight, driver, monitoring, hardening); base, docker and tuning are proven elsewhere."""
from pyinfra import host, state

from gpufleet.deploys.driver import driver
from gpufleet.deploys.hardening import hardening
from gpufleet.deploys.monitoring import monitoring
from gpufleet.deploys.preflight import preflight
from gpufleet.config.failures import host_failed
from gpufleet.config.settings import validate_inventory

validate_inventory(state.inventory)
for step in (preflight, driver, monitoring, hardening):
    if host_failed(host):
        break
    step()
