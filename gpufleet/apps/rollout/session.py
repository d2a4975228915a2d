"""Run one step (a deploy function) on some hosts of an inventory through pyinfra's Python API,
and say, per host, whether it worked and why not.

Why the API and not the CLI: a rollout is a sequence of steps whose inputs depend on what the
previous step did (after a wait, after a reboot), per host and per batch. With the API each step
is one pyinfra run (fresh inventory, fresh facts) over exactly the hosts still in play, and the
result per host comes from pyinfra itself (`state.failed_hosts`, the failing operation and its
output) instead of being parsed back from CLI output. The inventory is loaded exactly as the CLI
loads it (pyinfra_cli.inventory.make_inventory), so group data and files behave the same.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pyinfra_cli  # noqa: F401  (gevent monkey-patching, as the CLI does, before pyinfra.api)
from pyinfra import host as current_host
from pyinfra.api import State
from pyinfra.api.host import Host
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.deploy import add_deploy
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.operations import run_ops
from pyinfra.api.state import BaseStateCallback
from gpufleet.controller import inventory_source
from gpufleet.config.failures import refuse

from gpufleet.rollout.context import real_host

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class StepResult:
    ok: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)   # host -> reason
    changed: dict[str, int] = field(default_factory=dict)  # host -> operations that changed something


class _Errors(BaseStateCallback):
    def __init__(self) -> None:
        self.ops: dict[str, str] = {}

    # pyinfra declares its hooks static but calls them on the handler object: an instance method
    # keeps this run's errors on this handler
    def operation_host_error(self, state: State, host: Host, op_hash: Any,  # type: ignore[override]
                             retry_count: int = 0, max_retries: int = 0) -> None:
        names = state.get_op_meta(op_hash).names
        self.ops[host.name] = ", ".join(sorted(names))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(_ANSI.sub("", record.getMessage()))
        except Exception:  # a log line we cannot format is not worth failing a rollout for
            pass


def load_inventory(inventory_path: inventory_source.InventorySource | str) -> Any:
    """The inventory as `pyinfra INVENTORY ...` loads it, with the command line's --data when
    given an InventorySource (gpufleet/controller/inventory_source.py)."""
    return inventory_source.load_inventory(inventory_path)


def inventory_hosts(inventory_path: inventory_source.InventorySource | str) -> list[str]:
    """Host names of the inventory (those its --limit selects), in inventory order."""
    return inventory_source.limited_names(inventory_path)


def run_step(inventory_path: inventory_source.InventorySource | str, names: list[str], func: Callable[..., None], *args: Any,
             reasons: dict[str, str] | None = None, parallel: int | None = None) -> StepResult:
    """Run `func(*args)` as a deploy on the hosts `names`; return who succeeded and who failed.

    `reasons` is where the step's own refusals are written (RolloutContext.reasons)."""
    result = StepResult()
    if not names:
        return result
    inventory = load_inventory(inventory_path)
    limit = [h for h in inventory if h.name in names]
    config = inventory_source.config_of(inventory_path)   # config.py, as the pyinfra CLI applies it
    if parallel:
        config.PARALLEL = parallel
    state = State(inventory, config, initial_limit=limit)
    errors = _Errors()
    state.add_callback_handler(errors)
    collect = _Collect()
    log = logging.getLogger("pyinfra")
    log.addHandler(collect)
    reasons = reasons if reasons is not None else {}
    try:
        try:
            connect_all(state)

            def guarded(*a: Any) -> None:
                try:
                    func(*a)
                except PyinfraError:
                    raise
                except Exception as exc:  # a bug or a bad fact fails this host, not the rollout
                    real = real_host(current_host)
                    reason = f"{type(exc).__name__}: {exc}"
                    fix = ("an error planning this host (a bug, or a fact the host answered unexpectedly): "
                           "run with -v for the traceback, fix the host or report it, and re-run")
                    reasons[real.name] = f"{reason}. Fix: {fix}"
                    refuse(real, "rollout", reason, fix)

            add_deploy(state, guarded, *args)
            run_ops(state)
        except PyinfraError as exc:
            if "No hosts remaining" not in str(exc):
                raise
    finally:
        try:
            disconnect_all(state)
        finally:
            log.removeHandler(collect)
    # active_hosts (not failed_hosts): other code may have failed a host through pyinfra's `host`
    # proxy, which no longer names that host once the run is over
    for h in limit:
        if h not in state.active_hosts:
            if h.name in reasons:
                why = reasons[h.name]
            elif h not in state.activated_hosts:
                why = "could not connect" + _connect_error(collect.lines, h.name)
            elif h.name in errors.ops:
                why = f"operation failed: {errors.ops[h.name]}" + _tail(collect.lines, h.name)
            else:
                why = "failed"
            result.failed[h.name] = why
        else:
            result.ok.append(h.name)
            meta = state.get_meta_for_host(h)
            result.changed[h.name] = getattr(meta, "ops_change", 0)
    return result


def _connect_error(lines: list[str], name: str) -> str:
    """pyinfra's own words on why it could not connect ('Could not connect (... port 22 on ...)')."""
    for line in lines:
        text = line.split("] ", 1)[-1].strip() if f"[{name}]" in line else ""
        if "connect" in text.lower():
            return f" ({text.split('(', 1)[1]}" if text.startswith("Could not connect (") else f": {text}"
    return ""


def _tail(lines: list[str], name: str, count: int = 3) -> str:
    mine = [line.split("] ", 1)[-1].strip() for line in lines if f"[{name}]" in line]
    mine = [line for line in mine if line and not line.startswith(("Error:", "Unexpected error"))]
    return (": " + " | ".join(mine[-count:])) if mine else ""
