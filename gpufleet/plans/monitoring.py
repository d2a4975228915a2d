"""The Prometheus exporters a host's tier turns on, where they listen, and who may reach them.

One source for deploys/monitoring.py (what it installs and how it binds), deploys/hardening.py
(the firewall opens an exporter's port only while it is on, only for the address it listens
on, and only to the scrapers' networks), the validation gate (the endpoint it curls on the host) and the fleet report
(the endpoints it lists). Pure: settings in, values out.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

#: Debian's package, service and the file its unit reads ARGS from (EnvironmentFile).
NODE_EXPORTER_PACKAGE = "prometheus-node-exporter"
NODE_EXPORTER_SERVICE = "prometheus-node-exporter.service"
NODE_EXPORTER_DEFAULTS = "/etc/default/prometheus-node-exporter"
#: NVIDIA's DCGM host engine (datacenter-gpu-manager-4-core) and exporter (CUDA repository).
DCGM_SERVICE = "nvidia-dcgm.service"
DCGM_EXPORTER_PACKAGE = "datacenter-gpu-manager-exporter"
DCGM_EXPORTER_SERVICE = "nvidia-dcgm-exporter.service"
DCGM_EXPORTER_DROPIN = "/etc/systemd/system/nvidia-dcgm-exporter.service.d/gpufleet.conf"
#: nv-hostengine's default port: the exporter reads the running host engine, never embeds a second one
HOSTENGINE = "localhost:5555"


@dataclass(frozen=True)
class Exporter:
    key: str  # the monitoring_ key that turns it on
    label: str  # what people call it
    service: str
    port: int
    family: str  # a metric name prefix every healthy exporter serves
    sample: str  # the metric whose lines the gate reads (one per GPU for DCGM)


def exporters(settings: Settings) -> list[Exporter]:
    """The exporters the host's settings turn on, node exporter first."""
    out = []
    if settings.monitoring_node_exporter:
        out.append(Exporter("monitoring_node_exporter", "node exporter", NODE_EXPORTER_SERVICE,
                            settings.monitoring_node_exporter_port, "node_", "node_boot_time_seconds"))
    if settings.monitoring_dcgm_exporter:
        out.append(Exporter("monitoring_dcgm_exporter", "DCGM exporter", DCGM_EXPORTER_SERVICE,
                            settings.monitoring_dcgm_exporter_port, "DCGM_FI_", "DCGM_FI_DEV_GPU_TEMP"))
    return out


def _address(settings: Settings) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    listen = settings.monitoring_listen_address
    return None if listen == "all" else ipaddress.ip_address(listen)


def local_only(settings: Settings) -> bool:
    """Listening on a loopback address: reachable from the host alone (the firewall accepts `lo`)."""
    address = _address(settings)
    return address is not None and address.is_loopback


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(settings: Settings, port: int) -> str:
    """The exporters' listen address flag value: ':9100' (every address) or '10.0.0.5:9100'."""
    address = _address(settings)
    return f":{port}" if address is None else _hostport(str(address), port)


def local_url(settings: Settings, exporter: Exporter) -> str:
    """The URL the validation gate curls on the host itself."""
    address = _address(settings)
    return f"http://{_hostport(str(address) if address else '127.0.0.1', exporter.port)}/metrics"


def public_url(settings: Settings, exporter: Exporter, host_address: str) -> str:
    """The URL Prometheus scrapes (the fleet report lists it): the bound address, else the host's."""
    address = _address(settings)
    return f"http://{_hostport(str(address) if address else host_address, exporter.port)}/metrics"


def firewall_rules(settings: Settings) -> list[dict[str, str]]:
    """nftables rules for the exporters: each port open while its exporter is on, only for the
    address it listens on (none when it listens on loopback alone: `lo` is accepted), and only
    from the scrapers of monitoring_allowed_cidrs (none by default: on a shared host the
    metrics, GPU processes' names among them, are not for every network the host is on; the
    host itself and firewall_trusted_cidrs reach every port anyway). One rule per exporter and
    network, of the listen address's family when it has one."""
    if local_only(settings):
        return []
    address = _address(settings)
    # a v6 scraper cannot reach a v4-only listener (nor one rule match both families)
    networks = [n for n in (ipaddress.ip_network(c, strict=False) for c in settings.monitoring_allowed_cidrs)
                if address is None or n.version == address.version]
    return [{"port": str(e.port), "proto": "tcp", "comment": e.label, "saddr": str(network),
             "daddr": str(address) if address is not None else ""}
            for e in exporters(settings) for network in networks]


def node_exporter_defaults(settings: Settings) -> str:
    """/etc/default/prometheus-node-exporter: Debian's unit passes $ARGS to the exporter."""
    return ("# Managed by gpufleet (deploys/monitoring.py). Do not edit: changes are reverted.\n"
            "# Set by monitoring_listen_address and monitoring_node_exporter_port (tiers.yaml).\n"
            f'ARGS="--web.listen-address={listen(settings, settings.monitoring_node_exporter_port)}"\n')


def dcgm_exporter_dropin(settings: Settings) -> str:
    """A drop-in for NVIDIA's packaged unit: the listen address, and the running host engine."""
    return ("# Managed by gpufleet (deploys/monitoring.py). Do not edit: changes are reverted.\n"
            "# dcgm-exporter reads these variables for --address and --remote-hostengine-info.\n"
            "[Unit]\n"
            f"Wants={DCGM_SERVICE}\n"
            f"After={DCGM_SERVICE}\n\n"
            "[Service]\n"
            f"Environment=DCGM_EXPORTER_LISTEN={listen(settings, settings.monitoring_dcgm_exporter_port)}\n"
            f"Environment=DCGM_REMOTE_HOSTENGINE_INFO={HOSTENGINE}\n")
