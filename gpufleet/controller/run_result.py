"""Which hosts a run of deploys/all.py left converged, for gpufleet-deploy (gpufleet/apps/deploy.py),
which runs pyinfra as a child and then accepts the new hosts among them (gpufleet/apps/new_hosts.py).

gpufleet-deploy names a file in a private folder of its own in GPUFLEET_DEPLOY_RESULTS; at the
run's end (gpufleet/controller/run_end.py) this writes there, 0600, `{"hosts": {name: "ok" |
"failed"}}` for every host the run connected to. A host that is not there was not reached. A
bare `pyinfra INVENTORY deploys/all.py` sets no such variable: nothing is written.
"""
from __future__ import annotations

import json
import os
from typing import Any

from gpufleet.controller import controller_files
from gpufleet.controller.run_end import at_run_end

ENV = "GPUFLEET_DEPLOY_RESULTS"
#: set by gpufleet-deploy when it accepts the converged hosts after the run (the end-of-run
#: summary then says so instead of naming the command)
ACCEPTS_NEXT = "GPUFLEET_DEPLOY_ACCEPTS"


def install(state: Any) -> None:
    if os.environ.get(ENV, "").startswith("/"):
        at_run_end(state, write)


def results(state: Any) -> dict[str, str]:
    """{host name: "ok" | "failed"} of the hosts the run connected to."""
    return {h.name: "ok" if h in state.active_hosts and h not in state.failed_hosts else "failed"
            for h in state.activated_hosts}


def write(state: Any) -> None:
    controller_files.write(os.environ[ENV], json.dumps({"hosts": results(state)}, sort_keys=True))


def read(path: str) -> dict[str, str]:
    """What write() left ({}: nothing, the run ended before its hosts did)."""
    try:
        found = json.loads(controller_files.read(path))
    except (OSError, ValueError):
        return {}
    hosts = found.get("hosts") if isinstance(found, dict) else None
    return {str(k): str(v) for k, v in hosts.items()} if isinstance(hosts, dict) else {}
