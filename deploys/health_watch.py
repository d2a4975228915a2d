"""The node's own health watch (health_watch; issue 45, docs/health.md).

Story of a host, part 9 (after monitoring, whose node exporter serves the watch's metrics;
before hardening): tools/health's check, run on the node by a systemd timer every
health_interval and, where the tier asks, as Slurm's HealthCheckProgram and Prolog. The node
needs no controller: gpufleet's own modules for it (facts/health.py, gpufleet/plans/health.py,
gpufleet/plans/health_watch.py, gpufleet/apps/health_node.py and health.yaml) are written as one
zip, run by the system's python3. Its journal, reset record and config live in root's 0700
folder /var/lib/gpufleet-health; gpufleet/plans/health_watch.py holds what it does each run.
"""
from __future__ import annotations

import io
import json
import zipfile
from importlib import resources
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd

from gpufleet import yamlload
from gpufleet.config.settings import host_settings
from gpufleet.explain import explained
from gpufleet.operations.daemon_reload import reload_when
from gpufleet.operations.drain import GPU_WORK_ON
from gpufleet.plans import health_watch as w

#: gpufleet modules the node runs, as (path in the package, path in the zip)
_MODULES = ("__init__.py", "plans/__init__.py", "plans/health.py", "plans/health_watch.py", "apps/__init__.py",
            "apps/health_node.py", "yamlload.py", "facts/__init__.py", "facts/_common.py", "facts/health.py",
            "facts/slurm.py", "facts/dcgm_diag.py", "facts/network.py")
#: the few names of pyinfra, typing_extensions and PyYAML those modules import, stood in for on
#: the node (which runs the facts' commands itself, and reads health.yaml as the JSON it is shipped as)
_STANDINS = {
    "pyinfra/__init__.py": '"""Stand-in (gpufleet health watch): the node runs no pyinfra."""\n',
    "pyinfra/api/__init__.py": (
        '"""Stand-in for the pyinfra names gpufleet\'s facts import (their commands run on the node itself)."""\n'
        "from typing import Any, Generic, TypeVar\n\nT = TypeVar('T')\n\n\n"
        "class FactBase(Generic[T]):\n    pass\n\n\n"
        "class QuoteString:\n    def __init__(self, obj: Any) -> None:\n        self.obj = obj\n\n\n"
        "class StringCommand:\n    def __init__(self, *bits: Any) -> None:\n        self.bits = bits\n"),
    "pyinfra/api/exceptions.py": "class FactProcessError(Exception):\n    pass\n",
    "typing_extensions.py": "def override(f):\n    return f\n",
    "yaml.py": ('"""Stand-in: health.yaml is shipped as JSON, which is YAML."""\nimport json\n\n\n'
                "class SafeLoader:\n    pass\n\n\n"
                "def load(stream, Loader=None):\n    return json.loads(stream)\n"),
    "__main__.py": "import sys\n\nfrom gpufleet.apps.health_node import main\n\nsys.exit(main())\n",
}


def bundle() -> bytes:
    """The zip, byte-identical for the same gpufleet (fixed times, sorted): a second run uploads nothing."""
    entries = {}
    for path in _MODULES:
        package, _, name = f"gpufleet/{path}".rpartition("/")
        entries[f"gpufleet/{path}"] = resources.files(package.replace("/", ".")).joinpath(name).read_bytes()
    rules = yamlload.safe_load(resources.files("gpufleet").joinpath("data/health.yaml").read_text(encoding="utf-8"))
    entries["gpufleet/data/__init__.py"] = b""
    entries["gpufleet/data/health.yaml"] = json.dumps(rules, sort_keys=True).encode()
    entries.update({path: text.encode() for path, text in _STANDINS.items()})
    entries["gpufleet/data/health-reset.sh"] = w.reset_script(GPU_WORK_ON).encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path in sorted(entries):
            info = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, entries[path])
    return out.getvalue()


def _slurm(plan: w.WatchPlan) -> None:
    lines = w.slurm_lines(plan)
    if not host.get_fact(File, path=w.SLURM_CONF):
        if plan.slurm_check or plan.slurm_prolog:
            host.noop(f"no {w.SLURM_CONF}: not a Slurm node, the timer alone runs the watch")
        return
    changed = []
    for key, line in lines.items():
        if line is not None:
            changed.append(files.line(name=explained(f"Set {key} in slurm.conf", f"{line}: Slurm runs the watch"), path=w.SLURM_CONF,
                                      line=f"^{key}=.*$", replace=line, present=True))
        elif key in ("HealthCheckProgram", "Prolog"):
            # only the watch's own line: a site's health check or prolog stays
            changed.append(files.line(name=explained(f"Remove the watch's {key}", f"health_watch off: out of {w.SLURM_CONF}; a site's own line stays"), path=w.SLURM_CONF,
                                      line=f"^{key}={w.COMMAND}$", present=False))
    systemd.service(name=explained("Restart slurmd", "so that it reads its health check and prolog (running jobs stay)"),
                    service="slurmd.service", restarted=True,
                    _if=lambda: any(op.did_change() for op in changed))


@deploy("Health watch")
def health_watch() -> None:
    settings = host_settings(host)
    plan = w.watch_plan(settings)
    if not plan.enabled:
        if host.get_fact(File, path=f"{w.UNIT_DIR}/{w.TIMER}"):
            systemd.service(name=explained("Stop the health watch", "health_watch: false: its timer is stopped and disabled"), service=w.TIMER,
                            running=False, enabled=False)
        _slurm(plan)
        return
    files.directory(name=explained("Make the watch's folder", f"{w.WATCH_DIR}: root's, 0700 (its journal is root's alone)"), path=w.WATCH_DIR,
                    user="root", group="root", mode="700")
    files.directory(name=explained("Make the watch's code folder", f"{w.BUNDLE_DIR}, for the zip the node runs"), path=w.BUNDLE_DIR, user="root", group="root", mode="755")
    code = files.put(name=explained("Install the watch's code", "gpufleet's health modules, one zip: the node needs no controller"), src=io.BytesIO(bundle()),
                     dest=w.BUNDLE, user="root", group="root", mode="644")
    files.put(name=explained("Install gpufleet-health-watch", f"{w.COMMAND}: the timer's, Slurm's and an admin's command"), src=StringIO(w.wrapper()), dest=w.COMMAND, user="root", group="root",
              mode="755")
    files.put(name=explained("Write the watch's settings", f"{w.CONFIG}: the tier's health_ keys, 0600"), src=StringIO(plan.node_config()), dest=w.CONFIG,
              user="root", group="root", mode="600")
    service = files.put(name=explained("Install the watch's service", f"{w.SERVICE}: one run of the check"), src=StringIO(w.service_unit()),
                        dest=f"{w.UNIT_DIR}/{w.SERVICE}", user="root", group="root", mode="644")
    timer = files.put(name=explained("Install the watch's timer", f"{w.TIMER}: every {plan.interval} s (health_interval)"), src=StringIO(w.timer_unit(plan)),
                      dest=f"{w.UNIT_DIR}/{w.TIMER}", user="root", group="root", mode="644")
    reload_when(explained("Reload systemd: health watch", "Let systemd read the watch's units"), service, timer)
    systemd.service(name=explained("Start the watch's timer", "now and at every boot"), service=w.TIMER,
                    running=True, enabled=True)
    systemd.service(name=explained("Restart the watch's timer", "its interval or its code changed"), service=w.TIMER,
                    restarted=True, _if=lambda: timer.did_change() or code.did_change())
    _slurm(plan)


# `pyinfra INVENTORY deploys/health_watch.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
