"""Issue 27 on the controller: gpufleet's own files are used only when they are ours (item 4),
host strings are printed escaped (item 7), and a host's packed answers cannot inflate without
bound (item 7)."""
from __future__ import annotations

import base64
import gzip
import json
import os

import pytest

from gpufleet.controller import factcache
from gpufleet.controller import controller_files
from gpufleet.printable import printable
from gpufleet.rollout import manifest as mf
from gpufleet.rollout.state import RolloutState, StateError, StateLock

pytestmark = pytest.mark.unit
OTHER = 65534   # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")


def foreign(path, uid=OTHER):
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, uid)
    os.chmod(path, 0o700)
    return path


@needs_root
def test_a_gpufleet_folder_another_user_made_is_refused_naming_it(tmp_path):
    theirs = foreign(tmp_path / ".gpufleet")
    with pytest.raises(controller_files.UnsafePath, match=rf"{theirs}: a folder owned by nobody \(uid {OTHER}\), not by you"):
        controller_files.write(theirs / "rollouts" / "fleet.json", "{}")
    assert not (theirs / "rollouts").exists()
    with pytest.raises(StateError, match=f"{theirs}: a folder owned by nobody"):
        StateLock(theirs / "rollouts" / "fleet.json").acquire("tools/rollout fleet.py")
    os.chown(theirs, 0, 0)
    below = foreign(theirs / "manifests")   # a subfolder too
    with pytest.raises(controller_files.UnsafePath, match=f"{below}: a folder owned by nobody"):
        controller_files.ensure_dir(below / "h1")


def test_a_gpufleet_folder_others_may_write_is_refused_and_a_loose_own_one_tightened(tmp_path):
    top = tmp_path / ".gpufleet"
    top.mkdir()
    os.chmod(top, 0o777)
    with pytest.raises(controller_files.UnsafePath, match=rf"{top}: a folder others may write \(mode 0777\)"):
        controller_files.ensure_dir(top / "factplans")
    os.chmod(top, 0o755)   # an earlier version's: nobody else could write in it
    controller_files.ensure_dir(top / "factplans")
    assert os.stat(top).st_mode & 0o777 == 0o700


@needs_root
def test_files_are_checked_on_the_descriptor_they_are_read_from(tmp_path):
    top = tmp_path / ".gpufleet" / "rollouts"
    controller_files.write(top / "fleet.json", '{"format": 1}')
    assert controller_files.read(top / "fleet.json") == b'{"format": 1}'
    (top / "link.json").symlink_to(top / "fleet.json")
    with pytest.raises(controller_files.UnsafePath, match="a symbolic link"):
        controller_files.read(top / "link.json")
    os.chown(top / "fleet.json", OTHER, OTHER)
    with pytest.raises(controller_files.UnsafePath, match="a file owned by nobody"):
        controller_files.read(top / "fleet.json")
    with pytest.raises(StateError, match="a file owned by nobody"):
        RolloutState.load(top / "fleet.json", "inventory", "fleet.py")
    os.chown(top / "fleet.json", 0, 0)
    os.chmod(top / "fleet.json", 0o646)
    with pytest.raises(controller_files.UnsafePath, match="a file others may write"):
        controller_files.read(top / "fleet.json")


def test_the_state_lock_does_not_follow_a_symbolic_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / ".gpufleet" / "rollouts" / "fleet.json"
    controller_files.ensure_dir(state.parent)
    (state.parent / "fleet.json.lock").symlink_to(victim)
    with pytest.raises(StateError, match="a symbolic link"):
        StateLock(state).acquire("tools/rollout fleet.py")
    assert victim.read_text() == "precious\n"


@needs_root
def test_a_fact_plan_in_a_foreign_folder_is_never_run(tmp_path, caplog):
    plans = foreign(tmp_path / ".gpufleet" / "factplans", uid=0)
    os.chown(tmp_path / ".gpufleet", OTHER, OTHER)
    (plans / "h.json").write_text(json.dumps({"format": 2, "facts": [["pyinfra.facts.server.Arch", "{}"]]}))
    os.chmod(plans / "h.json", 0o600)
    assert factcache.read_plan(plans / "h.json", "h") == []
    assert "a folder owned by nobody" in caplog.text


