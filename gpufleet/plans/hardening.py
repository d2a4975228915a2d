"""The hardening plan: sshd's drop-in and the nftables ruleset a host gets, from its settings and
facts (pure; deploys/hardening.py applies it, tests/unit/test_hardening_plan.py checks it).

- sshd: the algorithm lists chosen for the host's OpenSSH (post-quantum hybrids first, then the
  classic kex paramiko still needs, encrypt-then-MAC MACs, Ed25519/RSA host keys) and the
  drop-in's lines (gpufleet/catalog/sshd_policy.py's table, the one `sshd -T` is checked
  against). Refused before anything changes: no SSH connection to prove a change with, a
  setting that would shut out the user this run logged in as, no sshd, an algorithm this sshd
  lacks.
- firewall: the SSH ports (every port sshd and ssh.socket listen on), the tier's open ports
  (firewall_open_ports, in the schema's grammar, gpufleet/config/schema.py), the exporters'
  (scoped to their listen address and the scrapers' networks), the other metrics ports
  (monitoring_scrape_ports, Triton's) from the scrapers' networks only, the training peers
  (gpufleet/plans/cluster.py) and the trusted networks. The same rules guard the ports Docker
  publishes, in the table's forward chain (templates/etc/nftables.conf.j2).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.catalog.sshd_policy import deploy_user, dropin, dropin_lines, expected_sshd, lockouts, named_users
from gpufleet.catalog.sshd_support import available, rejected_algorithms
from gpufleet.config.schema import split_port
from gpufleet.config.settings import Settings
from gpufleet.facts.nftables import TABLE
from gpufleet.facts.ssh import OpenSshVersion
from gpufleet.plans import cluster, monitoring
from gpufleet.plans.refusal import Refusal
from gpufleet.rendering import render

SSHD_DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
NFTABLES_CONF = "/etc/nftables.conf"
NFTABLES_UNIT_DROPIN = "/etc/systemd/system/nftables.service.d/gpufleet.conf"
SSHD_BOOT_REVERT_UNIT = "/etc/systemd/system/gpufleet-sshd-revert-at-boot.service"
#: where an operator's own /etc/nftables.conf is kept, loaded first at boot (operations/nftables.py)
OPERATOR_NFT_DIR = "/etc/nftables.d"

CIPHERS = (
    "chacha20-poly1305@openssh.com", "aes256-gcm@openssh.com", "aes128-gcm@openssh.com",
    "aes256-ctr", "aes192-ctr", "aes128-ctr",
)
MACS = ("hmac-sha2-512-etm@openssh.com", "hmac-sha2-256-etm@openssh.com", "umac-128-etm@openssh.com")
HOST_KEY_ALGORITHMS = ("ssh-ed25519", "rsa-sha2-512", "rsa-sha2-256")


def pq_kex(version: OpenSshVersion | None) -> list[str]:
    """Post-quantum hybrid key exchanges this OpenSSH server has, best first."""
    kex = []
    if version is not None and version.at_least(9, 9):
        kex += ["mlkem768x25519-sha256", "sntrup761x25519-sha512"]
    if version is not None and version.at_least(8, 5):
        kex += ["sntrup761x25519-sha512@openssh.com"]
    return kex


def kex_algorithms(version: OpenSshVersion | None, extra: Sequence[str]) -> list[str]:
    return list(dict.fromkeys([*pq_kex(version), *extra]))


# sshd ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SshdPlan:
    """The drop-in for this host's OpenSSH: its template's values and the lines it writes."""

    openssh_version: str
    password_auth: bool
    allow_users: tuple[str, ...]
    allow_groups: tuple[str, ...]
    kex: tuple[str, ...]
    lines: tuple[str, ...]
    ciphers: tuple[str, ...] = CIPHERS
    macs: tuple[str, ...] = MACS
    host_key_algorithms: tuple[str, ...] = HOST_KEY_ALGORITHMS

    def algorithms(self) -> dict[str, list[str]]:
        """The algorithm lists the drop-in writes, as `sshd -T` keys."""
        return {"kexalgorithms": list(self.kex), "ciphers": list(self.ciphers), "macs": list(self.macs),
                "hostkeyalgorithms": list(self.host_key_algorithms)}

    def template(self) -> dict[str, Any]:
        """The drop-in template's variables (templates/etc/ssh/sshd_config.d/)."""
        return {"openssh_version": self.openssh_version, "password_auth": self.password_auth,
                "allow_users": list(self.allow_users), "allow_groups": list(self.allow_groups),
                "host_key_algorithms": list(self.host_key_algorithms), "kex": list(self.kex),
                "ciphers": list(self.ciphers), "macs": list(self.macs), "sshd_lines": list(self.lines)}

    def dropin_text(self) -> str:
        return render("etc/ssh/sshd_config.d/00-gpufleet-hardening.conf.j2", **self.template())


