"""How the benchmarks run a command: from the checkout, its output to a file, and what it cost the
controller, read with wait4 (the child's own CPU time and peak RSS, not the benchmark's).

Before the first run, the checkout's Python is byte-compiled, as pip compiles an installed
gpufleet: with PYTHONDONTWRITEBYTECODE set (this machine sets it), every run would otherwise
compile gpufleet's ~90 modules again (0.1 s a run, measured in bench/controller.py's profile),
a cost no installed copy pays and plain pyinfra, installed, never pays."""
from __future__ import annotations

import compileall
import os
import resource
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
#: the checkout's Python that a pyinfra run of deploys/all.py imports
COMPILED = ("gpufleet", "deploys", "facts", "operations", "inventories", "testing")


@lru_cache(maxsize=1)
def compile_checkout() -> None:
    """Byte-compile COMPILED once per process (files already compiled are skipped)."""
    for name in COMPILED:
        compileall.compile_dir(REPO / name, quiet=1)


def run(cmd: list[str], out: IO, env: dict[str, str] | None = None) -> tuple[int, float, resource.struct_rusage]:
    """(exit code, wall seconds, resource use) of `cmd`, its stdout and stderr written to `out`."""
    compile_checkout()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    _, status, rusage = os.wait4(proc.pid, 0)
    return os.waitstatus_to_exitcode(status), time.monotonic() - t0, rusage


def run_captured(cmd: list[str]) -> tuple[str, int, float, resource.struct_rusage]:
    """run(), the output read back as text: (output, exit code, wall seconds, resource use)."""
    with tempfile.TemporaryFile("w+") as out:
        rc, wall, rusage = run(cmd, out)
        out.seek(0)
        return out.read(), rc, wall, rusage
