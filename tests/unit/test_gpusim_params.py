"""The GPU simulator (testing/gpusim, a TEST DOUBLE) prints /proc/driver/nvidia/params as the
recorded H200 did (tests/fixtures/nvidia/h200-x1/proc-params.txt), with RmProfilingAdminOnly as
the modprobe.d option NVreg_RestrictProfilingToAdminUsers was when the simulated module was
loaded (install, then every boot: gpusim-load-module), never as it is written afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpufleet.facts.kernel import parse_profiling_state
from testing.gpusim.local import LocalSim

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests/fixtures/nvidia/h200-x1/proc-params.txt"


def recorded_lines() -> list[str]:
    lines = RECORDED.read_text().splitlines()
    assert lines[0] == "$ cat /proc/driver/nvidia/params" and lines[-1] == "[rc=0]"
    return lines[1:-1]


def boot(sim: LocalSim) -> None:
    """gpusim-load-module, as its unit runs it at boot."""
    env = dict(os.environ, GPUSIM_ROOT=str(sim.root))
    r = subprocess.run([sys.executable, str(sim.root / "usr/lib/gpusim/gpusim-load-module")], env=env,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr


def params(sim: LocalSim) -> list[str]:
    return (sim.root / "usr/lib/gpusim/kernel/proc-driver/nvidia/params").read_text().splitlines()


def test_params_are_the_recorded_ones_with_the_drivers_default_without_an_option(tmp_path):
    sim = LocalSim(tmp_path, "h200x1")
    recorded = recorded_lines()
    assert "RmProfilingAdminOnly: 0" in recorded   # the live H200 had profiling for users
    assert params(sim) == [line if line != "RmProfilingAdminOnly: 0" else "RmProfilingAdminOnly: 1" for line in recorded]


def test_the_option_counts_at_the_next_boot_not_when_written(tmp_path):
    sim = LocalSim(tmp_path, "h200x1")
    conf = sim.root / "etc/modprobe.d/gpufleet-nvidia-profiling.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("# comment NVreg_RestrictProfilingToAdminUsers=1\noptions nvidia NVreg_RestrictProfilingToAdminUsers=0\n")
    assert "RmProfilingAdminOnly: 1" in params(sim)   # written, module not reloaded
    boot(sim)
    assert params(sim) == recorded_lines()            # byte for byte the recording
    # the fact reads what the host prints
    line = next(x for x in params(sim) if x.startswith("RmProfilingAdminOnly:"))
    state = parse_profiling_state(["::gpufleet:: begin params", "present=yes", line, "::gpufleet:: begin options"])
    assert state.admin_only == 0
    conf.unlink()
    boot(sim)
    assert "RmProfilingAdminOnly: 1" in params(sim)


def test_etc_hides_a_file_of_the_same_name_and_later_names_win(tmp_path):
    sim = LocalSim(tmp_path, "h200x1")
    for d, name, value in (("usr/lib/modprobe.d", "nvidia.conf", 0), ("etc/modprobe.d", "nvidia.conf", 1),
                           ("usr/lib/modprobe.d", "zz-users.conf", 0)):
        (sim.root / d).mkdir(parents=True, exist_ok=True)
        (sim.root / d / name).write_text(f"options nvidia NVreg_RestrictProfilingToAdminUsers={value}\n")
    boot(sim)
    assert "RmProfilingAdminOnly: 0" in params(sim)
    (sim.root / "usr/lib/modprobe.d/zz-users.conf").unlink()
    boot(sim)
    assert "RmProfilingAdminOnly: 1" in params(sim)
