"""Run the gpufleet GPU SIMULATOR (a TEST DOUBLE) on the controller, for unit tests.

install() lays the simulator into a scratch root directory; the scripts then run with
GPUSIM_ROOT pointing at it, so no test host is needed.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

from .install import install


class LocalSim:
    def __init__(self, base: pathlib.Path, spec: str, python: str = sys.executable):
        self.root = pathlib.Path(base) / "root"
        self.work = pathlib.Path(base) / "work"
        self.root.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.python = python
        self.nspawn_args = install(self.root, spec, self.work)

    def _run(self, script: str, args, uid: int | None) -> subprocess.CompletedProcess:
        env = dict(os.environ, GPUSIM_ROOT=str(self.root))
        env.pop("GPUSIM_UID", None)
        if uid is not None:
            env["GPUSIM_UID"] = str(uid)
        return subprocess.run([self.python, str(self.root / "usr/lib/gpusim" / script), *args],
                              capture_output=True, text=True, env=env, check=False)

    def smi(self, *args: str, uid: int | None = None) -> subprocess.CompletedProcess:
        """Run the simulated nvidia-smi; uid pretends a non-root caller."""
        return self._run("nvidia-smi", args, uid)

    def ctl(self, *args: str) -> subprocess.CompletedProcess:
        return self._run("gpusimctl", args, None)

    def reboot(self) -> None:
        """Forget GPU state, the command log and daemon records: /run is a tmpfs, wiped by a reboot."""
        shutil.rmtree(self.root / "run", ignore_errors=True)
