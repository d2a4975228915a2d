"""Stop one host, not the fleet, in one of two ways, each saying host, area, reason and fix:

- `refuse(host, area, reason, fix)` at planning time: what the host is (its facts, its
  settings) rules it out, so none of its operations run; the other hosts carry on.
      [gpu-a01] refused (driver_kernel_headers): no kernel headers for ... Fix: install ...
- `fail(host, area, reason, fix)` at execution time: a command, yielded by an operation (or
  returned by a callback that is already executing), that fails the host when its turn comes
  (what was found only then: the validation gate, a race since planning, a lock-out check).
      [gpu-a01] failed (validation): ... Fix: ...

`area` is the setting to change where there is one (`docker_source`), else the part of gpufleet
that stopped the host (`rollout`, `validation`). A bad inventory is not one host's stop: it
stops the whole run before planning (gpufleet.errors.InventoryError, one line per problem).
"""
from __future__ import annotations

from typing import Any

from pyinfra import logger
from pyinfra.api.command import FunctionCommand

from gpufleet.config.hostcontext import real_object as real_host  # the Host behind pyinfra's proxy
from gpufleet.printable import printable


def stop_line(name: str, how: str, area: str, reason: str, fix: str) -> str:
    """'[name] refused (area): reason. Fix: fix' (`how`: refused or failed): one wording for
    every stop, whoever prints it. Printable: a reason may quote a host (a GPU process name)."""
    reason, fix = reason.strip().rstrip("."), fix.strip().rstrip(".")
    return printable(f"[{name}] {how} ({area}): {reason}. Fix: {fix}", newlines=True)


def refuse(host: Any, area: str, reason: str, fix: str) -> None:
    """Fail `host` at planning time: none of its operations run, the other hosts carry on."""
    host = real_host(host)
    logger.error(stop_line(host.name, "refused", area, reason, fix))
    host.state.fail_hosts({host})


def fail(host: Any, area: str, reason: str, fix: str) -> FunctionCommand:
    """A command that fails `host` at execution time with the same four parts: yield it from an
    operation (`yield fail(host, ...)`); a python callback that is already executing returns
    `fail_now(state, host, ...)` instead. Runs nothing on the host."""
    line = stop_line(real_host(host).name, "failed", area, reason, fix)
    return FunctionCommand(_fail_now, (line,), {})


def fail_now(state: Any, host: Any, area: str, reason: str, fix: str) -> bool:
    """`fail`, from a python callback that is already executing: logs the same line and returns
    the callback's result, False (what pyinfra's execute() of `fail`'s command returns)."""
    return _fail_now(state, host, stop_line(real_host(host).name, "failed", area, reason, fix))


def _fail_now(state: Any, host: Any, line: str) -> bool:
    logger.error(line)
    return False  # pyinfra: the operation failed, so the host stops here


def host_failed(host: Any) -> bool:
    host = real_host(host)
    return host in host.state.failed_hosts
