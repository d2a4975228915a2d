"""Two exact replacements for pyinfra 3 planning hot spots, measured with py-spy on a 20-host
no-op run of deploys/all.py (bench/fleet.py), where they took over half the controller's CPU:

- `get_operation_order_from_stack` builds each operation's order key from `inspect.stack()`,
  which reads the source file of every frame for context lines it then throws away
  (`findsource`/`getmodule`: 3.5 s of 7 s of controller CPU). Only each frame's file name and
  line number are used, and both are on the frame itself.
- `all_global_arguments` calls `typing.get_type_hints(AllArguments)` anew for every operation
  and every fact (1.2 s); the class never changes during a run, so it is computed once.

Both return exactly what the originals return (tests/unit/test_speedups.py compares them);
install() swaps them in where pyinfra looks them up, through gpufleet/pyinfra_private.py (only on
a pyinfra release and connectors they were verified with).
"""
from __future__ import annotations

import sys
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


# The releases these were compared with: pyinfra_private.VERIFIED_PYINFRA (one gate for all).
VERIFIED_PYINFRA = pyinfra_private.VERIFIED_PYINFRA


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    pyinfra_private.patch_planning(operation_order_from_stack, all_global_arguments)
