"""Test runner: validate the inventory, preflight, then only the driver deploy."""
from pyinfra import host, state

from gpufleet.deploys.driver import driver
from gpufleet.deploys.preflight import preflight
from gpufleet.config.failures import host_failed
from gpufleet.config.settings import validate_inventory

validate_inventory(state.inventory)
for step in (preflight, driver):
    if host_failed(host):
        break
    step()