def sshd_plan(settings: Settings, version: OpenSshVersion | None) -> SshdPlan:
    """The drop-in a host with this OpenSSH gets for `settings` (no refusal judged here)."""
    kex = tuple(kex_algorithms(version, settings.hardening_extra_kex))
    bare = SshdPlan(str(version) if version else "unknown", settings.hardening_password_auth,
                    tuple(settings.hardening_allow_users), tuple(settings.hardening_allow_groups), kex, ())
    lines = tuple(dropin_lines(dropin(settings, bare.algorithms())))
    return SshdPlan(bare.openssh_version, bare.password_auth, bare.allow_users, bare.allow_groups, kex, lines)


@dataclass(frozen=True)
class HardeningPlan:
    """What the hardening deploy applies: the user whose login proves each change, the drop-in,
    what `sshd -T` must show after it, who must have an SSH key first (none where passwords are
    allowed), whether the firewall and security updates are on, and a warning to print
    (a multi-node tier whose firewall lets no training peer in)."""

    user: str
    sshd: SshdPlan
    expected_sshd: Mapping[str, str | list[str]]
    keys_for_users: tuple[str, ...]
    keys_for_groups: tuple[str, ...]
    firewall: bool
    security_updates: bool
    peers_warning: str | None = None


def plan(settings: Settings, *, login_refusal: str | None, ssh_user: str | None,
         version: OpenSshVersion | None) -> HardeningPlan | Refusal:
    """The plan, or why the host is refused (nothing changed on it).

    login_refusal: why no fresh SSH login can prove a change (operations/ssh.py
    login_proof_refusal), None where one can; ssh_user: the user this connection logged in as;
    version: the host's `sshd -V` (None: no sshd)."""
    if login_refusal:
        # sshd and firewall changes are kept only after a fresh SSH login proves them: fail closed
        return Refusal("hardening", "connector", login_refusal.removesuffix(" Run this deploy over SSH."),
                       "run this deploy over SSH (pyinfra's ssh connector)")
    # The inventory's lock-outs were refused before planning (gpufleet/config/settings.py); these
    # are judged again for the user this connection really logged in as (~/.ssh/config's User).
    user = deploy_user(ssh_user)
    for key, problem, allowed in lockouts(settings.hardening_permit_root_login, settings.hardening_allow_users,
                                          user, "the user this run logged in as"):
        return Refusal("hardening", key, problem, "set it to " + allowed)
    if version is None:
        return Refusal("hardening", "hardening", "OpenSSH server not found (sshd -V); nothing to harden",
                       "install openssh-server on the host, or leave it out of the hardening deploy")
    sshd = sshd_plan(settings, version)
    # Never write an algorithm this sshd does not have (Ubuntu 22.04's OpenSSH 8.9 has no
    # mlkem768x25519-sha256): refused here, not by sshd -t later.
    rejected = rejected_algorithms(version, {"kex": list(sshd.kex), "cipher": list(sshd.ciphers),
                                             "mac": list(sshd.macs), "HostKeyAlgorithms": list(sshd.host_key_algorithms)})
    if rejected:
        return Refusal("hardening", "hardening_extra_kex", "; ".join(rejected),
                       "use only what this host's sshd offers: " + ", ".join(available(version, "kex")))
    keys = not settings.hardening_password_auth  # keys only: nobody may be left without one
    return HardeningPlan(
        user, sshd, expected_sshd(settings, sshd.algorithms()),
        keys_for_users=(user, *named_users(settings.hardening_allow_users)) if keys else (),
        keys_for_groups=tuple(settings.hardening_allow_groups) if keys else (),
        firewall=settings.firewall_enabled, security_updates=settings.hardening_unattended_upgrades,
        peers_warning=cluster.missing_peers(settings))


