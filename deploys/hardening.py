"""SSH hardening, host firewall and security updates, without ever cutting off the operator.

Story of a host, part 5 (last, so that it cannot cut off the steps before it):

1. **SSH** keys only, root by key only, short grace time, no forwarding/X11, the inventory's
   AllowUsers/AllowGroups, and algorithms chosen for the host's OpenSSH version:
   post-quantum hybrids first (mlkem768x25519-sha256 on 9.9+, sntrup761x25519 on 8.5+),
   then the classic curve25519 kex that paramiko 4 (pyinfra, testinfra) still needs,
   encrypt-then-MAC MACs only, Ed25519/RSA host keys only, moduli below 3072 bits removed.
   The drop-in 00-gpufleet-hardening.conf sorts first, so it wins over cloud-init's
   50-cloud-init.conf; the effective result is checked with `sshd -T`. Every sshd control of
   the dev-sec ssh-baseline is met (differences explained in tiers.yaml): sshd_config and
   drop-ins 0600, an RSA host key of hardening_rsa_host_key_bits (replaced only when safe).
2. **Lock-out protection**: no key for the connecting user or an allowed user -> the host
   fails before anything changes; `sshd -t` judges the candidate before any reload; after
   the reload a fresh login as the deploy user (paramiko, like pyinfra) must work, or the
   previous drop-in is restored and reloaded and the host fails with a clear message. A
   timer on the host, armed before the reload, restores it on its own if the run is cut off
   (hardening_sshd_revert_after), a unit does so at boot if the host went down first, and the
   next run verifies or reverts a drop-in still waiting for its confirmation.
   Socket-activated sshd (ssh.socket: Ubuntu 22.10+ by default, Debian 13 on request): the
   socket keeps its listening ports (gpufleet writes no Port/ListenAddress, so Ubuntu's
   sshd-socket-generator has nothing to change), a running ssh.service is restarted (a SIGHUP
   reload loses the sockets systemd passed it), an idle one reads the new drop-in at the next
   login; the same fresh-login proof, revert timer and boot revert.
   No algorithm the host's OpenSSH lacks is ever written (gpufleet/catalog/sshd_support.py: Ubuntu
   22.04's 8.9p1 has no mlkem768x25519-sha256): such a hardening_extra_kex is refused first.
3. **Firewall**: /etc/nftables.conf holds only gpufleet's `inet gpufleet` table (inbound
   default-deny except loopback, established, ICMP essentials, SSH and the tier's ports),
   checked with `nft -c`, loaded atomically behind a 60 s dead-man switch; only once a fresh SSH
   login works through it is it saved to /etc/nftables.conf (nftables.service enabled) and the
   switch disarmed, so a ruleset that cut the operator off is gone live and at the next boot.
   At boot that file first includes /etc/nftables.d/*.nft, where an operator's own
   /etc/nftables.conf is kept when gpufleet's replaces it.
   SSH ports: every port sshd listens on (`sshd -T` port and listenaddress) and ssh.socket's
   where sshd is socket-activated. Docker's tables and forwarding are left alone. Hosts that cannot load
   rules (containers) get the file written and checked, and are told so.
4. **Security updates**: unattended-upgrades on, from the distribution's security archive
   (Debian's, or Ubuntu's -security pocket with its release pocket and ESM), GPU packages
   blacklisted (GPU_PACKAGE_BLACKLIST, shared with the driver deploy; Ubuntu's prebuilt
   linux-modules-nvidia-* too). Where needrestart is installed (Ubuntu), it only lists services
   after apt, never restarts them or waits for an answer (deploys/base.py).
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from typing import Any
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.files import Sha256File
from pyinfra.operations import apt, files, systemd

from gpufleet.facts.nftables import TABLE, NftablesCapability, NftablesState
from gpufleet.facts.ssh import OpenSshVersion, SshdActivation, SshdEffectiveConfig, SshdVersion
from gpufleet.operations import nftables, ssh
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.ssh import connecting_user

from gpufleet.apt_policy import APT_CACHE_SECONDS, GPU_PACKAGE_BLACKLIST, UNATTENDED_CONF
from gpufleet.operations.needrestart import quiet_needrestart
from gpufleet.rendering import render
from gpufleet.plans import cluster
from gpufleet.controller import factcache
from gpufleet.plans import monitoring
from gpufleet.config.failures import refuse
from gpufleet.config.settings import Settings, host_settings
from gpufleet.catalog.sshd_policy import deploy_user, dropin, dropin_lines, expected_sshd, lockouts, named_users
from gpufleet.catalog.sshd_support import available, rejected_algorithms
from gpufleet.operations import sshd_files

SSHD_DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
NFTABLES_CONF = "/etc/nftables.conf"
NFTABLES_UNIT_DROPIN = "/etc/systemd/system/nftables.service.d/gpufleet.conf"
SSHD_BOOT_REVERT_UNIT = "/etc/systemd/system/gpufleet-sshd-revert-at-boot.service"


# Algorithm choices by OpenSSH version --------------------------------------------------------

CIPHERS = [
    "chacha20-poly1305@openssh.com", "aes256-gcm@openssh.com", "aes128-gcm@openssh.com",
    "aes256-ctr", "aes192-ctr", "aes128-ctr",
]
MACS = ["hmac-sha2-512-etm@openssh.com", "hmac-sha2-256-etm@openssh.com", "umac-128-etm@openssh.com"]
HOST_KEY_ALGORITHMS = ["ssh-ed25519", "rsa-sha2-512", "rsa-sha2-256"]


def pq_kex(version: OpenSshVersion | None) -> list[str]:
    """Post-quantum hybrid key exchanges this OpenSSH server has, best first."""
    kex = []
    if version is not None and version.at_least(9, 9):
        kex += ["mlkem768x25519-sha256", "sntrup761x25519-sha512"]
    if version is not None and version.at_least(8, 5):
        kex += ["sntrup761x25519-sha512@openssh.com"]
    return kex


def kex_algorithms(version: OpenSshVersion | None, extra: list[str]) -> list[str]:
    return list(dict.fromkeys([*pq_kex(version), *extra]))


# Firewall ports --------------------------------------------------------------------------------

_PORT = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?(?:/(tcp|udp))?$")


def parse_open_ports(items: Iterable[object] | None) -> list[dict[str, str]]:
    """Normalise firewall_open_ports to [{port: "9400" | "6817-6819", proto, comment}]."""
    rules: list[dict[str, str]] = []
    for item in items or []:
        comment = ""
        proto = None
        if isinstance(item, dict):
            comment = str(item.get("comment", ""))
            proto = item.get("proto")
            item = item.get("port")
        text = str(item).strip() if isinstance(item, (int, str)) and not isinstance(item, bool) else ""
        match = _PORT.match(text)
        if not match:
            raise ValueError(f"firewall_open_ports: bad port {item!r} (use 9400, '9400/udp', "
                             "'6817-6819' or {port, proto, comment})")
        low, high = int(match[1]), int(match[2] or match[1])
        if not (1 <= low <= high <= 65535):
            raise ValueError(f"firewall_open_ports: port out of range in {item!r}")
        proto = proto or match[3] or "tcp"
        if proto not in ("tcp", "udp"):
            raise ValueError(f"firewall_open_ports: protocol must be tcp or udp, not {proto!r}")
        if '"' in comment:
            raise ValueError(f"firewall_open_ports: no double quotes in comments ({comment!r})")
        rule = {"port": str(low) if low == high else f"{low}-{high}", "proto": proto, "comment": comment}
        if rule not in rules and not any(r["port"] == rule["port"] and r["proto"] == proto for r in rules):
            rules.append(rule)
    return rules


def sshd_context(settings: Settings, version: OpenSshVersion | None) -> dict[str, Any]:
    """What the drop-in template and the lock-out protection read; the drop-in's lines are
    gpufleet/catalog/sshd_policy.py's table, the one `sshd -T` is checked against."""
    ctx: dict[str, Any] = {
        "openssh_version": str(version) if version else "unknown",
        "password_auth": settings.hardening_password_auth,
        "allow_users": list(settings.hardening_allow_users),
        "allow_groups": list(settings.hardening_allow_groups),
        "host_key_algorithms": HOST_KEY_ALGORITHMS,
        "kex": kex_algorithms(version, list(settings.hardening_extra_kex)),
        "ciphers": CIPHERS,
        "macs": MACS,
    }
    ctx["sshd_lines"] = dropin_lines(dropin(settings, sshd_algorithms(ctx)))
    return ctx


