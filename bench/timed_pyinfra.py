#!/usr/bin/env python3
"""pyinfra's own CLI, with a state callback that records where the wall time of a run goes.

    timed_pyinfra.py TIMINGS.json <pyinfra arguments...>

Writes, at exit, the time of each stage change (connect, prepare, execute, disconnect) and,
for each operation, its names and the wall time from its first host starting to its last
host finishing (pyinfra runs one operation on all hosts, then the next). bench/fleet.py
uses it to split a converge into package installation and everything else.
"""
from __future__ import annotations

import atexit
import json
import sys
import time

from pyinfra.api import state as state_module
from pyinfra.api.state import BaseStateCallback

OUT = sys.argv.pop(1)
T0 = time.monotonic()
RECORD: dict = {"stages": [], "ops": {}}


class Timings(BaseStateCallback):
    def operation_start(self, state, op_hash):
        RECORD["ops"][op_hash] = {"names": sorted(state.get_op_meta(op_hash).names),
                                  "start": time.monotonic() - T0}

    def operation_end(self, state, op_hash):
        RECORD["ops"][op_hash]["end"] = time.monotonic() - T0


_init, _set_stage = state_module.State.init, state_module.State.set_stage


def _patched_init(self, *args, **kwargs):
    # State.init, not __init__, creates the handler list
    _init(self, *args, **kwargs)
    self.add_callback_handler(Timings())


def _patched_set_stage(self, stage):
    RECORD["stages"].append([stage.name, time.monotonic() - T0])
    return _set_stage(self, stage)


state_module.State.init = _patched_init
state_module.State.set_stage = _patched_set_stage


@atexit.register
def _write() -> None:
    RECORD["exit"] = time.monotonic() - T0
    with open(OUT, "w") as fh:
        json.dump(RECORD, fh)


from pyinfra_cli.main import main  # noqa: E402

sys.exit(main())
