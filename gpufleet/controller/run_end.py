"""What gpufleet does at the end of a run, without an interpreter exit hook: one pyinfra state
callback handler per run (pyinfra's public BaseStateCallback), whose host_disconnect calls each
host's hooks as it disconnects and, once every host the run connected to has, the run's hooks.
pyinfra disconnects every connected host when a run ends (the `pyinfra` command in its
`finally`, the rollout's sessions likewise), after its results, so that is where a run ends.

The handler lives on the State, so a second run in one process (the rollout's phases, the
tests) has its own; nothing is kept at module level.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyinfra.api import BaseStateCallback

from gpufleet.config.hostcontext import fleet_context, real_object


class _RunEnd(BaseStateCallback):
    def __init__(self) -> None:
        self.host_hooks: list[Callable[[Any], None]] = []
        self.run_hooks: list[Callable[[Any], None]] = []
        self.gone: set[str] = set()   # names only: the handler holds no Host
        self.ended = False

    def host_disconnect(self, state: Any, host: Any) -> None:  # type: ignore[override]
        for hook in self.host_hooks:
            hook(host)
        self.gone.add(host.name)
        if not self.ended and all(h.name in self.gone for h in state.activated_hosts):
            self.ended = True
            for run_hook in self.run_hooks:
                run_hook(state)


def _handler(state: Any) -> _RunEnd:
    state = real_object(state)
    context = fleet_context(state)
    if context.run_end_installed:
        for handler in state.callback_handlers:
            if isinstance(handler, _RunEnd):
                return handler
    handler = _RunEnd()
    state.add_callback_handler(handler)
    context.run_end_installed = True
    return handler


def at_host_end(state: Any, hook: Callable[[Any], None]) -> None:
    """Call hook(host) as each host of this run disconnects (once per hook and run)."""
    hooks = _handler(state).host_hooks
    if hook not in hooks:
        hooks.append(hook)


def at_run_end(state: Any, hook: Callable[[Any], None]) -> None:
    """Call hook(state) once every host this run connected to has disconnected (once per hook and run)."""
    hooks = _handler(state).run_hooks
    if hook not in hooks:
        hooks.append(hook)