def sshd_algorithms(ctx: dict[str, Any]) -> dict[str, list[str]]:
    """The algorithm lists the drop-in writes for this host's OpenSSH, as `sshd -T` keys."""
    return {"kexalgorithms": ctx["kex"], "ciphers": ctx["ciphers"], "macs": ctx["macs"],
            "hostkeyalgorithms": ctx["host_key_algorithms"]}


def nftables_context(settings: Settings, ssh_ports: list[int]) -> dict[str, Any]:
    cidrs = list(settings.firewall_trusted_cidrs)  # normalised networks (gpufleet/config/schema.py)
    open_ports = [r for r in parse_open_ports(settings.firewall_open_ports)
                  if not (r["proto"] == "tcp" and r["port"] in {str(p) for p in ssh_ports})]
    # the exporters' ports follow the monitoring_ keys (one source), for their listen address only
    open_ports += [r for r in monitoring.firewall_rules(settings)
                   if not any(o["proto"] == "tcp" and o["port"] == r["port"] for o in open_ports)
                   and r["port"] not in {str(p) for p in ssh_ports}]
    # other metrics ports (Triton's) as the exporters': only from the scrapers' networks
    open_ports += [{**r, "comment": r["comment"] or "metrics (monitoring_scrape_ports)", "saddr": network, "daddr": ""}
                   for r in parse_open_ports(settings.monitoring_scrape_ports) for network in settings.monitoring_allowed_cidrs
                   if not (r["proto"] == "tcp" and r["port"] in {str(p) for p in ssh_ports})]
    return {"table": TABLE, "ssh_ports": ssh_ports or [22], "open_ports": open_ports,
            "trusted_cidrs": cidrs, "cluster_rules": cluster.rules(settings), "include_dir": None}


