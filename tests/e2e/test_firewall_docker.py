"""End-to-end: a container's published port is behind the tier's firewall, not around it.

`docker run -p 8888:8888` makes Docker DNAT the port to the container, so connections to it
go through the forward hook, never the input chain that filters the host's own ports. The
host here runs the real Docker engine (Debian's docker.io, its iptables-nft rules, a bridge
and DNAT) in a network namespace of its own (`testhosts up --private-network --containers`;
the harness turns IP forwarding on there, as dockerd would on a real host), and a container
publishes 8888 (a listener in the smoke image built on the host, testing/smoke_image.py).

Three addresses of the pool's client namespace connect: 10.232.N.1 (pyinfra's, in no list),
one in firewall_trusted_cidrs and one in firewall_cluster_cidrs. Before hardening all three
reach the container (the hole); after it the outsider is refused, both insiders reach it,
the container still reaches out; a second run changes nothing; a Docker restart and a real
reboot (the container restarts with the engine) leave it so.
"""
from __future__ import annotations

import shlex
import socket
import subprocess
import threading

import pytest

from testing import smoke_image, testhosts
from testing.inventory import OS_RELEASE, write_inventory
from testing.netns import host_tcp_open
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_all_path.py"
PORT = 8888
OUTSIDE_PORT = 9999  # a listener in the client namespace the container connects to
SERVER = (
    "import socket\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    f"s.bind(('0.0.0.0',{PORT})); s.listen(16)\n"
    "while True: s.accept()[0].close()\n"
)


def connects(host, source: str, port: int = PORT, timeout: float = 2.0) -> bool:
    """A TCP handshake from `source` (an address of the client namespace) to the host's port."""
    return host_tcp_open(host, port, timeout=timeout, source=source)


def container_reaches(host, address: str) -> bool:
    """The container's own outbound traffic: a TCP handshake from inside it to address."""
    code = (f"import socket\ns=socket.socket(); s.settimeout(3)\n"
            f"try:\n s.connect(({address!r},{OUTSIDE_PORT})); print('open')\n"
            f"except OSError as e:\n print('closed', e)\n")
    out = testhosts.ssh(host, f"docker exec web python3 -c {shlex.quote(code)}", check=False).stdout
    return out.startswith("open")


def wait_for_container(host) -> None:
    testhosts.ssh(host, f"for i in $(seq 100); do ss -ltn | grep -q ':{PORT} ' && "
                        f"docker exec web true 2>/dev/null && exit 0; sleep 0.2; done; exit 1", timeout=60)


@pytest.fixture(scope="module")
def docker_host(hostpool):
    host, = hostpool.get("firewall-docker", 1, private_network=True, containers=True)
    # Docker's own networking, as a real host has it (the harness's default turns it off).
    testhosts.ssh(host, "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null 2>&1 && "
                        "echo '{\"storage-driver\": \"vfs\"}' > /etc/docker/daemon.json && systemctl restart docker",
                  timeout=600)
    smoke_image.build(host)
    testhosts.ssh(host, f"docker run -d --name web --restart always -v /usr:/usr:ro -p {PORT}:{PORT} "
                        f"{smoke_image.IMAGE} python3 -c {shlex.quote(SERVER)}")
    wait_for_container(host)
    return host


@pytest.fixture()
def client_addresses(docker_host):
    """Two more addresses on the client namespace's bridge (the trusted one, the cluster one)."""
    prefix = docker_host.address.rsplit(".", 1)[0]
    added = [f"{prefix}.2", f"{prefix}.3"]
    for address in added:
        subprocess.run(["ip", "-n", docker_host.netns, "addr", "add", f"{address}/32", "dev", testhosts.CLIENT_BRIDGE], check=True)
    try:
        yield f"{prefix}.1", *added
    finally:
        for address in added:
            subprocess.run(["ip", "-n", docker_host.netns, "addr", "del", f"{address}/32", "dev", testhosts.CLIENT_BRIDGE], check=False)


@pytest.fixture()
def outside_listener(docker_host):
    """A listener on the client namespace's own address, for the container to connect out to."""
    with testhosts.in_netns(docker_host.netns):
        server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((docker_host.address.rsplit(".", 1)[0] + ".1", OUTSIDE_PORT))
    server.listen(16)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except OSError:
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        server.close()


def test_published_port_is_refused_outside_the_tiers_networks(docker_host, client_addresses, outside_listener,
                                                              tmp_path):
    host = docker_host
    outsider, trusted, peer = client_addresses
    assert all(connects(host, a) for a in client_addresses)  # the hole: Docker's DNAT, past any input chain
    inv = write_inventory(tmp_path / "inventory.py", [host], data={host.name: {
        "tier": "dev", "validate_os_release": OS_RELEASE[host.release],
        "firewall_trusted_cidrs": [f"{trusted}/32"], "firewall_cluster_cidrs": [f"{peer}/32"]}})

    first = pyinfra(inv, DEPLOY, netns=host.netns)
    assert first.returncode == 0, first.output

    def as_the_tier_says() -> None:
        assert not connects(host, outsider), "a published port is reachable from outside the tier's networks"
        assert connects(host, trusted), "a trusted address cannot reach a published port"
        assert connects(host, peer), "a training peer cannot reach a published port"
        assert connects(host, outsider, 22)  # SSH, as ever
        assert container_reaches(host, outsider), "the container's own outbound traffic is blocked"

    as_the_tier_says()
    second = pyinfra(inv, DEPLOY, netns=host.netns)
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output

    testhosts.ssh(host, "systemctl restart docker", timeout=120)  # Docker rewrites its own rules
    wait_for_container(host)
    as_the_tier_says()

    testhosts.reboot(host)  # /etc/nftables.conf at boot; the engine brings the container back
    wait_for_container(host)
    as_the_tier_says()
    third = pyinfra(inv, DEPLOY, netns=host.netns)
    assert third.returncode == 0, third.output
    assert changed_operations(third) == [], third.output
