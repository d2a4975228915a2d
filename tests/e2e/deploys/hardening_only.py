"""Test deploy: the inventory check and the hardening deploy alone (hosts without GPUs; the
whole of all.py, hardening included, is proven on GPU hosts in test_foundation.py)."""
from pyinfra import state

from gpufleet.deploys.hardening import hardening
from gpufleet.config.settings import validate_inventory

validate_inventory(state.inventory)
hardening()
