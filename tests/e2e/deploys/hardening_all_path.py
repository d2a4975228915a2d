"""Test deploy: the hardening step exactly as deploys/all.py runs it (fact cache and prefetch
installed first, the inventory validated, the step guarded by host_failed), for hosts without
GPUs, whose driver step all.py would refuse."""
from pyinfra import host, state

from gpufleet.controller import factcache

factcache.install()
factcache.prefetch_all(state)

from gpufleet.deploys.hardening import hardening  # noqa: E402
from gpufleet.config.failures import host_failed  # noqa: E402
from gpufleet.config.settings import validate_inventory  # noqa: E402

validate_inventory(state.inventory)
if not host_failed(host):
    hardening()
