"""Snapshot providers: the exact commands of lvm/btrfs/zfs, the command provider run for real on
the controller (argv templating, no shell), and what a manifest says an upgrade moves / a rollback
puts back."""
import stat

import pytest

from gpufleet.rollout import manifest as mf
from gpufleet.rollout import snapshot as snap
from gpufleet.rollout.moves import MoveRefusal, RolloutMove, rollout_move


def test_lvm_commands():
    s = snap.host_snapshot("lvm", "vg0/root", "20260101T000000Z", "20G")
    assert s.commands == (("lvcreate", "--snapshot", "--name", "gpufleet-20260101T000000Z", "--size", "20G", "vg0/root"),)
    assert s.name == "vg0/gpufleet-20260101T000000Z"
    assert s.restore.startswith("lvconvert --merge vg0/gpufleet-20260101T000000Z")
    with pytest.raises(snap.SnapshotError):
        snap.host_snapshot("lvm", "/dev/vg0/root", "x")


def test_btrfs_and_zfs_commands():
    b = snap.host_snapshot("btrfs", "/", "ID")
    assert b.commands == (("mkdir", "-p", "/.gpufleet-snapshots"),
                          ("btrfs", "subvolume", "snapshot", "-r", "/", "/.gpufleet-snapshots/gpufleet-ID"))
    z = snap.host_snapshot("zfs", "rpool/ROOT/debian", "ID")
    assert z.commands == (("zfs", "snapshot", "-r", "rpool/ROOT/debian@gpufleet-ID"),)
    assert z.restore.startswith("zfs rollback -r rpool/ROOT/debian@gpufleet-ID")
    assert snap.shell(b.commands) == "mkdir -p /.gpufleet-snapshots && btrfs subvolume snapshot -r / /.gpufleet-snapshots/gpufleet-ID"


def test_command_provider_fills_each_word_without_a_shell(tmp_path):
    evil = "gpu1; touch /tmp/pwned-gpufleet $(id)"
    argv = snap.command_argv(["snapctl", "create", "--host={host}", "{snapshot}"], {"host": evil, "snapshot": "s1"})
    assert argv == ["snapctl", "create", f"--host={evil}", "s1"]   # one word, shell syntax untouched
    assert snap.command_argv("snapctl create '{host} x'", {"host": "a b"}) == ["snapctl", "create", "a b x"]
    with pytest.raises(snap.SnapshotError, match="unknown field"):
        snap.command_argv(["x", "{nope}"], {"host": "h"})
    with pytest.raises(snap.SnapshotError, match="plain"):
        snap.command_argv(["x", "{host.__class__}"], {"host": "h"})


def test_command_provider_runs_for_real(tmp_path):
    log = tmp_path / "calls"
    script = tmp_path / "cloud-snapshot"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" \"env=$GPUFLEET_HOST\" >> {log}\necho snap-0042\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    evil = "gpu1;touch$IFS" + str(tmp_path / "pwned")
    res = snap.run_command([str(script), "--instance", "{host}", "--name", "{snapshot}"],
                           {"host": evil, "snapshot": "gpufleet-ID-gpu1", "address": "10.0.0.1"})
    assert res["name"] == "snap-0042"
    assert log.read_text().splitlines() == ["--instance", evil, "--name", "gpufleet-ID-gpu1", f"env={evil}"]
    assert not (tmp_path / "pwned").exists()
    fail = tmp_path / "fail"
    fail.write_text("#!/bin/sh\necho quota exceeded >&2\nexit 3\n")
    fail.chmod(0o755)
    with pytest.raises(snap.SnapshotError, match="exited 3: quota exceeded"):
        snap.run_command([str(fail)], {"host": "h"})


def test_command_provider_never_shows_its_arguments(tmp_path):
    """The argv may hold a token: neither the record (it goes into the manifest) nor an error
    message carries anything but the program's name."""
    token = "tok-3f9a1c-secret"
    ok = tmp_path / "cloud-snapshot"
    ok.write_text("#!/bin/sh\necho snap-1\n")
    ok.chmod(0o755)
    record = snap.run_command([str(ok), "--token", token, "{host}"], {"host": "h"})
    assert token not in repr(record) and record["command"] == "cloud-snapshot"
    fail = tmp_path / "fail"
    fail.write_text("#!/bin/sh\nexit 3\n")
    fail.chmod(0o755)
    for argv in ([str(fail), "--token", token], [str(tmp_path / "missing"), "--token", token]):
        with pytest.raises(snap.SnapshotError) as info:
            snap.run_command(argv, {"host": "h"})
        assert token not in str(info.value) and token not in repr(info.value.__cause__)


