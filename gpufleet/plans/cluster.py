"""Training across hosts through the firewall: which networks a host trusts for training.

A multi-node job (`torchrun --nnodes=N --rdzv_endpoint=MASTER:29500 train.py`) needs, between
its hosts: torchrun's rendezvous (TCP 29500 by default, any port `--rdzv_endpoint` names), the
c10d/gloo store and NCCL's bootstrap and socket transport (TCP on ephemeral ports NCCL picks at
run time), and on RoCE fabrics the RDMA traffic itself. So from firewall_cluster_cidrs every TCP
port is open, plus RoCEv2 (UDP 4791) on the ib/roce profiles; from anywhere else only the tier's
listed ports. InfiniBand verbs and hardware RoCE bypass the host's IP stack (the HCA moves the
data), so the firewall never sees them; the UDP rule is for what does pass through it (Soft-RoCE,
rdma_rxe) and says the fabric is expected.

One plan, read by the firewall template (deploys/hardening.py), the plan view (deploys/plan.py)
and the validation gate (gpufleet/checks/validation.py), so the three say the same.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

#: NCCL profiles that carry collectives between hosts over a fabric (compat.yaml nccl_profiles)
FABRIC_PROFILES = ("ib", "roce", "efa")
#: profiles whose RDMA traffic is IP-routable and reaches the host's stack (RoCEv2; Soft-RoCE)
RDMA_PROFILES = ("ib", "roce")
#: RoCEv2's UDP destination port (IANA "roce", InfiniBand Architecture Specification Annex A17)
ROCEV2_PORT = 4791
#: torchrun's default rendezvous port (torch.distributed.run --rdzv_endpoint / --master_port)
RENDEZVOUS_PORT = 29500
COMMENT = "training peers (firewall_cluster_cidrs)"


def multi_node(settings: Settings) -> str | None:
    """Why this host's tier trains across hosts (None: it does not): NCCL over a fabric, or an
    NVSwitch baseboard (HGX: built to be one node of a pod, even where the fabric is TCP)."""
    if settings.nccl_profile in FABRIC_PROFILES:
        return f"nccl_profile: {settings.nccl_profile}"
    if settings.validate_nvswitch == "required":
        return "validate_nvswitch: required (an HGX baseboard)"
    return None


def rules(settings: Settings) -> list[dict[str, str]]:
    """The firewall rules for the training peers: [{family, saddr, match, published, comment}],
    one TCP rule per network, and one RoCEv2 rule per network on the RDMA profiles (`match` for
    the host's own ports, `published` for containers' ports, matched on the port sent to)."""
    out = []
    for cidr in settings.firewall_cluster_cidrs:
        family = "ip6" if ":" in cidr else "ip"
        out.append({"family": family, "saddr": cidr, "match": "meta l4proto tcp", "published": "meta l4proto tcp",
                    "comment": COMMENT + ": all TCP"})
        if settings.nccl_profile in RDMA_PROFILES:
            out.append({"family": family, "saddr": cidr, "match": f"udp dport {ROCEV2_PORT}",
                        "published": f"meta l4proto udp ct original proto-dst {ROCEV2_PORT}",
                        "comment": COMMENT + ": RoCEv2"})
    return out


def what_peers_reach(settings: Settings) -> str:
    rdma = f", RoCEv2 ({ROCEV2_PORT}/udp)" if settings.nccl_profile in RDMA_PROFILES else ""
    return f"all TCP (torchrun's rendezvous, {RENDEZVOUS_PORT} by default, and NCCL's ephemeral ports){rdma}"


def training_networks(settings: Settings) -> str:
    """One line: which networks this host trusts for training, and with what."""
    if not settings.firewall_enabled:
        return "every network (firewall_enabled: false)"
    parts = []
    if settings.firewall_cluster_cidrs:
        parts.append(", ".join(settings.firewall_cluster_cidrs) + f" (firewall_cluster_cidrs): {what_peers_reach(settings)}")
    if settings.firewall_trusted_cidrs:
        parts.append(", ".join(settings.firewall_trusted_cidrs) + " (firewall_trusted_cidrs): every port")
    return "; ".join(parts) or "none: training peers reach only the tier's open ports (firewall_open_ports)"


def missing_peers(settings: Settings) -> str | None:
    """The planning-time warning for a multi-node tier whose firewall lets no training peer in."""
    why = multi_node(settings)
    if not settings.firewall_enabled or why is None or settings.firewall_cluster_cidrs or settings.firewall_trusted_cidrs:
        return None
    return (f"tier {settings.tier} trains across hosts ({why}) but firewall_cluster_cidrs is empty: the firewall "
            f"drops torchrun's rendezvous ({RENDEZVOUS_PORT}/tcp) and NCCL's connections between hosts; set "
            "firewall_cluster_cidrs to the training peers' networks (e.g. [\"10.10.0.0/16\"])")
