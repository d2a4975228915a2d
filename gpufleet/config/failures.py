"""Stop one host, not the fleet, in one of two ways, each saying host, area, reason and fix:

- `refuse(host, area, reason, fix)` at planning time: what the host is (its facts, its
  settings) rules it out, so none of its operations run; the other hosts carry on.
      [gpu-a01] refused (driver_kernel_headers): no kernel headers for ... Fix: install ...
- `fail(host, area, reason, fix)` at execution time: a command, yielded by an operation (or
  returned by a callback that is already executing), that fails the host when its turn comes
  (what was found only then: the validation gate, a race since planning, a lock-out check).
      [gpu-a01] failed (validation): ... Fix: ...

`area` is the setting to change where there is one (`docker_source`), else the part of gpufleet
that stopped the host (`rollout`, `validation`). Every plan says why it cannot be made for a host
with one type, `Refusal` (below), which its deploy turns into the planning-time stop. A bad inventory is not one host's stop: it
stops the whole run before planning (gpufleet.errors.InventoryError, one line per problem).
"""
from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Refusal:
    """Why a plan cannot be made for this host: one type for every area's plan, plain frozen data.

    A plan returns one (`plan_x(...) -> XPlan | Refusal`), or, from deep inside a computation,
    raises it wrapped: `raise Refused(Refusal(...))`, caught by the plan's reader as
    `except Refused as refused: refused.refusal`. The deploy turns it into the stop with
    `refusal.stop(host)` (none of the host's operations run, the others carry on); the gate,
    the plan view and the report show the same words. To adopt it in a new plan:

        Refusal(area="docker", key="docker_source", reason="no Docker release for bookworm",
                allowed="distro | docker")

    area:    the area whose plan refuses (`storage`, `tuning`, `driver`, ...)
    key:     the setting to change ("" when no setting can fix it: the host must change)
    reason:  what the host is that rules the setting out
    fix:     what to do ("": "set KEY to what this host allows: ALLOWED", from `allowed`)
    allowed: the values this host would accept ("" when unknown)
    """

    area: str
    key: str
    reason: str
    fix: str = ""
    allowed: str = ""

    @property
    def problem(self) -> str:
        return self.reason

    def how_to_fix(self) -> str:
        if self.fix:
            return self.fix
        if self.key and self.allowed:
            return f"set {self.key} to what this host allows: {self.allowed}"
        return f"change {self.key}" if self.key else f"make the host fit the {self.area} plan"

    def __str__(self) -> str:
        return f"key '{self.key}': {self.reason}; allowed: {self.allowed}" if self.key else self.reason

    def stop(self, host: Any) -> None:
        """Refuse `host` at planning time with this refusal's words."""
        refuse(host, self.key or self.area, self.reason, self.how_to_fix())


class Refused(Exception):
    """A `Refusal` raised from inside a plan's computation; `.refusal` holds it (its fields are
    read through too: `refused.key`, `refused.reason`, `refused.allowed`)."""

    def __init__(self, refusal: Refusal):
        super().__init__(str(refusal))
        self.refusal = refusal

    def __getattr__(self, name: str) -> Any:
        if name == "refusal":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.refusal, name)


def host_failed(host: Any) -> bool:
    host = real_host(host)
    return host in host.state.failed_hosts
