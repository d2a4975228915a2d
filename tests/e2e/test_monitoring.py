"""End-to-end: the research tier's exporters on a real test host, asked from outside it.

One Debian 12 test host of the research tier with 2 x A100 SIMULATED (testing/gpusim). The
driver and DCGM come from the stand-in CUDA repository (testing/aptrepo.py), whose
datacenter-gpu-manager-exporter is a clearly marked test double serving the simulator's GPUs in
dcgm-exporter's text format; the node exporter is Debian's real prometheus-node-exporter from
Debian's archive. deploys/monitoring.py runs on its own (deploys/standalone.py) after the driver
step, twice; then the validation gate; then this process, outside the host, asks each endpoint
on the host's own loopback address (test hosts share the machine's network: each exporter is
bound to its host's address, monitoring_listen_address, as testing/inventory.py sets it).

Through the firewall: a research host with a network of its own (a private-network test host,
real nftables), the driver, monitoring and hardening steps as all.py runs them, the exporters
bound to the host's address: from the client namespace both endpoints answer, a port no key
opens stays closed, the loaded table opens the exporters' ports for that address only, and a
second run changes nothing.
"""
from __future__ import annotations

import re
import urllib.request

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from testing.netns import host_tcp_open
from testing.testhosts import in_netns
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as answer:  # noqa: S310 - a test host's loopback address
        assert answer.status == 200
        return answer.read().decode()


def sh(host, cmd: str) -> str:
    return testhosts.ssh(host, cmd).stdout


@pytest.fixture(scope="module")
def monitored(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    (h,) = hostpool.get("monitoring", 1, gpu=f"a100x2@{TEST_DRIVER}")
    tmp = tmp_path_factory.mktemp("monitoring")
    data = {**environment_data(h, "research", aptrepo), "tier_mismatch": "warn"}
    inv = write_inventory(tmp / "inventory.py", [h], data={h.name: data})
    runs = {"driver": pyinfra(inv, "tests/e2e/deploys/driver_only.py")}
    runs["monitoring"] = pyinfra(inv, "deploys/monitoring.py")
    runs["again"] = pyinfra(inv, "deploys/monitoring.py")
    runs["validate"] = pyinfra(inv, "deploys/validate.py")
    for label, run in runs.items():
        (tmp / f"{label}.log").write_text(run.output)
    runs["inventory"] = inv
    return h, runs


def test_monitoring_alone_installs_and_a_second_run_changes_nothing(monitored):
    h, runs = monitored
    assert runs["driver"].returncode == 0, runs["driver"].output[-4000:]
    first, again = runs["monitoring"], runs["again"]
    assert first.returncode == 0 and first.errors == 0, first.output[-5000:]
    assert first.changed > 0, first.output[-5000:]
    assert again.returncode == 0 and changed_operations(again) == [], again.output[-5000:]
    # installed as the tier says: Debian's package, NVIDIA's exporter at the pinned release, held
    versions = sh(h, "dpkg-query -W -f '${Package} ${Version} ${db:Status-Abbrev}\\n' "
                     "prometheus-node-exporter datacenter-gpu-manager-exporter datacenter-gpu-manager-4-core")
    assert re.search(r"^prometheus-node-exporter \S+ ii", versions, re.M), versions
    assert re.search(r"^datacenter-gpu-manager-exporter 4\.5\.0-1 hi", versions, re.M), versions
    assert re.search(r"^datacenter-gpu-manager-4-core 1:4\.4\.0-1 hi", versions, re.M), versions
    for unit in ("prometheus-node-exporter", "nvidia-dcgm", "nvidia-dcgm-exporter"):
        assert sh(h, f"systemctl is-enabled {unit}.service; systemctl is-active {unit}.service").split() == \
            ["enabled", "active"], unit


def test_node_exporter_answers_on_the_hosts_address_with_real_metrics(monitored):
    h, _ = monitored
    text = scrape(f"http://{h.address}:9100/metrics")
    names = {line.split("{")[0].split()[0] for line in text.splitlines() if line.startswith("node_")}
    # real collectors reading the host's kernel: boot time, memory, CPU, load
    assert {"node_boot_time_seconds", "node_memory_MemTotal_bytes", "node_cpu_seconds_total", "node_load1"} <= names
    total = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("node_memory_MemTotal_bytes "))
    assert total > 64 << 20
    # bound to the host's own address only, as monitoring_listen_address says
    listening = sh(h, "ss -Hltn 'sport = :9100'")
    assert f"{h.address}:9100" in listening and "0.0.0.0:9100" not in listening and "*:9100" not in listening


