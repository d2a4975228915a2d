#!/usr/bin/env python3
"""pyinfra's own command line, in this process, with what bench/controller.py reads at exit.

    controller_run.py OUT.json [--replay] <pyinfra arguments...>

--replay: the hosts are `@replay/NAME` hosts answered by testing/replay.py, a TEST DOUBLE for
the network (registered here, admitted to gpufleet's fact speed-ups here; never elsewhere),
and gpufleet's fact plans are read from and written to $GPUFLEET_REPLAY_PLANS. With
$GPUFLEET_CONTROLLER_PROFILE set, the run is profiled (cProfile) into that file.

Writes OUT.json at exit: per host, the operations planned for it (their names, in order) and,
for replayed hosts, the commands and uploads each was sent. pyinfra's exit status is this
process's.
"""
from __future__ import annotations

import atexit
import cProfile
import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = sys.argv.pop(1)
REPLAY = len(sys.argv) > 1 and sys.argv[1] == "--replay"
if REPLAY:
    sys.argv.pop(1)
    from testing import replay

    replay.register()
    from gpufleet.controller import factcache
    from gpufleet import pyinfra_private

    pyinfra_private.admit_test_double_connector(replay.ReplayConnector)
    factcache.PLAN_DIR = Path(os.environ["GPUFLEET_REPLAY_PLANS"])
PROFILE = os.environ.get("GPUFLEET_CONTROLLER_PROFILE")
profiler = cProfile.Profile() if PROFILE else None
# GPUFLEET_CONTROLLER_MEMORY=FILE: what holds the memory at exit (tracemalloc, by line; slow)
MEMORY = os.environ.get("GPUFLEET_CONTROLLER_MEMORY")
if MEMORY:
    import tracemalloc

    tracemalloc.start(int(os.environ.get("GPUFLEET_CONTROLLER_MEMORY_FRAMES", "1")))


def _operations(state: object, host: object) -> list[str]:
    return [" | ".join(sorted(state.get_op_meta(op_hash).names))  # type: ignore[attr-defined]
            for op_hash in host.op_hash_order]  # type: ignore[attr-defined]


@atexit.register
def _write() -> None:
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(PROFILE)
    from pyinfra.context import ctx_state

    if MEMORY:
        snapshot = tracemalloc.take_snapshot()
        with open(MEMORY, "w") as fh:
            for stat in snapshot.statistics("traceback")[:40]:
                fh.write(f"{stat.size / 2**20:8.1f} MiB {stat.count:>9} blocks\n")
                for line in stat.traceback.format()[-6:]:
                    fh.write(f"      {line}\n")
    record: dict = {"hosts": {}}
    if ctx_state.isset():
        state = ctx_state.get()
        lists: dict[str, list[str]] = {}
        for host in state.inventory:
            ops = _operations(state, host)
            digest = hashlib.sha1("\n".join(ops).encode()).hexdigest()
            lists.setdefault(digest, ops)
            entry = {"operations": len(ops), "operations_digest": digest}
            if REPLAY:
                entry.update(commands=replay.COMMANDS[host.name], uploads=replay.UPLOADS[host.name],
                             unrecorded=replay.UNRECORDED[host.name],
                             prefetch_sections=replay.PREFETCH_SECTIONS.get(host.name, 0),
                             prefetch_digest=replay.PREFETCH_DIGESTS.get(host.name))
            record["hosts"][host.name] = entry
        record["operation_lists"] = lists
        record["failed_hosts"] = sorted(h.name for h in state.failed_hosts)
    if REPLAY:
        record["first_commands"] = replay.FIRST_COMMANDS
        record["replay_cpu_s"] = replay.REPLAY_CPU_S[0]
    with open(OUT, "w") as fh:
        json.dump(record, fh)


from pyinfra_cli.main import main  # noqa: E402

sys.argv[0] = "pyinfra"  # as the command line runs: gpufleet reads its inventory argument so
if profiler is not None:
    profiler.enable()
sys.exit(main())