def manifest(**changes):
    doc = mf.build(host="h1", ident="20261201T120000Z", created=0.0, reason="driver upgrade a -> b",
                   packages={"nvidia-open": "580.82.07-1"}, holds=["nvidia-open"],
                   etc_files={"/etc/apt/sources.list.d/cuda.list": "0" * 64}, driver={"installed": "580.82.07"},
                   gpus=[], disk_snapshot=None)
    doc.update(changes)
    return doc


@pytest.mark.parametrize("changes,problem", [
    ({"etc_tarball": "/home/student/evil.tar.gz"}, "etc_tarball '/home/student/evil.tar.gz' is not the archive gpufleet wrote"),
    ({"etc_tarball": "/var/lib/gpufleet/manifests/../../../../tmp/x.etc.tar.gz"}, "is not the archive gpufleet wrote"),
    ({"etc_tarball": "/var/lib/gpufleet/manifests/20261201T000000Z.etc.tar.gz"}, "is not the archive gpufleet wrote"),
    ({"etc_files": {"/etc/../root/.ssh/authorized_keys": "0" * 64}}, "is not one gpufleet records"),
    ({"etc_files": {"/root/.ssh/authorized_keys": "0" * 64}}, "is not one gpufleet records"),
    ({"holds": ["nvidia-open; reboot"]}, "is not a dpkg package name"),
    ({"extra": 1}, "unknown key 'extra'"),
    ({"host": "h2"}, "host 'h2' is not 'h1'"),
])
def test_a_manifest_gpufleet_did_not_write_is_refused_on_load(tmp_path, changes, problem):
    assert mf.manifest_problems(manifest(), "h1") == []
    path = tmp_path / ".gpufleet" / "manifests" / "h1" / "20261201T120000Z.json"
    controller_files.write(path, json.dumps(manifest(**changes)))
    with pytest.raises(mf.ManifestError, match="not a manifest gpufleet wrote, refused") as caught:
        mf.load_manifest(path, "h1")
    assert problem in str(caught.value) and str(path) in str(caught.value)


def test_a_foreign_etc_tarball_plans_no_extraction_as_root():
    """Even handed to the restore step directly (not loaded from a file): refused at planning,
    no `tar -C / -xzf` planned."""
    from tests.unit.test_rollback_toolkit_components import NAME, _host
    from testing.ubuntu_host import canned, on_host, planned_operations
    from gpufleet.deploys.rollback import restore
    from gpufleet.rollout.context import RolloutContext

    doc = manifest(host=NAME, etc_tarball="/tmp/evil.tar.gz")
    host, state = _host()
    ctx = RolloutContext(target="580.82.07", manifests={NAME: doc})
    from pyinfra.api.exceptions import PyinfraError

    with canned({NAME: host}), on_host(state, NAME) as h:
        with pytest.raises(PyinfraError, match="No hosts remaining"):   # its only host refused
            restore(ctx)
        ops = planned_operations(state, h)
    assert not [c for _, commands in ops for c in commands if "tar" in c]
    assert "is not the archive gpufleet wrote" in ctx.reasons[NAME]


def test_control_characters_from_a_host_are_escaped_in_terminal_and_markdown():
    from gpufleet.apps.report import render

    name = "train\x1b[2J\x1b]0;pwned\x07\u202egpj.py\n| forged | row |"
    assert printable(name) == "train\\x1b[2J\\x1b]0;pwned\\x07\\u202egpj.py\\x0a| forged | row |"
    assert printable("line one\nline two\x1b[A", newlines=True) == "line one\nline two\\x1b[A"
    from gpufleet.config.failures import stop_line   # every refusal line, the rollout's and pyinfra's log
    assert "\x1b" not in stop_line("h1", "refused", "rollout", f"busy: GPU processes running (7 {name})", "drain")
    for key in ("host", "problems", "held_packages"):
        cell = render.cell({"host": name, "status": "unreachable", "problems": name, "held_packages": [name]}, key)
        assert "\x1b" not in cell and "\u202e" not in cell and "\n" not in cell and "\x07" not in cell, (key, cell)


def test_packed_answers_that_inflate_beyond_the_cap_are_refused():
    script = factcache.Script()
    bomb = gzip.compress(b"\n" * (factcache.MAX_ANSWERS + 1))
    lines = [factcache._PACKED, base64.b64encode(bomb).decode()]
    assert len(lines[1]) < 200_000   # small on the wire
    assert script.answers(lines) == {}
    with pytest.raises(ValueError, match="inflate beyond"):
        factcache.gunzip_capped(bomb)
    assert factcache.gunzip_capped(gzip.compress(b"ok\n")) == b"ok\n"
