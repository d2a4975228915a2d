"""needrestart kept quiet during gpufleet's apt runs: planned once per host and run, by the
first area that uses apt (base in all.py; deploys/standalone.py before any area run alone)."""
from __future__ import annotations

from io import StringIO

from pyinfra import host
from pyinfra.facts.files import Directory
from pyinfra.operations import files

from gpufleet.explain import explained
from gpufleet.config.hostcontext import host_context

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
            name=explained("Quiet needrestart", "Let needrestart list services to restart after apt, never restart them or "
                                                "wait for an answer"),
            src=StringIO(NEEDRESTART_TEXT),
            dest=NEEDRESTART_CONF,
            mode="644",
        )
