"""Base system: the diagnostics every GPU host gets, and a record of what manages it.

Story of a host, part 1: before any GPU work, the host gets the diagnostics its tier asks for
(`extra_packages`: sysstat collecting activity data, nvtop, numactl, pciutils...) and a small
file saying that gpufleet manages it and from which tier, so anyone logged in can tell.
Settings: gpufleet/data/tiers.yaml (`extra_packages`).
"""
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.files import Directory
from pyinfra.operations import apt, files, systemd

from gpufleet.hostcontext import host_context
from gpufleet.settings import host_settings
from gpufleet.tiers import managed_marker

# An apt index younger than this is fresh enough: no `apt-get update` on re-runs.
APT_CACHE_SECONDS = 86400


# needrestart (installed on Ubuntu 22.04+ servers) runs after every apt install. Left alone it
# asks which services to restart, or under a non-interactive frontend restarts them by itself:
# docker/containerd, nvidia-persistenced, nvidia-fabricmanager or slurmd restarted behind a
# running job is what gpufleet's gate exists to prevent. 'l' only lists them (the operator sees
# them in the apt output); kernel hints go to stderr instead of waiting for an acknowledgement
# (-1), microcode hints are off (0). Options as documented in needrestart's own
# ex/needrestart/needrestart.conf (github.com/liske/needrestart), which reads conf.d/*.conf last.
NEEDRESTART_CONF = "/etc/needrestart/conf.d/50-gpufleet.conf"
NEEDRESTART_TEXT = (
    "# Managed by gpufleet (deploys/base.py). Do not edit: changes are reverted.\n"
    "# Never restart services nor wait for an answer during apt: restarts that can interrupt\n"
    "# GPU work go through gpufleet's gate.\n"
    "$nrconf{restart} = 'l';\n"
    "$nrconf{kernelhints} = -1;\n"
    "$nrconf{ucodehints} = 0;\n"
)


def quiet_needrestart() -> None:
    """Before the first apt install of an area: needrestart never prompts nor restarts
    anything, on hosts that have it (/etc/needrestart); elsewhere nothing to do. Planned once
    per host and run (the first area that asks: base in all.py, standalone.py before any area
    run alone), so that no apt-using area runs apt before the file is there."""
    context = host_context(host)
    if context.needrestart_planned:
        return
    context.needrestart_planned = True
    if host.get_fact(Directory, path="/etc/needrestart"):
        files.put(
            name="Let needrestart list services to restart after apt, never restart them or wait for an answer",
            src=StringIO(NEEDRESTART_TEXT),
            dest=NEEDRESTART_CONF,
            mode="644",
        )


@deploy("Base system")
def base():
    settings = host_settings(host)
    quiet_needrestart()
    apt.packages(
        name="Install the tier's diagnostics packages",
        packages=list(settings.extra_packages),
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,
    )
    if "sysstat" in settings.extra_packages:
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
        src=StringIO(managed_marker(settings.tier)),
        dest="/etc/gpufleet/managed",
        mode="644",
    )


# `pyinfra INVENTORY deploys/base.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
