"""Base system: the diagnostics every GPU host gets, and a record of what manages it.

Story of a host, part 1: before any GPU work, the host gets the diagnostics its tier asks for
(`extra_packages`: sysstat collecting activity data, nvtop, numactl, pciutils...) and a small
file saying that gpufleet manages it and from which tier, so anyone logged in can tell.
Settings: gpufleet/data/tiers.yaml (`extra_packages`).
"""
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files, systemd

from gpufleet.explain import explained
from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.operations.needrestart import quiet_needrestart
from gpufleet.config.settings import host_settings
from gpufleet.plans.base import MARKER_PATH, plan_base


@deploy("Base system")
def base() -> None:
    plan = plan_base(host_settings(host))
    quiet_needrestart()
    apt.packages(
        name=explained("Install the tier's diagnostics packages",
                       "The tier's extra_packages (sysstat, nvtop, numactl, pciutils...), no recommends"),
        packages=list(plan.packages),
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,
    )
    if plan.sysstat:
        files.line(
            name=explained("Let sysstat collect activity data", "ENABLED=\"true\" in /etc/default/sysstat"),
            path="/etc/default/sysstat",
            line="^ENABLED=",
            replace='ENABLED="true"',
        )
        systemd.service(
            name=explained("Run sysstat now and at every boot", "sysstat.service running and enabled"),
            service="sysstat.service",
            running=True,
            enabled=True,
        )
    files.directory(name=explained("Keep gpufleet's host records in /etc/gpufleet",
                                       "The folder of gpufleet's records on the host (marker, scratch UUID, MIG and clocks)"), path="/etc/gpufleet")
    files.put(
        name=explained("Record that gpufleet manages this host, and its tier",
                       "/etc/gpufleet/managed: anyone logged in can tell what manages the host, from which tier"),
        src=StringIO(plan.marker),
        dest=MARKER_PATH,
        mode="644",
    )


# `pyinfra INVENTORY deploys/base.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
