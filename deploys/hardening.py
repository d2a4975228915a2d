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
   where sshd is socket-activated. Docker's tables and forwarding are left alone, but a new
   connection to a port a container publishes passes only on the input chain's terms (the
   table's forward chain). Hosts that cannot load rules (containers) get the file written and
   checked, and are told so.
4. **Security updates**: unattended-upgrades on, from the distribution's security archive
   (Debian's, or Ubuntu's -security pocket with its release pocket and ESM), GPU packages
   blacklisted (GPU_PACKAGE_BLACKLIST, shared with the driver deploy; Ubuntu's prebuilt
   linux-modules-nvidia-* too). Where needrestart is installed (Ubuntu), it only lists services
   after apt, never restarts them or waits for an answer (deploys/base.py).

The decisions are gpufleet/plans/hardening.py's (HardeningPlan, FirewallPlan); this file applies
them, and turns the plan's refusals into stops before anything changes.
"""
from __future__ import annotations

import hashlib
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.files import Sha256File
from pyinfra.operations import apt, files, systemd

from gpufleet.apt_policy import APT_CACHE_SECONDS, GPU_PACKAGE_BLACKLIST, UNATTENDED_CONF
from gpufleet.config.failures import refuse
from gpufleet.explain import explained
from gpufleet.config.settings import Settings, host_settings
from gpufleet.controller import factcache
from gpufleet.facts.nftables import NftablesCapability, NftablesState
from gpufleet.facts.ssh import SshdActivation, SshdActivationData, SshdEffectiveConfig, SshdVersion
from gpufleet.operations import nftables, ssh, sshd_files
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.needrestart import quiet_needrestart
from gpufleet.operations.ssh import connecting_user
from gpufleet.plans.hardening import (NFTABLES_CONF, NFTABLES_UNIT_DROPIN, SSHD_BOOT_REVERT_UNIT, SSHD_DROPIN,
                                      FirewallPlan, HardeningPlan, firewall_plan, plan)
from gpufleet.plans.refusal import Refusal
from gpufleet.rendering import render


@deploy("Hardening")
def hardening() -> None:
    settings = host_settings(host)
    login_refusal = ssh.login_proof_refusal(host)
    planned = plan(settings, login_refusal=login_refusal, ssh_user=connecting_user(),
                   version=None if login_refusal else host.get_fact(SshdVersion))
    if isinstance(planned, Refusal):  # planning time: nothing changed on the host
        refuse(host, planned.key, planned.reason, planned.fix)
        return
    if planned.peers_warning:
        logger.warning(f"{host.print_prefix}{planned.peers_warning}")
    activation = host.get_fact(SshdActivation)
    if planned.keys_for_users:  # 1. on failure the host stops here, nothing changed
        ssh.require_authorized_keys(
            name=explained("Require SSH keys for the deploy user and allowed users", "Refuse to go on unless the deploy user and every allowed user have an SSH key"),
            users=list(planned.keys_for_users),
            groups=list(planned.keys_for_groups),
        )
    quiet_needrestart()
    apt.packages(
        name=explained("Install nftables and unattended-upgrades", "The firewall's and the security updates' packages"),
        packages=["nftables", "unattended-upgrades"],
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,
    )
    _sshd(settings, planned, activation)  # 2. each change proven by a fresh login, else put back
    if planned.firewall:  # 3.
        _firewall(settings, activation)
    if planned.security_updates:  # 4.
        _security_updates()


def _sshd(settings: Settings, planned: HardeningPlan, activation: SshdActivationData) -> None:
    """Candidate checked by sshd -t, reloaded behind a revert timer on the host, proven
    by a fresh login, else restored (by this run, or by the timer if this run is cut off,
    or at the next boot if the host went down first)."""
    boot_revert = files.put(
        name=explained("Install the sshd drop-in's revert-at-boot unit", "Install the unit that puts back, at boot, an sshd drop-in no login confirmed"),
        src=StringIO(render("etc/systemd/system/gpufleet-sshd-revert-at-boot.service.j2",
                            pending=ssh.PENDING, script=ssh.REVERT_SCRIPT, dest=SSHD_DROPIN,
                            backup=ssh.backup_path(SSHD_DROPIN))),
        dest=SSHD_BOOT_REVERT_UNIT,
        mode="644",
    )
    reload_when(explained("Let systemd read that unit", "A daemon-reload (through the reload guard) so that systemd knows the revert unit"), boot_revert)
    systemd.service(
        name=explained("Enable the revert-at-boot unit", "The revert unit runs at every boot"),
        service="gpufleet-sshd-revert-at-boot.service",
        running=None,  # a boot-time oneshot: nothing to run now
        enabled=True,
    )
    ssh.settle_pending(name=explained("Settle an sshd drop-in left unconfirmed", "Verify, else revert, an sshd drop-in an interrupted run left unconfirmed"), dest=SSHD_DROPIN)
    # The drop-in sorts first (wins over cloud-init's 50-), is judged by sshd -t, then sshd is
    # reloaded (plain daemon) or a running ssh.service restarted (socket-activated: a SIGHUP
    # would lose the sockets systemd passed it; ssh.socket and its ports are left alone, an idle
    # one reads it at the next login). Kept only if a fresh login as the deploy user works, else
    # the previous one is restored; the host reverts it on its own after
    # hardening_sshd_revert_after seconds if this run is cut off.
    how = "restart, keep ssh.socket" if activation.socket_activated else "reload sshd"
    ssh.sshd_dropin(
        name=explained(f"Install the hardened sshd drop-in ({how})", f"Install the hardened sshd drop-in that sorts first, if sshd -t accepts it, {how}, and keep it only if a fresh SSH login as the deploy user works"),
        dest=SSHD_DROPIN,
        content=planned.sshd.dropin_text(),
        revert_after=settings.hardening_sshd_revert_after,
    )
    ssh.expect_effective(name=explained("Check the effective sshd settings (sshd -T)", "Check with sshd -T that the hardened settings are the effective ones"), expected=dict(planned.expected_sshd))
    # sshd reads /etc/ssh/moduli at each group-exchange kex: no reload needed. After the
    # login check, so that a refused configuration leaves /etc/ssh exactly as it was.
    ssh.prune_moduli(
        name=explained(f"Remove Diffie-Hellman moduli below {settings.hardening_moduli_min_bits} bits", "Small Diffie-Hellman groups in /etc/ssh/moduli are removed (hardening_moduli_min_bits)"),
        min_bits=settings.hardening_moduli_min_bits,
    )
    # Host keys once the configuration is proven (a refused one leaves them untouched): an
    # Ed25519 key, and an RSA one of hardening_rsa_host_key_bits, a smaller one replaced only
    # when safe; the operation reloads sshd and proves a fresh login itself.
    sshd_files.host_keys(name=explained("Ensure sshd's Ed25519 and RSA host keys", "Give sshd an Ed25519 host key and a large enough RSA one, replacing a small one only when safe"),
                         min_rsa_bits=settings.hardening_rsa_host_key_bits)
    # sshd_config, drop-ins and host keys 0600, their folders 0755 (dev-sec's ssh-baseline)
    sshd_files.config_modes(name=explained("Make sshd's configuration root-only", "Make sshd's configuration and host keys readable by root only (0600, folders 0755)"))


def _firewall(settings: Settings, activation: SshdActivationData) -> None:
    """The firewall: nftables behind its revert timer."""
    rules = firewall_plan(settings, [*host.get_fact(SshdEffectiveConfig).ports, *activation.ports])
    can_load = host.get_fact(NftablesCapability).can_load
    if not _firewall_in_place(rules, can_load):
        # What a change opens is decided on sshd's facts read now, each with its own
        # command, never on an answer of the run's one-command prefetch, whose output holds
        # files other local users write (their authorized_keys): a no-op run costs nothing.
        with factcache.fresh(host):
            rules = firewall_plan(settings, [*host.get_fact(SshdEffectiveConfig).ports,
                                             *host.get_fact(SshdActivation).ports])
    if not can_load:
        # a host that cannot load rules (a container): the file written, checked by nft -c
        nftables.ruleset(name=explained("Write the firewall ruleset (nft -c checked)", f"Write the firewall ruleset to {NFTABLES_CONF}, if nft -c accepts it"), dest=NFTABLES_CONF,
                         content=rules.rules())
    # stopping nftables.service removes only gpufleet's table, never Docker's
    unit = files.put(
        name=explained("Install the nftables.service drop-in", "Make stopping nftables.service remove only gpufleet's table, never Docker's"),
        src=StringIO(render("etc/systemd/system/nftables.service.d/gpufleet.conf.j2")),
        dest=NFTABLES_UNIT_DROPIN,
        mode="644",
    )
    reload_when(explained("Let systemd read the nftables.service drop-in", "A daemon-reload (through the reload guard) so that stopping nftables.service removes only gpufleet's table"), unit)
    # Loaded atomically, reverted after firewall_revert_after seconds unless a fresh SSH login
    # works through it; only then saved to NFTABLES_CONF for every boot.
    nftables.apply(
        name=explained("Load the firewall (login-proven, then saved for boot)", f"Load the firewall atomically, reverted in {settings.firewall_revert_after} s unless a fresh SSH login works; only then save it to {NFTABLES_CONF}"),
        path=NFTABLES_CONF,
        content=rules.rules(),
        boot_content=rules.boot_rules(),
        revert_after=settings.firewall_revert_after,
    )


def _security_updates() -> None:
    """Unattended security upgrades, never for GPU packages."""
    files.put(
        name=explained("Turn on unattended security upgrades, never for GPU packages", "Unattended security upgrades, with the GPU packages blacklisted (upgraded only through gpufleet)"),
        src=StringIO(render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                            blacklist=list(GPU_PACKAGE_BLACKLIST))),
        dest=UNATTENDED_CONF,
        mode="644",
    )


def _firewall_in_place(rules: FirewallPlan, can_load: bool) -> bool:
    """These rules are the ones the host has: loaded and saved for boot where it can load
    them, else written to NFTABLES_CONF (the checks nftables.apply and nftables.ruleset make)."""
    if can_load:
        # NftablesCapability is a plain FactBase (no FactBase[NftablesState]): get_fact gives Any
        capability: NftablesState = host.get_fact(NftablesCapability)
        return capability.converged(hashlib.sha256(rules.boot_rules().encode()).hexdigest())
    return bool(host.get_fact(Sha256File, path=NFTABLES_CONF) == hashlib.sha256(rules.rules().encode()).hexdigest())


# `pyinfra INVENTORY deploys/hardening.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
