"""gpufleet/controller/controller_files.py: gpufleet's own files are 0600 in 0700 folders, whatever the umask."""
from __future__ import annotations

import os
import stat

import pytest

from gpufleet.controller import controller_files

pytestmark = pytest.mark.unit


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_files_0600_in_0700_folders_whatever_the_umask(tmp_path):
    old = os.umask(0o000)
    try:
        target = tmp_path / "work" / ".gpufleet" / "rollouts" / "inv.json"
        controller_files.write(target, "{}\n")
        controller_files.write(target, "{\"again\": 1}\n")  # replaced whole, still private
    finally:
        os.umask(old)
    assert target.read_text() == "{\"again\": 1}\n"
    assert mode(target) == 0o600
    for folder in (target.parent, target.parent.parent, tmp_path / "work"):
        assert mode(folder) == 0o700, folder
    assert [p.name for p in target.parent.iterdir()] == ["inv.json"]  # no temporary left


def test_a_loose_gpufleet_folder_is_tightened_an_operators_folder_is_not(tmp_path):
    ours = tmp_path / ".gpufleet" / "factplans"
    ours.mkdir(parents=True, mode=0o755)
    os.chmod(ours, 0o755)
    controller_files.write(ours / "h.json", "{}")
    assert mode(ours) == 0o700
    chosen = tmp_path / "reports"
    chosen.mkdir(mode=0o755)
    os.chmod(chosen, 0o755)
    controller_files.write(chosen / "fleet-report.json", "{}")
    assert mode(chosen) == 0o755 and mode(chosen / "fleet-report.json") == 0o600


def test_a_file_others_can_write_is_not_private(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{}")
    os.chmod(path, 0o600)
    assert controller_files.is_private(path)
    os.chmod(path, 0o622)
    assert not controller_files.is_private(path)


def test_manifest_and_archive_copies_on_the_controller_are_private(tmp_path):
    import base64
    import types

    from gpufleet.operations.remote_files import Fetch

    class FakeHost:  # the host's answer to the read command: one base64 line, as base64 -w0 prints
        def run_shell_command(self, command, **kwargs):
            remote = command.bits[-1].obj
            line = base64.b64encode(b"secret /etc of " + remote.encode()).decode()
            return True, types.SimpleNamespace(stdout_lines=[line])

    state = types.SimpleNamespace(print_input=False)
    pairs = [("/var/lib/gpufleet/manifests/1.json", str(tmp_path / ".gpufleet/manifests/h1/1.json")),
             ("/var/lib/gpufleet/manifests/1.etc.tar.gz", str(tmp_path / ".gpufleet/manifests/h1/1.etc.tar.gz"))]
    for remote, local in pairs:
        fetch = Fetch(remote, lambda data, local=local: controller_files.write(local, data), lambda state, host: False)
        assert fetch.execute(state, FakeHost(), {})
    for _, local in pairs:
        assert mode(local) == 0o600 and open(local, "rb").read().startswith(b"secret /etc of /var/lib")
    assert mode(tmp_path / ".gpufleet/manifests/h1") == 0o700 and mode(tmp_path / ".gpufleet") == 0o700