# The deploy ----------------------------------------------------------------------------------

@deploy("SSH hardening and firewall")
def hardening() -> None:
    settings = host_settings(host)
    planned = _refused_or_planned(settings)
    if planned is None:
        return
    user, ctx = planned
    if warning := cluster.missing_peers(settings):  # planning time: before anything changes
        logger.warning(f"{host.print_prefix}{warning}")
    activation = host.get_fact(SshdActivation)
    _lockout_protection(ctx, user)   # 1. on failure the host stops here, nothing changed
    quiet_needrestart()
    apt.packages(
        name="Install nftables and unattended-upgrades",
        packages=["nftables", "unattended-upgrades"],
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,
    )
    _sshd(settings, ctx, activation)  # 2. each change proven by a fresh login, else put back
    if settings.firewall_enabled and not _firewall(settings, activation):  # 3.
        return
    if settings.hardening_unattended_upgrades:  # 4.
        _security_updates()


def _refused_or_planned(settings: Settings) -> tuple[str, dict[str, Any]] | None:
    """(the deploy user, the sshd template context), or None: refused, named, nothing changed."""
    # Fail closed: sshd and firewall changes are kept only after a fresh SSH login proves them,
    # and gpufleet can log in afresh only as pyinfra's ssh connector does.
    refusal = ssh.login_proof_refusal(host)
    if refusal:
        refuse(host, "connector", refusal.removesuffix(" Run this deploy over SSH."),  # said as the fix
               "run this deploy over SSH (pyinfra's ssh connector)")
        return None
    # The inventory's lock-outs were refused before planning (gpufleet/config/settings.py); these are
    # judged again for the user this connection really logged in as (~/.ssh/config's User...).
    user = deploy_user(connecting_user())
    for key, problem, allowed in lockouts(settings.hardening_permit_root_login, settings.hardening_allow_users,
                                          user, "the user this run logged in as"):
        refuse(host, key, problem, "set it to " + allowed)
        return None
    version = host.get_fact(SshdVersion)
    if version is None:
        refuse(host, "hardening", "OpenSSH server not found (sshd -V); nothing to harden",
               "install openssh-server on the host, or leave it out of the hardening deploy")
        return None
    ctx = sshd_context(settings, version)
    # Never write an algorithm this sshd does not have (Ubuntu 22.04's OpenSSH 8.9 has no
    # mlkem768x25519-sha256): refused here, before anything changes, not by sshd -t later.
    rejected = rejected_algorithms(version, {"kex": ctx["kex"], "cipher": ctx["ciphers"],
                                             "mac": ctx["macs"], "HostKeyAlgorithms": ctx["host_key_algorithms"]})
    if rejected:
        refuse(host, "hardening_extra_kex", "; ".join(rejected),
               "use only what this host's sshd offers: " + ", ".join(available(version, "kex")))
        return None
    return user, ctx


