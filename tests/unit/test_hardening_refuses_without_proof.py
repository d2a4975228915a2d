"""deploys/hardening.py fails closed: on a host not reached over SSH (no fresh-login proof can
be had) the deploy refuses before it plans a single change, naming the host and connector."""
from __future__ import annotations

import logging

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.state import StateStage

from gpufleet.deploys.hardening import hardening

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, kind", [("@docker/gpu-box", "@docker"), ("@chroot/srv/image", "@chroot")])
def test_hardening_plans_nothing_without_a_login_proof(name, kind, caplog):
    inventory = Inventory(([(name, {"tier": "research"})], {}))
    state = State(inventory, Config())
    state.set_stage(StateStage.Prepare)
    host = inventory.get_host(name)
    # never connects: the refusal comes before any fact; the only host failed, so pyinfra stops
    with caplog.at_level(logging.ERROR, logger="pyinfra"), pytest.raises(PyinfraError, match="No hosts remaining"):
        add_deploy(state, hardening, host=host)
    assert host in state.failed_hosts
    assert not state.get_op_order(), "no operation may be planned on such a host"
    assert any(f"the {kind} connector" in r.getMessage() and f"[{name}] refused (connector): " in r.getMessage()
               and "Fix: run this deploy over SSH" in r.getMessage()
               for r in caplog.records)
