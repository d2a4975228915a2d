"""Unit: what the hardening plan (gpufleet/plans/hardening.py) renders: algorithm lists by OpenSSH version (PQ hybrids first,
paramiko's curve25519 kept, ETM MACs only), the sshd drop-in, the nftables ruleset (only
gpufleet's table, exactly the listed ports) and the unattended-upgrades blacklist."""
from __future__ import annotations

import pytest

from gpufleet.apt_policy import GPU_PACKAGE_BLACKLIST
from gpufleet.plans import hardening as h
from gpufleet.rendering import render
from gpufleet.facts.ssh import OpenSshVersion
from gpufleet.catalog.sshd_policy import HOST_KEY_FILES, expected_sshd
from gpufleet.catalog.tiers import tier_defaults

pytestmark = pytest.mark.unit

V92 = OpenSshVersion(9, 2)
V100 = OpenSshVersion(10, 0, 2)
CLASSIC = list(tier_defaults("dev")["hardening_extra_kex"])


def test_kex_by_version():
    assert h.kex_algorithms(V100, CLASSIC) == [
        "mlkem768x25519-sha256", "sntrup761x25519-sha512", "sntrup761x25519-sha512@openssh.com",
        "curve25519-sha256@libssh.org"]
    assert h.kex_algorithms(V92, CLASSIC) == [
        "sntrup761x25519-sha512@openssh.com", "curve25519-sha256@libssh.org"]
    assert h.kex_algorithms(OpenSshVersion(8, 4), CLASSIC) == CLASSIC
    # paramiko 4 speaks only curve25519-sha256@libssh.org of these: it must stay by default,
    # and only it (its alias curve25519-sha256 would be one more ssh-audit warning)
    assert CLASSIC == ["curve25519-sha256@libssh.org"]


def test_macs_are_etm_only_and_no_weak_host_keys():
    assert all(m.endswith("-etm@openssh.com") for m in h.MACS)
    assert not [a for a in h.HOST_KEY_ALGORITHMS if "ecdsa" in a or "dss" in a]


def _settings(**over):
    from types import SimpleNamespace

    return SimpleNamespace(**{**tier_defaults("dev"), "hardening_allow_users": ["alice", "root"], **over})


def test_sshd_dropin_renders_every_expected_setting():
    settings = _settings()
    sshd = h.sshd_plan(settings, V100)
    text = sshd.dropin_text()
    assert text.startswith("# Managed by gpufleet")
    rendered: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition(" ")
            rendered.setdefault(key.lower(), []).append(value)
    expected = expected_sshd(settings, sshd.algorithms())
    # nothing written goes unchecked in sshd -T but DebianBanner (not printed by Debian 12's sshd)
    assert set(rendered) - set(expected) == {"debianbanner"}
    for key, value in expected.items():
        if isinstance(value, list):  # one sshd -T line per value: HostKey lines, AllowUsers' names
            assert [v for line in rendered[key] for v in line.split()] == value, key
        else:
            assert rendered[key] == [value], key
    assert rendered["allowusers"] == ["alice root"] and rendered["hostkey"] == HOST_KEY_FILES
    assert "AllowGroups" not in text and "Match" not in text


def test_port_rules_read_the_schemas_grammar():
    """One port grammar, the schema's: the plan reads what it let through, never parses its own."""
    from gpufleet.config.schema import BadValue, _check_port

    checked = [_check_port(p) for p in (9400, "9100/tcp", "6817-6819/tcp", "5353/udp")]
    assert h.port_rules(checked) == [
        {"port": "9400", "proto": "tcp", "comment": ""},
        {"port": "9100", "proto": "tcp", "comment": ""},
        {"port": "6817-6819", "proto": "tcp", "comment": ""},
        {"port": "5353", "proto": "udp", "comment": ""},
    ]
    for bad in ["99999/tcp", "22/sctp", "10-5/tcp", "9100", True, None]:
        with pytest.raises(BadValue):
            _check_port(bad)