def _lockout_protection(ctx: dict[str, Any], user: str) -> None:
    """Lock-out protection first: on failure the host stops here, nothing changed."""
    if not ctx["password_auth"]:
        ssh.require_authorized_keys(
            name="Refuse to go on unless the deploy user and every allowed user have an SSH key",
            users=[user, *named_users(ctx["allow_users"])],
            groups=ctx["allow_groups"],
        )


def _sshd(settings: Settings, ctx: dict[str, Any], activation: Any) -> None:
    """Candidate checked by sshd -t, reloaded behind a revert timer on the host, proven
    by a fresh login, else restored (by this run, or by the timer if this run is cut off,
    or at the next boot if the host went down first)."""
    boot_revert = files.put(
        name="Install the unit that puts back, at boot, an sshd drop-in no login confirmed",
        src=_as_file(render("etc/systemd/system/gpufleet-sshd-revert-at-boot.service.j2",
                            pending=ssh.PENDING, script=ssh.REVERT_SCRIPT, dest=SSHD_DROPIN,
                            backup=ssh.backup_path(SSHD_DROPIN))),
        dest=SSHD_BOOT_REVERT_UNIT,
        mode="644",
    )
    reload_when("Let systemd read that unit", boot_revert)
    systemd.service(
        name="Run it at every boot",
        service="gpufleet-sshd-revert-at-boot.service",
        running=None,  # a boot-time oneshot: nothing to run now
        enabled=True,
    )
    ssh.settle_pending(
        name="Verify, else revert, an sshd drop-in an interrupted run left unconfirmed",
        dest=SSHD_DROPIN,
    )
    how = ("reload sshd" if not activation.socket_activated else
           "restart a running socket-activated sshd (sessions kept, never by SIGHUP), leaving "
           f"ssh.socket and its ports ({', '.join(map(str, activation.ports)) or 'none'}) alone "
           "(an idle one reads it at the next login)")
    ssh.sshd_dropin(
        name="Install the hardened sshd drop-in that sorts first, if sshd -t accepts it, "
             f"{how}, and keep it only if a fresh SSH login as the deploy user works (else the previous "
             f"one is restored; reverted by the host in {settings.hardening_sshd_revert_after} s if this run "
             "is cut off)",
        dest=SSHD_DROPIN,
        content=render("etc/ssh/sshd_config.d/00-gpufleet-hardening.conf.j2", **ctx),
        revert_after=settings.hardening_sshd_revert_after,
    )
    ssh.expect_effective(
        name="Check with sshd -T that the hardened settings are the effective ones",
        expected=expected_sshd(settings, sshd_algorithms(ctx)),
    )
    # sshd reads /etc/ssh/moduli at each group-exchange kex: no reload needed. After the
    # login check, so that a refused configuration leaves /etc/ssh exactly as it was.
    ssh.prune_moduli(
        name=f"Remove Diffie-Hellman moduli below {settings.hardening_moduli_min_bits} bits",
        min_bits=settings.hardening_moduli_min_bits,
    )
    # Host keys once the configuration is proven (a refused one leaves them untouched); the
    # operation reloads sshd and proves a fresh login itself.
    sshd_files.host_keys(
        name="Give sshd an Ed25519 host key and a large enough RSA one, replacing a small one only when safe",
        min_rsa_bits=settings.hardening_rsa_host_key_bits,
    )
    sshd_files.config_modes(
        name="Make sshd's configuration and host keys readable by root only (0600, folders 0755)",
    )


