"""End-to-end: the whole of deploys/all.py on real systemd test hosts (bookworm and trixie),
applied twice with the pyinfra CLI; the second run must change nothing.

The hosts are real Debian systems (systemd-nspawn, real sshd, real apt). Their GPUs are
SIMULATED (testing/gpusim, a test double) and NVIDIA's repositories are replaced by the signed
stand-in repository served on loopback (testing/aptrepo), as a mirror would be. testinfra then
checks the hosts' real state over SSH, independently of gpufleet's own output.
"""
from __future__ import annotations

import json
import shlex

import pytest

from gpufleet.facts import gpu_checks as validation
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.remote import remote

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]


@pytest.fixture(scope="module")
def fleet_inventory(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    research = hostpool.get("foundation-research", 1, gpu=f"a100x4@{TEST_DRIVER}")[0]
    hgx = hostpool.get("foundation-hgx", 1, release="trixie", gpu=f"h200x2@{TEST_DRIVER}")[0]
    # 8 x H100 on NVSwitch: the Fabric Manager path (version = driver) in the same run
    nvswitch = hostpool.get("foundation-nvswitch", 1, gpu=f"h100x8@{TEST_DRIVER}")[0]
    data = {
        research.name: environment_data(research, "research", aptrepo),
        # 2 H200s over NVLink stand for an 8-GPU NVSwitch baseboard: report, don't refuse
        hgx.name: {**environment_data(hgx, "hgx", aptrepo), "tier_mismatch": "warn",
                   "tuning_nccl_socket_ifname": "auto"},
        # no RDMA NICs on a test host: reported, not refused
        nvswitch.name: {**environment_data(nvswitch, "hgx", aptrepo), "tier_mismatch": "warn",
                        "tuning_nccl_socket_ifname": "auto"},
    }
    hosts = [research, hgx, nvswitch]
    return hosts, write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", hosts, data=data)


@pytest.fixture(scope="module")
def fleet(fleet_inventory):
    hosts, inv = fleet_inventory
    first = pyinfra(inv)
    second = pyinfra(inv)
    return hosts, first, second


def test_first_run_converges_every_host(fleet):
    hosts, first, _ = fleet
    assert first.returncode == 0, first.output
    assert first.errors == 0
    assert first.changed >= 10 * len(hosts), first.output


def test_second_run_reports_no_changes(fleet):
    _, _, second = fleet
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    assert second.changed == 0 and second.unchanged > 0


def test_probes_run_only_after_a_run_that_changed_the_host(fleet):
    hosts, first, second = fleet
    # The converge probed, each host with its tier's PyTorch runtime: the hgx hosts with the venv
    # all.py made (the stand-in torch wheel, TEST DOUBLE, sees no CUDA device on simulated GPUs),
    # the research host with its system python3, which has none (a warning naming the key);
    # the no-op re-run left the GPUs alone, saying why.
    assert first.output.count("runtime venv /opt/gpufleet/pytorch (gpufleet's, pytorch_runtime)): matmul: "
                              "no CUDA device") == 2, first.output
    assert first.output.count("no PyTorch to run it with: /usr/bin/python3") == 2, first.output  # probe, check
    assert "PyTorch not installed" not in first.output
    assert "this run changed nothing" not in first.output
    for host in hosts:
        assert f"[{host.name}] [SKIP] probe:" in second.output, second.output
        assert f"[{host.name}] [SKIP] pytorch:" in second.output, second.output  # importing torch costs seconds
    # per host: the performance probe, DCGM's diagnostic and the PyTorch build
    assert second.output.count("probes skipped: this run changed nothing on the host") == 3 * len(hosts)
    assert "PyTorch not installed" not in second.output


def test_hosts_are_what_the_deploy_says(fleet):
    hosts, _, _ = fleet
    releases = set()
    for host in hosts:
        t = remote(host)
        releases.add(t.system_info.codename)
        # base
        assert t.package("sysstat").is_installed
        sysstat = t.service("sysstat")
        assert sysstat.is_enabled and sysstat.is_running
        assert "tier: " in t.file("/etc/gpufleet/managed").content_string
        # driver: the resolved version installed and held (stand-in packages, real dpkg)
        assert t.package("nvidia-open").version.startswith(TEST_DRIVER)
        assert "nvidia-open" in t.check_output("apt-mark showhold").split()
        # docker engine and toolkit
        assert t.package("nvidia-container-toolkit").is_installed
        # tuning: persistence daemon running, every GPU in persistence mode
        assert t.service("nvidia-persistenced").is_running
        modes = t.check_output("nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").split()
        assert modes and set(modes) == {"Enabled"}
        assert t.service("gpufleet-gpu-clocks").is_enabled
        assert t.file("/etc/nccl.conf").contains("Managed by gpufleet")
        # hardening: effective sshd configuration
        assert "passwordauthentication no" in t.check_output("sshd -T")
        # Fabric Manager where NVSwitch is present, at exactly the driver's version
        if host.gpu.startswith("h100x8"):
            assert t.package("nvidia-fabricmanager").version.startswith(TEST_DRIVER)
            assert t.service("nvidia-fabricmanager").is_enabled
        # a first converge: the driver stack, Docker, the container toolkit and hardening's
        # nftables came in ONE apt transaction (deploys/bootstrap.py), as apt's own log says
        installs = [line for line in t.file("/var/log/apt/history.log").content_string.splitlines()
                    if line.startswith("Install: ")]
        together = [line for line in installs
                    if all(f" {p}:" in line for p in ("nvidia-open", "nvidia-container-toolkit", "nftables",
                                                      "unattended-upgrades", "sysstat"))
                    and (" docker-ce:" in line or " docker.io:" in line)]
        assert len(together) == 1, [line[:300] for line in installs]
        # systemd is really PID 1 and the system is healthy
        assert t.check_output("cat /proc/1/comm") == "systemd"
        assert t.run("systemctl is-system-running").stdout.strip() == "running"
    assert releases == {"bookworm", "trixie"}


def test_placeholders_are_gone(fleet):
    _, first, _ = fleet
    assert "Not implemented yet" not in first.output


EXPORTERS = (("node exporter", "prometheus-node-exporter.service"), ("DCGM exporter", "nvidia-dcgm-exporter.service"))


def test_exporters_are_scraped_after_a_change_and_not_on_a_no_op(fleet):
    """The converge's gate asked each endpoint; the no-op re-run did not (each scrape made the
    exporter collect everything: a fifth of a no-op host's CPU), said why, and checked that
    systemd reports each exporter running."""
    hosts, first, second = fleet
    for host in hosts:
        for label, unit in EXPORTERS:
            assert f"[{host.name}] [PASS] monitoring: the {label} serves metrics: http://" in first.output, first.output
            assert (f"[{host.name}] [SKIP] monitoring: the {label} serves metrics: not scraped: this run changed "
                    "nothing on the host") in second.output, second.output
            assert f"systemd reports {unit} running" in second.output
    assert second.output.count("not scraped: this run changed nothing on the host") == len(EXPORTERS) * len(hosts)


def test_gate_reads_dockerd_runtimes_from_its_socket_as_the_cli_prints_them(fleet):
    """ContainerGpus asks dockerd's /info on its socket with curl (the monitoring step installed
    it) instead of starting the docker CLI; where curl is missing it asks the CLI. Each path is
    forced by shadowing the other's tool with a failing stub, on the real dockerd."""
    hosts, _, _ = fleet
    research = hosts[0]
    script = shlex.quote(validation._CONTAINER_SCRIPT)
    run = remote(research).run
    run("mkdir -p /tmp/no-docker-cli /tmp/no-curl && for t in /tmp/no-docker-cli/docker /tmp/no-curl/curl; do "
        "printf '#!/bin/sh\\nexit 1\\n' > $t; chmod +x $t; done")
    try:
        socket = run("PATH=/tmp/no-docker-cli:$PATH sh -c " + script).stdout.splitlines()
        cli = run("PATH=/tmp/no-curl:$PATH sh -c " + script).stdout.splitlines()
    finally:
        run("rm -rf /tmp/no-docker-cli /tmp/no-curl")
    assert any(line.startswith("info={") for line in socket), socket
    assert not any(line.startswith("info=") for line in cli), cli
    by_socket, by_cli = validation.parse_container_gpus(socket), validation.parse_container_gpus(cli)
    assert by_socket.nvidia_runtime and by_cli.nvidia_runtime
    assert by_socket == by_cli
    printed = json.loads(run("docker info --format '{{json .Runtimes}}'").stdout)
    info = next(line for line in socket if line.startswith("info="))
    assert json.loads(info[len("info="):])["Runtimes"] == printed


def test_a_stopped_exporter_is_started_by_the_next_run_and_scraped(fleet, fleet_inventory):
    """Last (it changes the research host): an exporter stopped behind gpufleet's back makes
    the next all.py run a changing one on that host, whose gate then scrapes it again."""
    hosts, inv = fleet_inventory
    research, others = hosts[0], hosts[1:]
    node = remote(research).service("prometheus-node-exporter")
    remote(research).run("systemctl stop prometheus-node-exporter.service")
    assert not node.is_running
    third = pyinfra(inv)
    assert third.returncode == 0, third.output[-6000:]
    changed = changed_operations(third)
    assert len(changed) == 1 and "Monitoring | Start the node exporter" in changed[0], third.output[-6000:]
    assert node.is_running
    out = third.output
    assert f"[{research.name}] [PASS] monitoring: the node exporter serves metrics: http://" in out, out[-6000:]
    assert f"[{research.name}] [PASS] monitoring: the DCGM exporter serves metrics: http://" in out, out[-6000:]
    for host in others:  # changed nothing there: not scraped
        assert f"[{host.name}] [SKIP] monitoring: the node exporter serves metrics: not scraped" in out, out[-6000:]
