"""Read every host of an inventory at once through pyinfra's own API, read-only: the fleet
report (gpufleet/apps/report/gather.py) and the health check (gpufleet/apps/health.py) share it.

The inventory is loaded as the pyinfra command line loads it (--limit, --data, config.py), every
host is connected in its own greenlet (up to `workers` at once) and read as soon as it is, so a
slow or dead host never holds up the others: one that cannot be reached is a row saying so, one
whose reading fails is a row with the error. No host is ever left out.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufleet.controller.inventory_source import InventorySource

Row = dict[str, Any]


@dataclass
class Fleet:
    state: Any
    config: Any
    hosts: list[Any]


@contextmanager
def connected_fleet(source: InventorySource, workers: int, cwd: Path, prefetch: bool = True) -> Iterator[Fleet]:
    """pyinfra's State for the inventory's hosts, ready to connect them; disconnected at the end.
    `prefetch`: answer the facts a host asked in its last run in one command (gpufleet/controller/factcache.py);
    off for a reader of one fact, which would pay for the whole plan and replace it with its own."""
    from gevent import monkey

    monkey.patch_all()
    import gevent
    from pyinfra.api import State
    from pyinfra.api.state import StateStage
    from pyinfra.context import ctx_config, ctx_inventory, ctx_state

    from gpufleet.controller import askpass

    from gpufleet.controller import factcache

    askpass.install()  # sudo's password through a private file on the host, never a command line
    if prefetch:
        # The facts each host answered in its last run come back in one command per host
        factcache.install()
    inventory = source.load()
    hosts = source.hosts(inventory)
    state = State(check_for_changes=True)
    state.cwd = str(cwd)
    ctx_state.set(state)
    ctx_inventory.set(inventory)
    config = source.config()
    config.PARALLEL, config.FAIL_PERCENT = max(1, workers), None
    ctx_config.set(config)
    state.init(inventory, config, initial_limit=hosts)
    state.set_stage(StateStage.Connect)
    try:
        yield Fleet(state, config, hosts)
    finally:
        for host in hosts:
            if host.connected:
                gevent.spawn(host.disconnect).join(timeout=5)


def read_each(fleet: Fleet, read: Callable[[Any], Row], workers: int,
              progress: Callable[[str, str, float], None] | None = None) -> dict[str, Row]:
    """{host name: row}: `read(host)` of each connected host (facts in its context), or a row
    with status unreachable / error and the reason. `progress(name, status, seconds)`."""
    from gevent.pool import Pool
    from pyinfra.api.exceptions import ConnectError
    from pyinfra.api.state import StateStage
    from pyinfra.context import ctx_config, ctx_host

    rows: dict[str, Row] = {}
    report = progress or (lambda *a: None)

    def collect(host: Any) -> None:
        start = time.monotonic()
        base = {"host": host.name, "address": str(host.data.get("ssh_hostname") or host.name)}
        try:
            host.connect(show_errors=False, raise_exceptions=True)
        except ConnectError as error:
            rows[host.name] = {**base, "status": "unreachable", "state": "unreachable",
                               "error": str(error) or type(error).__name__,
                               "tier": host.data.get("tier"), "seconds": round(time.monotonic() - start, 2)}
            report(host.name, "unreachable", time.monotonic() - start)
            return
        fleet.state.activate_host(host)
        try:
            with ctx_config.use(fleet.config.copy()), ctx_host.use(host):
                row = read(host)
        except Exception as error:  # noqa: BLE001 - a broken host is a row, not a crash
            row = {"status": "error", "state": "error", "error": f"{type(error).__name__}: {error}"}
        rows[host.name] = {**base, **row, "seconds": round(time.monotonic() - start, 2)}
        report(host.name, str(rows[host.name].get("state") or rows[host.name]["status"]), time.monotonic() - start)

    fleet.state.set_stage(StateStage.Prepare)
    pool = Pool(max(1, workers))
    for host in fleet.hosts:
        pool.spawn(collect, host)
    pool.join()
    return rows