def test_nftables_ruleset_replaces_only_its_own_table():
    text = render("etc/nftables.conf.j2", table="inet gpufleet", ssh_ports=[22],
                    open_ports=[{"port": "9400", "proto": "tcp", "comment": "DCGM exporter"},
                                *h.port_rules(["6817-6819/tcp"])],
                    trusted_cidrs=["10.0.0.0/8", "fd00::/8"], cluster_rules=[], include_dir=None)
    rules = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in rules if "flush" in line]
    assert "table inet gpufleet\ndelete table inet gpufleet\n" in text
    assert "hook input" in text and "policy drop" in text
    # the forward hook only for new connections Docker DNATs to a published port; the rest passes
    assert "type filter hook forward priority filter; policy accept;\n\t\tct state new ct status dnat jump published\n\t}" in text
    assert 'tcp dport 22 accept comment "ssh"' in text
    assert 'tcp dport 9400 accept comment "DCGM exporter"' in text
    assert "tcp dport 6817-6819 accept" in text
    assert "ip saddr 10.0.0.0/8 accept" in text and "ip6 saddr fd00::/8 accept" in text
    published = text[text.index("chain published"):]
    assert "meta l4proto tcp ct original proto-dst 9400 accept" in published
    assert "meta l4proto tcp ct original proto-dst 6817-6819 accept" in published
    assert "ip saddr 10.0.0.0/8 accept" in published and "ip6 saddr fd00::/8 accept" in published
    assert published.rstrip().endswith('drop comment "a published port, from a network the tier does not open it to"\n\t}\n}')


def test_nftables_boot_version_loads_the_operators_tables_first():
    context = dict(table="inet gpufleet", ssh_ports=[22], open_ports=[], trusted_cidrs=[], cluster_rules=[])
    live = render("etc/nftables.conf.j2", **context, include_dir=None)
    boot = render("etc/nftables.conf.j2", **context, include_dir="/etc/nftables.d")
    assert "include" not in live.replace("included", "")
    head, _, tail = boot.partition('include "/etc/nftables.d/*.nft"\n')
    assert tail and "table inet gpufleet" not in head  # before gpufleet's table
    assert tail.strip().endswith(live.split("table inet gpufleet\n", 1)[1].strip())


def test_unattended_upgrades_blacklist_covers_the_gpu_stack():
    import re
    text = render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                    blacklist=list(GPU_PACKAGE_BLACKLIST))
    assert text.startswith("// Managed by gpufleet")
    patterns = re.findall(r'^\t"(.+)";$', text, re.M)
    # unattended-upgrades matches with re.match (anchored at the start of the name)
    for package in ["nvidia-driver", "libnvidia-compute-580", "cuda-toolkit-13-0", "libcudnn9-cuda-13",
                    "cudnn9-cuda-13", "libnccl2", "nvidia-fabricmanager-580", "nvidia-container-toolkit",
                    "firmware-nvidia-gsp", "libcuda1"]:
        assert any(re.match(p, package) for p in patterns), package
    for package in ["openssh-server", "libc6", "linux-image-amd64", "docker-ce"]:
        assert not any(re.match(p, package) for p in patterns), package


@pytest.mark.parametrize("version", [V92, V100], ids=str)
def test_paramiko_keeps_an_algorithm_of_each_kind(version):
    """pyinfra and testinfra log in with paramiko: each list sshd offers must keep one it speaks."""
    import paramiko

    t = paramiko.Transport
    assert set(h.kex_algorithms(version, CLASSIC)) & set(t._preferred_kex) == {"curve25519-sha256@libssh.org"}
    assert set(h.CIPHERS) & set(t._preferred_ciphers)
    assert set(h.MACS) & set(t._preferred_macs)
    assert "ssh-ed25519" in set(h.HOST_KEY_ALGORITHMS) & set(t._preferred_keys)


@pytest.mark.parametrize("tier", ["dev", "research", "hgx"])
def test_the_validation_gate_checks_every_setting_the_deploy_sets(tier):
    """gpufleet/sshd_policy.expected_sshd (the gate) is what the deploy expects after its reload,
    but for the algorithm lists that depend on the host's OpenSSH version."""
    settings = _settings(**tier_defaults(tier))
    algorithms = h.sshd_plan(settings, V100).algorithms()
    deploy = expected_sshd(settings, algorithms)
    assert expected_sshd(settings) == {k: v for k, v in deploy.items() if k not in algorithms}
    assert set(algorithms) == {"kexalgorithms", "ciphers", "macs", "hostkeyalgorithms"}
    assert expected_sshd(settings)["loglevel"] == "VERBOSE"  # a dev-sec control, not only the basics