# firewall -----------------------------------------------------------------------------------

#: a rule of the input chain (and of the forward chain's published ports): port ("9400" or
#: "6817-6819"), proto, comment; saddr/daddr where it is scoped to a network / listen address
Rule = Mapping[str, str]


def port_rules(items: Iterable[str], comment: str = "") -> list[dict[str, str]]:
    """Rules for ports the schema checked ("9400/tcp", "6817-6819/udp": gpufleet/config/schema.py)."""
    return [{"port": port, "proto": proto, "comment": comment} for port, proto in map(split_port, items)]


@dataclass(frozen=True)
class FirewallPlan:
    """The `inet gpufleet` table: inbound default-deny but these, the same for published ports."""

    ssh_ports: tuple[int, ...]
    open_ports: tuple[Rule, ...]
    trusted_cidrs: tuple[str, ...]
    cluster_rules: tuple[Rule, ...]

    def template(self, include_dir: str | None = None) -> dict[str, Any]:
        """templates/etc/nftables.conf.j2's variables; include_dir: the boot version's."""
        return {"table": TABLE, "ssh_ports": list(self.ssh_ports), "open_ports": [dict(r) for r in self.open_ports],
                "trusted_cidrs": list(self.trusted_cidrs), "cluster_rules": [dict(r) for r in self.cluster_rules],
                "include_dir": include_dir}

    def rules(self) -> str:
        """The ruleset loaded live (and written where the host cannot load rules)."""
        return render("etc/nftables.conf.j2", **self.template())

    def boot_rules(self) -> str:
        """The ruleset saved for boot: the operator's own tables (OPERATOR_NFT_DIR) load first."""
        return render("etc/nftables.conf.j2", **self.template(OPERATOR_NFT_DIR))


def firewall_plan(settings: Settings, ssh_ports: Iterable[int]) -> FirewallPlan:
    """The ruleset for `settings`, with SSH open on `ssh_ports` (sshd -T's and ssh.socket's; 22
    when none is known). A listed port SSH already opens is not listed twice."""
    ssh = sorted(set(ssh_ports))
    ssh_text = {str(p) for p in ssh}
    open_ports = [r for r in port_rules(settings.firewall_open_ports)
                  if not (r["proto"] == "tcp" and r["port"] in ssh_text)]
    # the exporters' ports follow the monitoring_ keys (one source), for their listen address only
    open_ports += [r for r in monitoring.firewall_rules(settings)
                   if not any(o["proto"] == "tcp" and o["port"] == r["port"] for o in open_ports)
                   and r["port"] not in ssh_text]
    # other metrics ports (Triton's) as the exporters': only from the scrapers' networks
    open_ports += [{**r, "saddr": network, "daddr": ""}
                   for r in port_rules(settings.monitoring_scrape_ports, "metrics (monitoring_scrape_ports)")
                   for network in settings.monitoring_allowed_cidrs
                   if not (r["proto"] == "tcp" and r["port"] in ssh_text)]
    return FirewallPlan(tuple(ssh or [22]), tuple(open_ports), tuple(settings.firewall_trusted_cidrs),
                        tuple(cluster.rules(settings)))
