"""operations/ssh.py: the fresh-login proof fails closed. A host that is not reached over SSH
(pyinfra's @local, @docker, @chroot... connectors) has no proof, never "nothing to prove"."""
from __future__ import annotations

import pytest
from pyinfra.api import Config, Inventory, State

from gpufleet.operations.ssh import fresh_login, login_proof_refusal

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name, kind", [("@local", "@local"), ("@docker/gpu-box", "@docker"),
                                        ("@chroot/srv/image", "@chroot"), ("@dockerssh/h:img", "@dockerssh")])
def test_a_host_not_reached_over_ssh_has_no_proof(name, kind):
    inventory = Inventory(([name], {}))
    State(inventory, Config())
    host = inventory.get_host(name)
    error = fresh_login(host, attempts=1, delay=0)  # never connects: refused before any attempt
    assert error is not None and error == login_proof_refusal(host)
    assert f"refused on {name}" in error and f"the {kind} connector" in error and "SSH" in error


def test_a_host_reached_over_ssh_is_proven_by_logging_in():
    inventory = Inventory(([("gpu-a01", {"ssh_hostname": "127.0.0.1", "ssh_port": 1,
                                         "ssh_connect_retries": 0})], {}))
    State(inventory, Config())
    host = inventory.get_host("gpu-a01")
    assert login_proof_refusal(host) is None
    error = fresh_login(host, attempts=1, delay=0)  # nothing listens on port 1: a real failure
    assert error is not None and "refused on" not in error
