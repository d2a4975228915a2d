"""Exact replacements for pyinfra 3 planning hot spots, measured with py-spy on a 20-host
no-op run of deploys/all.py (bench/fleet.py), where the first two took over half the
controller's CPU, and with bench/controller.py's profile, where the third took a third of it:

- `get_operation_order_from_stack` builds each operation's order key from `inspect.stack()`,
  which reads the source file of every frame for context lines it then throws away
  (`findsource`/`getmodule`: 3.5 s of 7 s of controller CPU). Only each frame's file name and
  line number are used, and both are on the frame itself.
- `all_global_arguments` calls `typing.get_type_hints(AllArguments)` anew for every operation
  and every fact (1.2 s); the class never changes during a run, so it is computed once.
- `pop_global_arguments`, once per operation, fact and deploy call, looks each of the 32 global
  arguments up in `host.data`, and every lookup calls each of the host's five data sources
  again (override, host, groups, inventory, @deploy data): `get_groups_data` merges the
  groups' dicts anew each time. 95 calls per host in a no-op, 300,000 lookups for 100 hosts:
  4.2 of 12 s under the profiler. The replacement runs pyinfra's own function over a view of
  the host whose data reads each source once per call, in pyinfra's order, with the same
  copy() of each value.

All three return exactly what the originals return (tests/unit/test_speedups.py compares them);
install() swaps them in where pyinfra looks them up, through gpufleet/pyinfra_private.py (only on
a pyinfra release and connectors they were verified with).
"""
from __future__ import annotations

import sys
from copy import copy
from functools import lru_cache
from types import FrameType
from typing import Any

import pyinfra

from gpufleet import pyinfra_private

_installed = False


def operation_order_from_stack(state: Any) -> list[int]:
    """pyinfra.api.util.get_operation_order_from_stack, reading frames instead of source."""
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()

    i = 0
    # From the *first* frame of the deploy file on; without one, pyinfra's loop stops on its
    # own (skipped) frame, so no frame is left.
    if state.current_deploy_filename:
        i = next((n for n, frame in enumerate(frames)
                  if frame.f_code.co_filename == state.current_deploy_filename), len(frames))

    line_numbers = []
    install_dir = pyinfra_private.pyinfra_install_dir()
    if pyinfra.is_cli:
        line_numbers.append(state.current_op_file_number)
    for frame in frames[i:]:
        if frame.f_code.co_filename.startswith(install_dir):
            continue
        line_numbers.append(frame.f_lineno)
    return line_numbers


@lru_cache(maxsize=1)
def _global_arguments() -> tuple[tuple[str, type], ...]:
    return tuple(pyinfra_private.original_all_global_arguments()())


def all_global_arguments() -> list[tuple[str, type]]:
    """pyinfra.api.arguments.all_global_arguments, computed once."""
    return list(_global_arguments())


class _DataReadOnce:
    """host.data for one pop_global_arguments call, which asks it for the global arguments
    only: each source evaluated once, and each global argument they have set as an attribute
    up front, from the first source that has it, shallow-copied (HostData.__getattr__'s order
    and copy). A missing one is a plain missing attribute: getattr's default, no exception."""

    def __init__(self, sources: tuple[Any, ...]) -> None:
        found = [source() if callable(source) else source for source in sources]
        for key, _ in _global_arguments():
            for source in found:
                if key in source:
                    self.__dict__[key] = copy(source[key])
                    break


class _HostView:
    """The host as pop_global_arguments sees it: the same host, its data read once. A view, not
    a change to the host: another greenlet never sees it."""

    __slots__ = ("_host", "data")

    def __init__(self, host: Any, sources: tuple[Any, ...]) -> None:
        self._host = host
        self.data = _DataReadOnce(sources)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)


def pop_global_arguments(state: Any, host: Any, kwargs: dict[str, Any]) -> Any:
    """pyinfra.api.arguments.pop_global_arguments over _HostView(host)."""
    original = pyinfra_private.original_pop_global_arguments()
    # HostData keeps its sources in its own __dict__; without them, pyinfra's path as it is
    sources = vars(host.data).get("datas") if hasattr(host, "data") else None
    if not isinstance(sources, tuple):
        return original(state, host, kwargs)
    return original(state, _HostView(host, sources), kwargs)


# The releases these were compared with: pyinfra_private.VERIFIED_PYINFRA (one gate for all).
VERIFIED_PYINFRA = pyinfra_private.VERIFIED_PYINFRA


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    pyinfra_private.patch_planning(operation_order_from_stack, all_global_arguments, pop_global_arguments)
