"""Every area runs on its own, as pyinfra users run one area at a time:

    pyinfra inventories/cloud.py deploys/tuning.py     # or preflight, base, driver, docker, hardening, validate

Each deploy file ends with `run_alone(__name__, __file__)`. When pyinfra executes that file
itself (not when deploys/all.py imports it), the area is run the way all.py runs it: the whole
inventory is validated first (a bad host stops the run before any host changes), the host's
hardware is checked against its tier (deploys/preflight.py: a mismatch warns, or with
`tier_mismatch: fail` refuses the host), and then the area alone, with all.py's fact cache and
host lock. What an area needs from an earlier one it checks itself at planning time (the driver
refuses a host without a supported GPU, tuning leaves clocks alone until nvidia-smi works).
The validation gate changes nothing, so it runs without the preflight and the lock. Before
any other area, needrestart (where installed: Ubuntu 22.04+) is told never to prompt nor
restart services during apt (operations/needrestart.py quiet_needrestart), as all.py's base does first.

pyinfra executes a deploy file with exec(), once per host, as a module with no `__name__` of
its own: the area's function is called from the imported module `gpufleet.deploys.<area>`, the same
one all.py calls, so module state (hosts needing a reboot, pending upgrades) has one home.

`pyinfra INVENTORY gpufleet.deploys.tuning.tuning` (pyinfra calling the area's function by its
import name) would run the area without the inventory check, the preflight and the host lock:
it is refused before any host is planned, naming the deploy file to run instead.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from pyinfra import host, state

from gpufleet.config.failures import host_failed
from gpufleet.config.settings import validate_inventory

#: Areas that change nothing: no preflight before them, no host lock.
READ_ONLY = frozenset({"validate"})


def is_deploy_file(name: str, file: str) -> bool:
    """Whether the code calling with its `__name__` and `__file__` is the file pyinfra runs."""
    from pyinfra.context import ctx_state

    if name.startswith("gpufleet.deploys.") or not ctx_state.isset():
        return False  # imported (by all.py, a tool, a test), or no pyinfra run at all
    current = state.current_exec_filename
    if not current:
        return False
    return Path(current).resolve() == Path(file).resolve()


def called_by_import_name(name: str, argv: list[str]) -> bool:
    """Whether the `pyinfra` command line names this module's function (`gpufleet.deploys.tuning.tuning`
    or `gpufleet.deploys.tuning:tuning`) as what to run, which imports the module with no deploy
    file running."""
    from pyinfra.context import ctx_state

    if not name.startswith("gpufleet.deploys.") or ctx_state.isset() and state.current_exec_filename:
        return False
    return any(arg.startswith((f"{name}.", f"{name}:")) for arg in argv[1:])


def refuse_import_name(name: str, file: str) -> None:
    area = Path(file).stem
    sys.stderr.write(
        f"gpufleet: run the {area} area as its deploy file, not as the function {name}.{area}: called so,\n"
        "  pyinfra would skip the inventory check, the hardware preflight and the host lock.\n"
        f"  Run: gpufleet-deploy INVENTORY {area}   (or: pyinfra INVENTORY {file})\n")
    raise SystemExit(2)


def run_alone(name: str, file: str) -> None:
    """Run the area of deploys/<area>.py for the current host, when pyinfra runs that file."""
    if called_by_import_name(name, sys.argv):
        refuse_import_name(name, file)
    if not is_deploy_file(name, file):
        return
    area = Path(file).stem
    module = importlib.import_module(f"gpufleet.deploys.{area}")
    from gpufleet.controller import askpass

    askpass.install()  # read-only areas too: sudo's password never on the host's command line
    if area not in READ_ONLY:
        from gpufleet.controller import factcache
        from gpufleet.controller import hostlock
        from gpufleet.controller import staging

        factcache.install()  # as in all.py: no fact asked twice while nothing changed
        hostlock.install()  # one run at a time changes a host
        staging.install()  # sudo uploads stage in a private folder
        factcache.prefetch_all(state)
    # pyinfra plans every host before it executes anything: a bad host stops the whole run here.
    validate_inventory(state.inventory)
    if area not in READ_ONLY and area != "preflight":
        from gpufleet.deploys.preflight import preflight

        preflight()
    if not host_failed(host):
        if area not in READ_ONLY and area != "preflight":
            # every area but the checks may run apt (the driver, docker, tuning, monitoring...):
            # needrestart (Ubuntu 22.04+) is told never to prompt nor restart first, as base
            # and hardening do in all.py; planned once per host, a no-op once the file is right
            from gpufleet.operations.needrestart import quiet_needrestart

            quiet_needrestart()
        getattr(module, area)()
