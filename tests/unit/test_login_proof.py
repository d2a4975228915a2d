"""operations/ssh.py: the fresh-login proof fails safe, connector by connector (pyinfra's own
`pyinfra.connectors` entry points and a third-party one):
- over SSH (also the hosts @vagrant and @terraform list) it logs in afresh;
- over @local, @docker, @podman, @chroot, which never go through sshd, there is nothing to
  prove and it says so by name (and the hardening deploy still refuses them at planning);
- over any other connector (@dockerssh, @podmanssh, a third-party one) it refuses, never
  "nothing to prove"."""
from __future__ import annotations

import logging

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.connectors.base import BaseConnector
from pyinfra.connectors.local import LocalConnector
from pyinfra.connectors.ssh import SSHConnector

from gpufleet.operations.ssh import fresh_login, login_proof, login_proof_refusal

pytestmark = pytest.mark.unit


def _host(name: str, data: dict | None = None, connector: type | None = None):
    inventory = Inventory(([(name, data or {})], {}))
    State(inventory, Config())
    host = inventory.get_host(name)
    if connector is not None:
        host.connector_cls = connector
    return host


class ThirdPartyConnector(BaseConnector):
    """A connector pyinfra does not ship (say, a cloud provider's): gpufleet cannot know
    which sshd, if any, its commands go through."""


class ThirdPartySshConnector(SSHConnector):
    """A third-party connector built on pyinfra's ssh one: it connects as ssh does."""


@pytest.mark.parametrize("name, kind", [("@local", "@local"), ("@docker/gpu-box", "@docker"),
                                        ("@podman/gpu-box", "@podman"), ("@chroot/srv/image", "@chroot")])
def test_a_connector_that_never_goes_through_sshd_has_nothing_to_prove_by_name(name, kind, caplog):
    host = _host(name)
    how, why = login_proof(host)
    assert how == "nothing" and why == (f"nothing to prove on {name}: the {kind} connector does not go through "
                                        "sshd, so no sshd or firewall change can cut this connection")
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        assert fresh_login(host, attempts=1, delay=0) is None  # never connects
    assert any(why in r.getMessage() for r in caplog.records)
    # ... and the hardening deploy still makes no sshd or firewall change there
    refusal = login_proof_refusal(host)
    assert refusal is not None and f"refused on {name}: the {kind} connector" in refusal
    assert "Allowed connector: ssh" in refusal


@pytest.mark.parametrize("name, kind, connector", [
    ("@dockerssh/h:img", "@dockerssh", None), ("@podmanssh/h:img", "@podmanssh", None),
    ("box-1", f"{__name__}.ThirdPartyConnector", ThirdPartyConnector),
])
def test_any_other_connector_is_refused_never_taken_as_proven(name, kind, connector):
    host = _host(name, connector=connector)
    how, why = login_proof(host)
    assert how == "refused"
    error = fresh_login(host, attempts=1, delay=0)  # never connects: refused before any attempt
    assert error == why == login_proof_refusal(host)
    assert f"refused on {name}" in error and f"the {kind} connector" in error
    assert "Allowed connector: ssh" in error


def test_vagrant_and_terraform_hosts_are_ssh_hosts():
    # pyinfra's @vagrant and @terraform only list hosts (with ssh_* data); the ssh connector runs them
    from pyinfra.api.connectors import get_all_connectors

    connectors = get_all_connectors()
    assert not connectors["vagrant"].handles_execution and not connectors["terraform"].handles_execution


@pytest.mark.parametrize("name, connector", [("gpu-a01", None), ("gpu-a02", ThirdPartySshConnector)])
def test_a_host_reached_over_ssh_is_proven_by_logging_in(name, connector):
    host = _host(name, {"ssh_hostname": "127.0.0.1", "ssh_port": 1, "ssh_connect_retries": 0}, connector)
    assert login_proof(host) == ("ssh", "") and login_proof_refusal(host) is None
    error = fresh_login(host, attempts=1, delay=0)  # nothing listens on port 1: a real failure
    assert error is not None and "refused on" not in error and "nothing to prove" not in error


def test_the_local_connector_subclass_is_not_taken_for_local():
    # only pyinfra's own @local class is known not to go through sshd
    host = _host("box-2", connector=type("LocalLike", (LocalConnector,), {}))
    assert login_proof(host)[0] == "refused"