INSTALLED = {
    "nvidia-open": "580.95.05-1", "nvidia-driver-cuda": "580.95.05-1", "libcuda1": "580.95.05-1",
    "nvidia-fabricmanager": "580.95.05-1", "nvidia-kernel-open-dkms": "580.95.05-1",
    "nvidia-driver-pinning-580.95.05": "580.95.05-1", "cuda-toolkit-13-0": "13.0.2-1",
    "libcudnn9-cuda-13": "9.16.0.29-1", "libnvidia-container1": "1.18.0-1", "cuda-keyring": "1.1-1",
}


def test_upgrade_moves_driver_packages_and_the_version_pin_only():
    assert mf.driver_packages(INSTALLED, "580.95.05") == [
        "libcuda1", "nvidia-driver-cuda", "nvidia-fabricmanager", "nvidia-kernel-open-dkms", "nvidia-open"]
    available = {n: ["580.126.09-1", "580.95.05-1"] for n in INSTALLED} | {"nvidia-driver-pinning-580.126.09": ["580.126.09-1"]}
    move = rollout_move(INSTALLED, ["nvidia-open", "libcudnn9-cuda-13"], available, "580.126.09", {}, {}, {}, False)
    assert isinstance(move, RolloutMove)
    install, remove, hold = move.install, list(move.remove), list(move.hold)
    assert install == {"libcuda1": "580.126.09-1", "nvidia-driver-cuda": "580.126.09-1", "nvidia-fabricmanager": "580.126.09-1",
                       "nvidia-kernel-open-dkms": "580.126.09-1", "nvidia-open": "580.126.09-1",
                       "nvidia-driver-pinning-580.126.09": "580.126.09-1"}
    assert remove == ["nvidia-driver-pinning-580.95.05"]
    assert hold == ["libcudnn9-cuda-13", "nvidia-open"]
    refused = rollout_move(INSTALLED, [], {"nvidia-open": ["580.126.09-1"]}, "580.126.09", {}, {}, {}, False)
    assert isinstance(refused, MoveRefusal) and refused.area == "driver_version"
    assert "nvidia-fabricmanager" in refused.reason and "nvidia-driver-pinning-580.126.09" in refused.reason


def test_rollback_puts_recorded_versions_back_pin_first():
    doc = mf.build(host="h", ident="ID", created=0.0, reason="r", packages=INSTALLED, holds=["nvidia-open"],
                   etc_files={}, driver={}, gpus=[], disk_snapshot=None)
    now = dict(INSTALLED, **{"nvidia-open": "580.126.09-1", "nvidia-driver-pinning-580.95.05": None,
                             "nvidia-driver-pinning-580.126.09": "580.126.09-1"})
    todo = mf.rollback_installs(doc, now)
    assert todo == ["nvidia-driver-pinning-580.95.05=580.95.05-1", "nvidia-open=580.95.05-1"]
    assert mf.rollback_removals(doc, now) == ["nvidia-driver-pinning-580.126.09"]


def test_btrfs_restore_swaps_the_subvolume_and_keeps_the_current_one():
    plan = snap.host_snapshot("btrfs", "/srv/data", "20260101T000000Z")
    assert plan.describe()["target"] == "/srv/data"
    cmds = snap.host_restore(plan.describe(), "R1")
    assert cmds == (
        ("btrfs", "subvolume", "snapshot", "/srv/data/.gpufleet-snapshots/gpufleet-20260101T000000Z",
         "/srv/data.gpufleet-restore-R1"),
        ("mv", "-T", "/srv/data", "/srv/data.gpufleet-replaced-R1"),
        ("mv", "-T", "/srv/data.gpufleet-restore-R1", "/srv/data"),
    )


def test_restore_of_the_root_or_other_providers_is_left_to_the_operator():
    root = snap.host_snapshot("btrfs", "/", "20260101T000000Z").describe()
    with pytest.raises(snap.SnapshotError, match="booting"):
        snap.host_restore(root, "R1")
    with pytest.raises(snap.SnapshotError, match="not automated"):
        snap.host_restore(snap.host_snapshot("zfs", "rpool/ROOT", "x").describe(), "R1")
    # manifests written before the target was recorded: the target comes from the name
    old = {"provider": "btrfs", "name": "/srv/data/.gpufleet-snapshots/gpufleet-x", "restore": ""}
    assert snap.host_restore(old, "R1")[1][2] == "/srv/data"
