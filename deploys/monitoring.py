"""Prometheus exporters: the host's own metrics, and its GPUs' through NVIDIA DCGM.

Story of a host, part 6 (after tuning, before hardening: the firewall then opens exactly the
ports of the exporters that are on, for the address they listen on; gpufleet/plans/monitoring.py):

1. node exporter (``monitoring_node_exporter``): Debian's ``prometheus-node-exporter``.
   /etc/default/prometheus-node-exporter (whose ARGS Debian's unit passes to the exporter) is
   written *before* the package is installed, so that its very first start already listens on
   ``monitoring_listen_address``:``monitoring_node_exporter_port``; enabled and running.
2. DCGM (``monitoring_dcgm_exporter``): NVIDIA's host engine, ``nvidia-dcgm.service`` of
   ``datacenter-gpu-manager-4-core``, which the driver step installs and holds with the driver
   (NVIDIA's CUDA repository; DCGM installation guide: "sudo systemctl --now enable
   nvidia-dcgm"), and NVIDIA's exporter as the CUDA repository packages it,
   ``datacenter-gpu-manager-exporter`` with its ``nvidia-dcgm-exporter.service`` (NVIDIA's
   "Install DCGM Exporter": a package-managed systemd service, an OCI container or a
   Kubernetes DaemonSet; gpufleet takes the package: no Docker needed, and apt keeps exporter
   and DCGM paired, which that guide asks for). The exporter is installed at exactly
   ``monitoring_dcgm_exporter_version`` and held (``driver_hold``). A drop-in sets its listen
   address (DCGM_EXPORTER_LISTEN) and points it at the running host engine
   (DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555) instead of a second, embedded one. Both services
   run only once nvidia-smi works (until then they are enabled for the next boot).

The validation gate curls each endpoint on the host (gpufleet/checks/validation.py, area monitoring).
What this needs from an earlier step, it takes from it: the CUDA repository source and DCGM
itself come from deploys/driver.py.
"""
from __future__ import annotations

from io import StringIO

from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.operations import apt, files, systemd

from gpufleet.explain import explained
from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.plans import monitoring as m
from gpufleet.config.hostfacts import gpu_state
from gpufleet.config.settings import Settings, host_settings
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.package_steps import packages_at_releases


def _node_exporter(settings: Settings) -> None:
    where = m.listen(settings, settings.monitoring_node_exporter_port)
    defaults = files.put(
        name=explained("Configure the node exporter", f"Make the node exporter listen on {where} (before its package starts it)"),
        src=StringIO(m.node_exporter_defaults(settings)),
        dest=m.NODE_EXPORTER_DEFAULTS,
        mode="644",
    )
    _packages(settings)
    systemd.service(
        name=explained("Start the node exporter", "Run the node exporter now and at every boot"),
        service=m.NODE_EXPORTER_SERVICE,
        running=True,
        enabled=True,
    )
    systemd.service(
        name=explained("Restart the node exporter", f"Restart the node exporter so that it listens on {where}"),
        service=m.NODE_EXPORTER_SERVICE,
        restarted=True,
        _if=defaults.did_change,
    )


def _packages(settings: Settings) -> None:
    apt.packages(
        name=explained("Install node exporter and curl" if settings.monitoring_node_exporter else "Install curl",
                       "Debian's Prometheus node exporter, where the tier has it, and curl: the validation gate "
                       "asks the exporters with it"),
        packages=[*([m.NODE_EXPORTER_PACKAGE] if settings.monitoring_node_exporter else []), "curl"],
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,  # the exporter's -collectors (smartmontools, apt and ipmi timers) are the operator's choice
    )


def _dcgm_exporter(settings: Settings) -> None:
    where = m.listen(settings, settings.monitoring_dcgm_exporter_port)
    dropin = files.put(
        name=explained("Configure the DCGM exporter", f"Make NVIDIA's DCGM exporter listen on {where} and read the running "
                                                      "DCGM host engine (a systemd drop-in)"),
        src=StringIO(m.dcgm_exporter_dropin(settings)),
        dest=m.DCGM_EXPORTER_DROPIN,
        mode="644",
    )
    packages_at_releases(
        name=explained(f"Install dcgm-exporter {settings.monitoring_dcgm_exporter_version}",
                       f"Install NVIDIA's DCGM exporter {settings.monitoring_dcgm_exporter_version}"
                       + (" and hold it (driver_hold)" if settings.driver_hold else "")),
        releases={m.DCGM_EXPORTER_PACKAGE: settings.monitoring_dcgm_exporter_version},
        hold=settings.driver_hold,
        # NVIDIA's repository, which offers it, may be added by the driver area earlier in this run
        settled=False, key="monitoring_dcgm_exporter_version",
    )
    reload_when(explained("Reload systemd: DCGM exporter", "Let systemd read the DCGM exporter's drop-in"), dropin)
    state = gpu_state(host)
    ready = state.ok and bool(state.gpus)
    if not ready:
        logger.warning(f"{host.print_prefix}nvidia-smi does not work ({state.status}): DCGM and its "
                       "exporter are enabled for the next boot but not started")
    for service, what in ((m.DCGM_SERVICE, "DCGM's host engine"), (m.DCGM_EXPORTER_SERVICE, "the DCGM exporter")):
        systemd.service(
            name=explained(f"Start {service}" if ready else f"Enable {service}",
                           f"Run {what} now and at every boot" if ready else
                           f"Start {what} at every boot (nvidia-smi does not work yet: not started now)"),
            service=service,
            running=True if ready else None,
            enabled=True,
        )
    if ready:
        systemd.service(
            name=explained("Restart the DCGM exporter", f"Restart the DCGM exporter so that it listens on {where}"),
            service=m.DCGM_EXPORTER_SERVICE,
            restarted=True,
            _if=dropin.did_change,
        )


@deploy("Monitoring")
def monitoring() -> None:
    settings = host_settings(host)
    if not m.exporters(settings):
        host.noop("no exporter is on for this host (monitoring_node_exporter, monitoring_dcgm_exporter)")
        return
    if settings.monitoring_node_exporter:
        _node_exporter(settings)
    else:
        _packages(settings)
    if settings.monitoring_dcgm_exporter:
        _dcgm_exporter(settings)


# `pyinfra INVENTORY deploys/monitoring.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
