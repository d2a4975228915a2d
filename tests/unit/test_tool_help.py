"""`--help` of every tool prints help and does nothing else (issue 20): no file of the checkout
or its .venv changes, no machine command that installs, mounts, boots or connects runs (each is
shadowed on PATH by a recorder), no test host or pool appears, no process is left behind."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
TOOLS = ["sandbox", "test", "settings-doc", "commands-doc", "compat", "testhosts", "bootstrap", "rollout", "rollback", "fleet-report", "health",
         "compat-upstream"]
TRAPPED = ["apt-get", "apt", "dpkg", "debootstrap", "systemd-nspawn", "mount", "umount", "ssh", "pip", "pip3",
           "pyinfra", "pytest", "nsenter", "unshare", "ip"]


def _state() -> dict[str, int]:
    """mtime of every file of the checkout git knows or would add, and of .venv's package folders."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    paths = [REPO / p.decode() for p in listed if p]
    paths += list((REPO / ".venv").glob("lib/python*/site-packages")) + [REPO / ".venv" / "bin"]
    return {str(p): p.stat().st_mtime_ns for p in paths if p.exists()}


def _session_processes(sid: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid:   # field 6 of stat: the session id
            found.append(text.split(")", 1)[0] + ")")
    return found


@pytest.fixture
def traps(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "called.log"
    for name in TRAPPED:
        trap = bin_dir / name
        trap.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\nexit 97\n')
        trap.chmod(0o755)
    return bin_dir, log


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_help_and_does_nothing_else(tool, flag, traps, tmp_path):
    bin_dir, log = traps
    hosts_dir = tmp_path / "testhosts"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", GPUFLEET_TESTHOSTS_DIR=str(hosts_dir),
               GPUFLEET_TESTHOSTS_POOL="help-check", GPUFLEET_SANDBOX_POOL="help-check")
    before = _state()
    proc = subprocess.Popen([str(REPO / "tools" / tool), flag], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert len(out.strip().splitlines()) >= 2 and "usage" in out.lower(), out
    time.sleep(0.2)
    assert _session_processes(proc.pid) == [], "left running"
    assert not log.exists(), log.read_text()
    assert not hosts_dir.exists(), sorted(str(p) for p in hosts_dir.rglob("*"))[:20]
    after = _state()
    changed = sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
    assert changed == [], changed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]   # nothing written where it ran


def test_the_recorders_record(traps):
    """The test above can fail: a trapped command run from a tool is seen."""
    bin_dir, log = traps
    subprocess.run(["sh", "-c", "apt-get install -y nothing"], env=dict(os.environ, PATH=f"{bin_dir}:/usr/bin:/bin"))
    assert log.read_text() == "apt-get install -y nothing\n"
