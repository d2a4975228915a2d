"""Base system: the support packages every GPU host gets, and a record of what manages it.

Story of a host, part 1: before any GPU work, the host gets the diagnostics its tier asks for
(sysstat collecting every 10 minutes, numactl, pciutils...) and a small file saying that
gpufleet manages it and from which tier, so that anyone logged in can tell.
"""
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files, systemd

# Lowest layer of host data: tiers (gpufleet/data/tiers.yaml) and the inventory override these.
DEFAULTS = {
    # Packages every host gets, whatever its tier (diagnostics an operator reaches for first).
    "base_packages": ["sysstat", "numactl", "pciutils", "curl", "gnupg"],
    # Packages the tier adds on top (e.g. nvtop on desktops, infiniband-diags on hgx).
    "extra_packages": [],
    # Seconds an apt package index stays fresh before gpufleet refreshes it.
    "base_apt_cache_time": 86400,
}


def _marker(tier: str) -> StringIO:
    return StringIO(
        "# Managed by gpufleet (https://github.com/gpufleet). Do not edit: changes are reverted.\n"
        f"tier: {tier}\n"
    )


@deploy("Base system", data_defaults=DEFAULTS)
def base():
    packages = list(dict.fromkeys([*host.data.base_packages, *host.data.extra_packages]))
    apt.packages(
        name="Install the base and tier support packages",
        packages=packages,
        update=True,
        cache_time=host.data.base_apt_cache_time,
        no_recommends=True,
    )

    files.line(
        name="Let sysstat collect activity data",
        path="/etc/default/sysstat",
        line="^ENABLED=",
        replace='ENABLED="true"',
    )
    systemd.service(
        name="Run sysstat now and at every boot",
        service="sysstat.service",
        running=True,
        enabled=True,
    )

    files.directory(name="Keep gpufleet's host records in /etc/gpufleet", path="/etc/gpufleet")
    files.put(
        name="Record that gpufleet manages this host, and its tier",
        src=_marker(host.data.get("tier") or "none"),
        dest="/etc/gpufleet/managed",
        mode="644",
    )
