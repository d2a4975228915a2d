"""operations/ssh.py's install script refuses to go on without its backup (issue 27 item 5: a
failed copy was ignored, and the revert then had nothing to put back). The script runs in a
temporary folder here; it stops before anything that would touch this machine's sshd."""
from __future__ import annotations

import os
import subprocess

from gpufleet.operations.ssh import _INSTALL_SCRIPT


def run(tmp_path, prev):
    new, dest = tmp_path / "new.conf", tmp_path / "dest.conf"
    new.write_text("MaxAuthTries 2\n")
    dest.write_text("the operator's drop-in\n")
    # sshd and systemd are never this machine's: stand-ins that only say they were called
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("sshd", "systemctl", "systemd-run"):
        (stubs / name).write_text(f"#!/bin/sh\necho CALLED {name} >&2\nexit 99\n")
        (stubs / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{stubs}:/usr/bin:/bin")
    proc = subprocess.run(["sh", "-c", _INSTALL_SCRIPT, "install", str(new), str(dest), str(prev),
                           str(tmp_path / "pending"), str(tmp_path / "revert.sh"), "", "gf-test-unit", "60"],
                          capture_output=True, text=True, timeout=30, env=env)
    assert "CALLED" not in proc.stderr, proc.stderr
    return proc, new, dest


def test_no_folder_for_the_backup_changes_nothing(tmp_path):
    (tmp_path / "a-file").write_text("")
    proc, new, dest = run(tmp_path, tmp_path / "a-file" / "dest.conf.previous")
    assert proc.returncode == 1
    assert "could not keep a copy of" in proc.stderr and "nothing was changed" in proc.stderr
    assert dest.read_text() == "the operator's drop-in\n" and not new.exists()
    assert not (tmp_path / "pending").exists()


def test_a_backup_that_cannot_be_written_changes_nothing(tmp_path):
    prev = tmp_path / "backup" / "dest.conf.previous"
    prev.mkdir(parents=True)            # a folder where the copy goes: rm -f leaves it, cp puts the copy inside
    (prev / "dest.conf").mkdir()        # ... and that name is taken by a folder too: cp fails
    proc, new, dest = run(tmp_path, prev)
    assert proc.returncode == 1, proc.stderr
    assert "the copy failed" in proc.stderr
    assert dest.read_text() == "the operator's drop-in\n" and not new.exists()
