"""gpufleet/plans/hardening.py on recorded facts: the plan made from a converged real host's facts
(tests/unit/recorded_host.py) is that host (its /etc/nftables.conf byte for byte, its sshd -T);
each refusal as data, before anything changes; the firewall's scoping of the tier's, the
exporters', Triton's and Slurm's ports, for the host's input and for Docker's published ports."""
from __future__ import annotations

import dataclasses
import hashlib

import pytest

from gpufleet.facts.nftables import NftablesCapability
from gpufleet.facts.ssh import OpenSshVersion, SshdActivation, SshdEffectiveConfig, SshdVersion
from gpufleet.plans import hardening as h
from gpufleet.plans.refusal import Refusal
from tests.unit import recorded_host as recorded

pytestmark = pytest.mark.unit


def sshd_config():
    return recorded.fact(SshdEffectiveConfig, "( sshd -T )")


def ssh_ports() -> list[int]:
    return [*sshd_config().ports, *recorded.fact(SshdActivation, "systemctl show ssh.socket").ports]


def planned(**over) -> h.HardeningPlan | Refusal:
    return h.plan(recorded.settings(**over), login_refusal=None, ssh_user="root",
                  version=recorded.fact(SshdVersion, "sshd -V"))


def test_the_recorded_hosts_ruleset_is_the_plans_byte_for_byte():
    """The host could not load rules (a container): gpufleet wrote the ruleset to
    /etc/nftables.conf, and its checksum is what NftablesCapability read."""
    rules = h.firewall_plan(recorded.settings(), ssh_ports()).rules()
    assert rules == "\n".join(recorded.lines("( test -e /etc/nftables.conf")) + "\n"
    capability = recorded.fact(NftablesCapability, "capeff=")
    assert not capability.can_load
    assert hashlib.sha256(rules.encode()).hexdigest() == capability.conf_digest


def test_the_recorded_hosts_sshd_shows_what_the_plan_expects():
    plan = planned()
    assert isinstance(plan, h.HardeningPlan)
    assert plan.user == "root"
    # OpenSSH 9.2 (Debian 12): sntrup761 but no ML-KEM, then paramiko's curve25519
    assert plan.sshd.kex == ("sntrup761x25519-sha512@openssh.com", "curve25519-sha256@libssh.org")
    assert plan.sshd.openssh_version.startswith("9.2")
    assert sshd_config().differences(plan.expected_sshd) == []
    assert plan.sshd.dropin_text().startswith("# Managed by gpufleet")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.user = "someone"  # type: ignore[misc]


def test_the_plan_can_fail_on_a_host_that_differs():
    """The check above can fail: a drop-in of another OpenSSH (10.0's ML-KEM) is not this sshd's."""
    other = h.sshd_plan(recorded.settings(), OpenSshVersion(10, 0))
    from gpufleet.catalog.sshd_policy import expected_sshd

    assert sshd_config().differences(expected_sshd(recorded.settings(), other.algorithms()))


@pytest.mark.parametrize("refusal_case, expected_key", [
    (dict(login_refusal="over @local nothing proves a fresh login. Run this deploy over SSH."), "connector"),
    # the inventory says deploy, the connection logged in as root (~/.ssh/config's User)
    (dict(ssh_user="root", over={"ssh_user": "deploy", "_sudo": True, "hardening_permit_root_login": "no"}),
     "hardening_permit_root_login"),
    (dict(version=None), "hardening"),
    (dict(over={"hardening_extra_kex": ["mlkem768x25519-sha256", "curve25519-sha256@libssh.org"]}),
     "hardening_extra_kex"),
])
def test_each_refusal_is_data_naming_the_key(refusal_case, expected_key):
    args = {"login_refusal": None, "ssh_user": "root", "version": recorded.fact(SshdVersion, "sshd -V"),
            **{k: v for k, v in refusal_case.items() if k != "over"}}
    refusal = h.plan(recorded.settings(**refusal_case.get("over", {})), **args)
    assert isinstance(refusal, Refusal)
    assert (refusal.area, refusal.key) == ("hardening", expected_key)
    assert refusal.reason and refusal.fix and "Run this deploy over SSH" not in refusal.reason


def test_ports_follow_the_schemas_grammar_and_ssh_is_never_listed_twice():
    plan = h.firewall_plan(recorded.settings(firewall_open_ports=["22/tcp", 9999, "6817-6819/tcp", "5353/udp"]),
                           ssh_ports())
    assert plan.ssh_ports == (22,)
    assert [(r["port"], r["proto"]) for r in plan.open_ports if not r.get("saddr")] == [
        ("9999", "tcp"), ("6817-6819", "tcp"), ("5353", "udp")]
    published = plan.rules()[plan.rules().index("chain published"):]
    assert "meta l4proto udp ct original proto-dst 5353 accept" in published
    assert "proto-dst 22 " not in published


def test_triton_metrics_and_exporters_only_from_the_scrapers():
    scrapers = ["10.1.0.0/16"]
    plan = h.firewall_plan(recorded.settings(monitoring_scrape_ports=["8002/tcp"], monitoring_allowed_cidrs=scrapers,
                                             monitoring_listen_address="10.0.0.5"), ssh_ports())
    triton = [r for r in plan.open_ports if r["port"] == "8002"]
    assert triton == [{"port": "8002", "proto": "tcp", "comment": "metrics (monitoring_scrape_ports)",
                       "saddr": "10.1.0.0/16", "daddr": ""}]
    exporters = {r["port"]: (r["saddr"], r["daddr"]) for r in plan.open_ports if r["port"] in ("9100", "9400")}
    assert exporters == {"9100": ("10.1.0.0/16", "10.0.0.5"), "9400": ("10.1.0.0/16", "10.0.0.5")}
    text = plan.rules()
    assert "ip saddr 10.1.0.0/16 tcp dport 8002 accept" in text
    assert "ip saddr 10.1.0.0/16 meta l4proto tcp ct original proto-dst 8002 accept" in text
    # no scraper network: Triton's port opens to no one (the host and trusted networks reach it)
    closed = h.firewall_plan(recorded.settings(monitoring_scrape_ports=["8002/tcp"]), ssh_ports())
    assert not [r for r in closed.open_ports if r["port"] == "8002"]


def test_the_boot_ruleset_loads_the_operators_tables_first():
    plan = h.firewall_plan(recorded.settings(), ssh_ports())
    boot = plan.boot_rules()
    head, _, tail = boot.partition(f'include "{h.OPERATOR_NFT_DIR}/*.nft"\n')
    assert tail and "table inet gpufleet" not in head
    assert "include" not in plan.rules().replace("included", "")


def test_who_must_have_a_key_before_anything_changes():
    plan = planned(hardening_allow_users=["root", "alice", "ops*"], hardening_allow_groups=["gpu"])
    assert isinstance(plan, h.HardeningPlan)
    # the deploy user and every named allowed user; a pattern names no one to check
    assert (plan.keys_for_users, plan.keys_for_groups) == (("root", "root", "alice"), ("gpu",))
    assert plan.firewall and plan.security_updates
    open_plan = planned(hardening_password_auth=True, firewall_enabled=False)
    assert isinstance(open_plan, h.HardeningPlan)
    assert (open_plan.keys_for_users, open_plan.keys_for_groups, open_plan.firewall) == ((), (), False)