def test_dcgm_exporter_answers_with_each_simulated_gpus_metrics(monitored):
    h, _ = monitored
    text = scrape(f"http://{h.address}:9400/metrics")
    temps = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP{")]
    uuids = sh(h, "nvidia-smi --query-gpu=index,uuid --format=csv,noheader").splitlines()
    assert len(temps) == len(uuids) == 2, text[:2000]
    for row in uuids:
        index, uuid = (c.strip() for c in row.split(","))
        line = next(t for t in temps if f'gpu="{index}"' in t)
        assert f'UUID="{uuid}"' in line and 'modelName="NVIDIA A100' in line
        assert float(line.split()[-1]) > 0
    assert "# TYPE DCGM_FI_DEV_GPU_TEMP gauge" in text
    # the stand-in exporter serves only while DCGM's host engine runs, as the real one pointed at it
    assert "DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555" in sh(h, "systemctl cat nvidia-dcgm-exporter.service")


def test_the_gate_checks_each_endpoint_on_the_host(monitored):
    h, runs = monitored
    out = runs["validate"].output
    assert (f"[{h.name}] [PASS] monitoring: the node exporter serves metrics: http://{h.address}:9100/metrics: "
            in out), out[-5000:]
    assert re.search(rf"\[{re.escape(h.name)}\] \[PASS\] monitoring: the DCGM exporter serves metrics: "
                     rf"http://{re.escape(h.address)}:9400/metrics: \d+ DCGM_FI_\* samples, DCGM_FI_DEV_GPU_TEMP for 2 GPUs",
                     out), out[-5000:]


def test_a_stopped_exporter_fails_the_gate_with_its_fix(monitored):
    h, runs = monitored
    inv = runs["inventory"]
    sh(h, "systemctl stop nvidia-dcgm-exporter.service")
    try:
        run = pyinfra(inv, "deploys/validate.py")
    finally:
        sh(h, "systemctl start nvidia-dcgm-exporter.service")
    assert run.returncode != 0
    assert (f"[{h.name}] [FAIL] monitoring: the DCGM exporter serves metrics: http://{h.address}:9400/metrics: "
            in run.output), run.output[-5000:]
    assert "-> fix: systemctl status nvidia-dcgm-exporter.service" in run.output


def scraper_address(host) -> str:
    """The client namespace's address on the hosts' network (testing/testhosts.py: .1 of it)."""
    return host.address.rsplit(".", 1)[0] + ".1"


def http_get_from_client(host, port: int, source: str | None = None) -> str:
    """GET /metrics from the pool's client namespace, as Prometheus on another machine would
    (from `source`, an address of the client namespace, when given)."""
    import socket

    with in_netns(host.netns):
        sock = socket.socket()
    sock.settimeout(20 if source is None else 4)
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.connect((host.address, port))
        sock.sendall(f"GET /metrics HTTP/1.0\r\nHost: {host.address}\r\n\r\n".encode())
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    finally:
        sock.close()
    head, _, body = b"".join(chunks).decode().partition("\r\n\r\n")
    assert head.split()[1] == "200", head
    return body


LISTENER = ("import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            "s.bind(('0.0.0.0',8080)); s.listen(4)\nwhile True: s.accept()[0].close()\n")


def test_exporters_answer_through_the_firewall_which_opens_exactly_their_ports(hostpool, aptrepo, tmp_path):  # noqa: F811
    (h,) = hostpool.get("monitoring-private", 1, gpu=f"a100x2@{TEST_DRIVER}", private_network=True,
                        forward=(aptrepo.port,))
    # the scrapers: the client namespace's own address only (monitoring_allowed_cidrs)
    data = {**environment_data(h, "research", aptrepo), "tier_mismatch": "warn", "monitoring_listen_address": h.address,
            "monitoring_allowed_cidrs": [f"{scraper_address(h)}/32"]}
    inv = write_inventory(tmp_path / "inventory.py", [h], data={h.name: data})
    deploy = "tests/e2e/deploys/monitoring_firewall.py"
    first = pyinfra(inv, deploy, netns=h.netns)
    (tmp_path / "first.log").write_text(first.output)
    assert first.returncode == 0, first.output[-6000:]
    again = pyinfra(inv, deploy, netns=h.netns)
    assert again.returncode == 0 and changed_operations(again) == [], again.output[-5000:]

    table = sh(h, "nft list table inet gpufleet")
    scraper = scraper_address(h)
    assert f'ip saddr {scraper} ip daddr {h.address} tcp dport 9100 accept comment "node exporter"' in table, table
    assert f'ip saddr {scraper} ip daddr {h.address} tcp dport 9400 accept comment "DCGM exporter"' in table, table
    testhosts.ssh(h, "systemd-run --unit=gf-test-listen /usr/bin/python3 -c " + __import__("shlex").quote(LISTENER))
    assert sh(h, "sleep 1; ss -Hltn 'sport = :8080'").strip(), "the test listener did not start"
    assert not host_tcp_open(h, 8080), "a port no key opens is reachable"

    node = http_get_from_client(h, 9100)
    assert "node_boot_time_seconds " in node and "node_cpu_seconds_total{" in node
    dcgm = http_get_from_client(h, 9400)
    assert len([line for line in dcgm.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP{")]) == 2, dcgm[:2000]
    # another machine of that network, not a scraper: the exporters' ports drop it
    other = f"{scraper.rsplit('.', 1)[0]}.250"
    testhosts._ip("-n", h.netns, "addr", "add", f"{other}/32", "dev", testhosts.CLIENT_BRIDGE)
    try:
        for port in (9100, 9400):
            with pytest.raises(OSError):          # dropped: the connection times out
                http_get_from_client(h, port, source=other)
        assert "node_boot_time_seconds " in http_get_from_client(h, 9100)   # the scraper still gets through
    finally:
        testhosts._ip("-n", h.netns, "addr", "del", f"{other}/32", "dev", testhosts.CLIENT_BRIDGE, check=False)
