"""firewall_cluster_cidrs: the training peers' networks reach every TCP port (and RoCEv2 on the
RDMA profiles), everyone else only the tier's ports; the plan view and the gate name them.
The rules are rendered from the same context deploys/hardening.py loads, and checked by the real
`nft -c` where this machine has it (tests/e2e/test_multinode.py loads them on test hosts)."""
from __future__ import annotations


import pytest

from gpufleet.plans import cluster
from gpufleet.plans.hardening import firewall_plan
from tests.unit.nft_check import assert_nft_accepts
from tests.unit.test_monitoring import settings

pytestmark = pytest.mark.unit


def table(**data) -> str:
    return firewall_plan(settings(**data), [22]).rules()


def accepts(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "accept" in line and not line.lstrip().startswith("#")]


def test_cluster_networks_reach_every_tcp_port_and_rocev2_on_a_roce_tier():
    text = table(firewall_cluster_cidrs=["10.10.0.0/16", "fd00:10::/32"])  # research: nccl_profile roce
    assert accepts(text[:text.index("chain forward")])[-4:] == [
        'ip saddr 10.10.0.0/16 meta l4proto tcp accept comment "training peers (firewall_cluster_cidrs): all TCP"',
        'ip saddr 10.10.0.0/16 udp dport 4791 accept comment "training peers (firewall_cluster_cidrs): RoCEv2"',
        'ip6 saddr fd00:10::/32 meta l4proto tcp accept comment "training peers (firewall_cluster_cidrs): all TCP"',
        'ip6 saddr fd00:10::/32 udp dport 4791 accept comment "training peers (firewall_cluster_cidrs): RoCEv2"',
    ]
    # nobody else: the only other accepts are the fixed ones and SSH (research lists 22 only)
    others = [line for line in accepts(text[:text.index("chain forward")]) if "saddr" not in line]
    assert all("dport 22 " in line or "icmp" in line or line.startswith(("iif", "ct state")) for line in others), others
    assert "29500" not in text  # no port of its own: every TCP port is the peers', no other network's


def test_no_rdma_rule_on_a_tcp_profile_and_no_rule_without_networks():
    text = table(nccl_profile="tcp", firewall_cluster_cidrs=["10.10.0.0/16"])
    assert "meta l4proto tcp accept" in text and "4791" not in text
    assert "training peers" not in table()  # research, no networks: nothing opened
    assert "training peers" not in table(tier="dev")


def test_what_the_host_trusts_for_training_is_said_in_one_line():
    line = cluster.training_networks(settings(firewall_cluster_cidrs=["10.10.0.0/16"],
                                              firewall_trusted_cidrs=["192.0.2.0/28"]))
    assert line == ("10.10.0.0/16 (firewall_cluster_cidrs): all TCP (torchrun's rendezvous, 29500 by default, and "
                    "NCCL's ephemeral ports), RoCEv2 (4791/udp); 192.0.2.0/28 (firewall_trusted_cidrs): every port")
    assert cluster.training_networks(settings()).startswith("none: training peers reach only the tier's open ports")
    assert cluster.training_networks(settings(firewall_enabled=False)) == "every network (firewall_enabled: false)"


def test_nft_accepts_the_cluster_rules_when_nft_is_here():
    text = table(firewall_cluster_cidrs=["10.10.0.0/16", "fd00:10::/32", "192.0.2.7"])
    assert_nft_accepts(text)


class GateContext:
    """What the gate check reads: /etc/nftables.conf as the host has it, and the nftables state."""

    def __init__(self, settings, conf: str | None, loaded: bool = True):
        self.settings = settings
        self.conf = conf
        self.loaded = loaded

    def fact(self, cls, **kwargs):
        from types import SimpleNamespace

        from gpufleet.facts.nftables import NftablesCapability
        from pyinfra.facts.files import FileContents

        if cls is FileContents:
            assert kwargs == {"path": "/etc/nftables.conf"}
            return None if self.conf is None else self.conf.splitlines()
        assert cls is NftablesCapability
        return SimpleNamespace(can_load=True, table_loaded=self.loaded)


def test_the_gate_names_the_training_networks_and_fails_when_the_host_lacks_their_rules():
    from gpufleet.checks import validation as v

    s = settings(firewall_cluster_cidrs=["10.10.0.0/16"])
    good = v.training_peers_let_in(GateContext(s, table(firewall_cluster_cidrs=["10.10.0.0/16"])))
    assert (good.status, good.message) == ("pass", cluster.training_networks(s)), good
    stale = v.training_peers_let_in(GateContext(s, table()))  # the host's file predates the setting
    assert stale.status == "fail" and stale.message == (
        "/etc/nftables.conf does not let in 10.10.0.0/16 meta l4proto tcp, 10.10.0.0/16 udp dport 4791"), stale
    assert stale.fix == "run deploys/all.py"
    unloaded = v.training_peers_let_in(GateContext(s, table(firewall_cluster_cidrs=["10.10.0.0/16"]), loaded=False))
    assert unloaded.status == "fail" and "not loaded" in unloaded.message


def test_the_gate_warns_a_multi_node_tier_without_training_peers():
    from gpufleet.checks import validation as v

    warned = v.training_peers_let_in(GateContext(settings(), table()))
    assert warned.status == "warn" and warned.message.startswith(
        "tier research trains across hosts (nccl_profile: roce) but firewall_cluster_cidrs is empty"), warned
    assert warned.fix.startswith("set firewall_cluster_cidrs to the training peers' networks")
    alone = v.training_peers_let_in(GateContext(settings(tier="inference"), None))
    assert alone.status == "skip" and alone.message.startswith("tier inference trains on one host"), alone
    trusted = v.training_peers_let_in(GateContext(settings(firewall_trusted_cidrs=["10.1.0.0/16"]), None))
    assert trusted.status == "pass" and "10.1.0.0/16 (firewall_trusted_cidrs): every port" in trusted.message


def test_slurm_and_triton_metrics_are_not_open_to_every_network():
    """hgx's Slurm ports are the cluster's (firewall_cluster_cidrs: all TCP), inference's Triton
    metrics port (8002) the scrapers' (monitoring_allowed_cidrs), as the exporters' are."""
    hgx = table(tier="hgx")
    assert "6817" not in hgx and "ip saddr 192.0.2.0/24 meta l4proto tcp accept" in hgx
    inference = table(tier="inference")
    assert "8002" not in inference  # no scrapers named: only the host itself and trusted networks
    assert "tcp dport 8000 accept" in inference  # Triton's HTTP serves clients: open
    scraped = table(tier="inference", monitoring_allowed_cidrs=["10.9.0.0/16"])
    assert [line for line in accepts(scraped) if "8002" in line] == [
        'ip saddr 10.9.0.0/16 tcp dport 8002 accept comment "metrics (monitoring_scrape_ports)"',
        'ip saddr 10.9.0.0/16 meta l4proto tcp ct original proto-dst 8002 accept comment "metrics (monitoring_scrape_ports)"']
    assert_nft_accepts(scraped)
