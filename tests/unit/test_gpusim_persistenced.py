"""The GPU simulator's nvidia-persistenced stand-in (a TEST DOUBLE, not NVIDIA software): while it
runs, every simulated GPU reports persistence mode Enabled; when it stops, the mode is released.
Also: the simulated nvidia-smi logs every set command to /run/gpusim/commands.log."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from testing.gpusim.local import LocalSim

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]


def persistence(sim):
    r = sim.smi("--query-gpu=persistence_mode", "--format=csv,noheader")
    assert r.returncode == 0, r.stdout
    return r.stdout.split()


def daemon(sim, *args):
    env = dict(os.environ, GPUSIM_ROOT=str(sim.root))
    env.pop("GPUSIM_UID", None)
    return subprocess.Popen([sys.executable, str(sim.root / "usr/lib/gpusim/nvidia-persistenced"), *args], env=env)


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_daemon_holds_persistence_while_running(tmp_path):
    sim = LocalSim(tmp_path, "a100x4@535.247.01")
    assert persistence(sim) == ["Disabled"] * 4  # non-recorded models boot with it off
    proc = daemon(sim, "--foreground", "--user", "nvpd")
    try:
        assert wait_for(lambda: persistence(sim) == ["Enabled"] * 4)
        assert (sim.root / "run/nvidia-persistenced/nvidia-persistenced.pid").read_text().strip() == str(proc.pid)
        assert sim.smi().stdout.count(" On  | ") == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    assert persistence(sim) == ["Disabled"] * 4
    assert not (sim.root / "run/nvidia-persistenced/nvidia-persistenced.pid").exists()


def test_daemon_forks_like_the_real_one_and_is_gone_after_reboot(tmp_path):
    sim = LocalSim(tmp_path, "t4")
    parent = daemon(sim, "--user", "nvpd")
    assert parent.wait(10) == 0  # Type=forking: the parent returns once the daemon is ready
    pid = int((sim.root / "run/nvidia-persistenced/nvidia-persistenced.pid").read_text())
    try:
        assert pid != parent.pid and persistence(sim) == ["Enabled"]
        # a second instance refuses while the first runs
        assert daemon(sim, "--foreground").wait(10) == 1
    finally:
        os.kill(pid, signal.SIGTERM)
    assert wait_for(lambda: persistence(sim) == ["Disabled"])


def test_killed_daemon_holds_nothing(tmp_path):
    sim = LocalSim(tmp_path, "t4")
    proc = daemon(sim, "--foreground")
    assert wait_for(lambda: persistence(sim) == ["Enabled"])
    proc.kill()
    proc.wait(10)
    assert persistence(sim) == ["Disabled"]


def test_daemon_without_driver_fails(tmp_path):
    sim = LocalSim(tmp_path, "t4:nodriver")
    assert daemon(sim, "--foreground").wait(10) == 1


def test_no_persistence_mode_option(tmp_path):
    sim = LocalSim(tmp_path, "t4")
    proc = daemon(sim, "--foreground", "--no-persistence-mode")
    try:
        assert wait_for(lambda: (sim.root / "run/gpusim/persistenced.json").exists())
        assert persistence(sim) == ["Disabled"]
    finally:
        proc.terminate()
        proc.wait(10)


def test_set_commands_are_logged_and_queries_are_not(tmp_path):
    sim = LocalSim(tmp_path, "a100x4@535.247.01")
    log = sim.root / "run/gpusim/commands.log"
    sim.smi("--query-gpu=index", "--format=csv")
    sim.smi("-q")
    assert not log.exists()
    sim.smi("-i", "00000000:00:06.0", "-ac", "1215,1410")
    sim.smi("-ac", "1,2")  # rejected, still logged
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("rc=0 nvidia-smi -i 00000000:00:06.0 -ac 1215,1410")
    assert "rc=2 nvidia-smi -ac 1,2" in lines[1]
    sim.reboot()
    assert not log.exists()
