"""The validation gate, hardening: sshd, the firewall and the training peers."""
from __future__ import annotations

from typing import Any

from pyinfra.facts.files import FileContents

from gpufleet.catalog.sshd_policy import expected_sshd
from gpufleet.checks.gate import FAIL, FIX_DEPLOY, PASS, SKIP, WARN, Context, Result, check
from gpufleet.facts.nftables import TABLE, NftablesCapability
from gpufleet.facts.ssh import SshdEffectiveConfig


@check("hardening")
def sshd_hardened(ctx: Context) -> Result:
    name = "sshd's effective configuration is hardened"
    config = ctx.fact(SshdEffectiveConfig)
    if config is None:
        return Result("hardening", name, FAIL, "sshd -T printed nothing (no sshd?)", FIX_DEPLOY)
    expected = expected_sshd(ctx.settings)
    wrong = [f"{key} {_sshd_value(got)} (want {_sshd_value(want)})" for key, got, want in config.differences(expected)]
    if wrong:
        return Result("hardening", name, FAIL, "sshd -T: " + ", ".join(wrong), FIX_DEPLOY)
    return Result("hardening", name, PASS, f"{len(expected)} settings as the tier says")


def _sshd_value(value: Any) -> str:
    """A value as sshd_config writes it (a multi-valued keyword's values space-separated)."""
    if isinstance(value, list):
        return " ".join(value) if value else "none"
    return str(value)


@check("hardening")
def firewall_active(ctx: Context) -> Result:
    name = "the host firewall is active"
    if not ctx.settings.firewall_enabled:
        return Result("hardening", name, SKIP, "firewall_enabled: false")
    nft = ctx.fact(NftablesCapability)
    conf = ctx.fact(FileContents, path="/etc/nftables.conf") or []
    written = any(f"table {TABLE}" in line for line in conf)
    if not nft.nft_installed:
        return Result("hardening", name, FAIL, "nft is not installed", FIX_DEPLOY)
    if not nft.can_load:
        if written:
            return Result("hardening", name, SKIP, "this host cannot load rules (no CAP_NET_ADMIN, e.g. a "
                          f"container); /etc/nftables.conf holds table {TABLE}")
        return Result("hardening", name, FAIL, f"/etc/nftables.conf lacks table {TABLE}", FIX_DEPLOY)
    if not nft.table_loaded:
        return Result("hardening", name, FAIL, f"table {TABLE} is not loaded",
                      "systemctl restart nftables, or run deploys/all.py")
    return Result("hardening", name, PASS, f"table {TABLE} loaded")


@check("hardening")
def training_peers_let_in(ctx: Context) -> Result:
    """Which networks the host trusts for training (gpufleet/plans/cluster.py), and that the firewall
    the host boots and has loaded lets them in: every rule of theirs is in /etc/nftables.conf."""
    from gpufleet.plans import cluster

    name = "the firewall lets the training peers in"
    settings = ctx.settings
    said = cluster.training_networks(settings)
    if not settings.firewall_enabled:
        return Result("hardening", name, SKIP, said)
    if not settings.firewall_cluster_cidrs:
        if warning := cluster.missing_peers(settings):
            return Result("hardening", name, WARN, warning.partition("; set ")[0],
                          "set " + warning.partition("; set ")[2])
        why = cluster.multi_node(settings)
        return Result("hardening", name, PASS if why else SKIP,
                      said if why else f"tier {settings.tier} trains on one host (nccl_profile: "
                      f"{settings.nccl_profile}, no NVSwitch baseboard); {said}")
    conf = [line.strip() for line in ctx.fact(FileContents, path="/etc/nftables.conf") or []]
    missing = [rule["saddr"] + " " + rule["match"] for rule in cluster.rules(settings)
               if f'{rule["family"]} saddr {rule["saddr"]} {rule["match"]} accept comment "{rule["comment"]}"' not in conf]
    if missing:
        return Result("hardening", name, FAIL, f"/etc/nftables.conf does not let in {', '.join(missing)}", FIX_DEPLOY)
    nft = ctx.fact(NftablesCapability)
    if nft.can_load and not nft.table_loaded:
        return Result("hardening", name, FAIL, f"table {TABLE} is not loaded: {said}",
                      "systemctl restart nftables, or run deploys/all.py")
    return Result("hardening", name, PASS, said)