def _firewall(settings: Settings, activation: Any) -> bool:
    """The firewall: nftables behind its revert timer. False: refused (named), stop here."""
    built = _firewall_rules(settings, host.get_fact(SshdEffectiveConfig).ports, activation.ports)
    if built is None:
        return False
    can_load = host.get_fact(NftablesCapability).can_load
    if not _firewall_in_place(*built[1:], can_load):
        # What a change opens is decided on sshd's facts read now, each with its own
        # command, never on an answer of the run's one-command prefetch, whose output holds
        # files other local users write (their authorized_keys): a no-op run costs nothing.
        with factcache.fresh(host):
            built = _firewall_rules(settings, host.get_fact(SshdEffectiveConfig).ports,
                                    host.get_fact(SshdActivation).ports)
        if built is None:
            return False
    _, rules, boot_rules = built
    if not can_load:
        nftables.ruleset(
            name=f"Write the firewall ruleset to {NFTABLES_CONF}, if nft -c accepts it",
            dest=NFTABLES_CONF,
            content=rules,
        )
    unit = files.put(
        name="Make stopping nftables.service remove only gpufleet's table, never Docker's",
        src=_as_file(render("etc/systemd/system/nftables.service.d/gpufleet.conf.j2")),
        dest=NFTABLES_UNIT_DROPIN,
        mode="644",
    )
    reload_when("Let systemd read the nftables.service drop-in", unit)
    nftables.apply(
        name="Load the firewall atomically, reverted in "
             f"{settings.firewall_revert_after} s unless a fresh SSH login works; "
             f"only then save it to {NFTABLES_CONF} for every boot",
        path=NFTABLES_CONF,
        content=rules,
        boot_content=boot_rules,
        revert_after=settings.firewall_revert_after,
    )
    return True


def _security_updates() -> None:
    """Unattended security upgrades, never for GPU packages."""
    files.put(
        name="Turn on unattended security upgrades, never for GPU packages",
        src=_as_file(render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                            blacklist=list(GPU_PACKAGE_BLACKLIST))),
        dest=UNATTENDED_CONF,
        mode="644",
    )


def _as_file(text: str) -> StringIO:
    return StringIO(text)


def _firewall_rules(settings: Settings, sshd_ports: list[int], socket_ports: list[int]
                    ) -> tuple[dict[str, Any], str, str] | None:
    """(template context, the ruleset, the ruleset for boot), or None: refused."""
    try:
        context = nftables_context(settings, sorted({*sshd_ports, *socket_ports}))
    except ValueError as bad:  # the settings grammar lets none through: never guess a port
        refuse(host, "firewall_open_ports", str(bad).removeprefix("firewall_open_ports: "), "list ports as 9400, '9400/udp', '6817-6819' or "
               "{port, proto, comment}")
        return None
    return (context, render("etc/nftables.conf.j2", **context),
            render("etc/nftables.conf.j2", **{**context, "include_dir": nftables.OPERATOR_DIR}))


def _firewall_in_place(rules: str, boot_rules: str, can_load: bool) -> bool:
    """These rules are the ones the host has: loaded and saved for boot where it can load
    them, else written to NFTABLES_CONF (the checks nftables.apply and nftables.ruleset make)."""
    if can_load:
        # NftablesCapability is a plain FactBase (no FactBase[NftablesState]): get_fact gives Any
        capability: NftablesState = host.get_fact(NftablesCapability)
        return capability.converged(hashlib.sha256(boot_rules.encode()).hexdigest())
    return host.get_fact(Sha256File, path=NFTABLES_CONF) == hashlib.sha256(rules.encode()).hexdigest()


# `pyinfra INVENTORY deploys/hardening.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
