"""Disk snapshots taken before an upgrade: lvm, btrfs, zfs (commands on the host) or command
(an argv run on the controller, e.g. a cloud CLI). Pure command builders plus the controller
runner; deploys/upgrade.py yields them as operations.

Every snapshot is named `gpufleet-<manifest id>` (lvm/btrfs/zfs) and the name, with how to
restore it, goes into the manifest: rollback prints it when packages are not enough.
"""
from __future__ import annotations

import os
import shlex
import string
import subprocess
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

PROVIDERS = ("none", "lvm", "btrfs", "zfs", "command")


class SnapshotError(RuntimeError):
    pass


@dataclass(frozen=True)
class HostSnapshot:
    """A snapshot made by commands on the host."""
    provider: str
    name: str                 # what was created (LV path, subvolume path, dataset@snap)
    commands: tuple[tuple[str, ...], ...]   # argv lists, run in order on the host
    restore: str              # what an operator runs to go back
    target: str = ""          # what was snapshotted

    def describe(self) -> dict[str, Any]:
        return {"provider": self.provider, "name": self.name, "restore": self.restore, "target": self.target}


def snapshot_name(ident: str) -> str:
    return f"gpufleet-{ident}"


def host_snapshot(provider: str, target: str, ident: str, size: str = "10G") -> HostSnapshot:
    """The commands of the lvm / btrfs / zfs providers for `target`."""
    name = snapshot_name(ident)
    if provider == "lvm":
        if target.count("/") != 1 or target.startswith("/"):
            raise SnapshotError(f"lvm snapshot target must be VG/LV, got {target!r}")
        vg, lv = target.split("/")
        return HostSnapshot("lvm", f"{vg}/{name}", (
            ("lvcreate", "--snapshot", "--name", name, "--size", size, f"{vg}/{lv}"),
        ), f"lvconvert --merge {vg}/{name}   # then reboot: the origin {vg}/{lv} is rolled back")
    if provider == "btrfs":
        if not target.startswith("/"):
            raise SnapshotError(f"btrfs snapshot target must be a subvolume path, got {target!r}")
        base = target.rstrip("/") or ""
        snapdir = f"{base}/.gpufleet-snapshots"
        path = f"{snapdir}/{name}"
        return HostSnapshot("btrfs", path, (
            ("mkdir", "-p", snapdir),
            ("btrfs", "subvolume", "snapshot", "-r", target, path),
        ), f"btrfs subvolume snapshot {path} <new subvolume>   # then make it the default/mounted root and reboot",
            target)
    if provider == "zfs":
        if not target or target.startswith("/"):
            raise SnapshotError(f"zfs snapshot target must be a dataset, got {target!r}")
        snap = f"{target}@{name}"
        return HostSnapshot("zfs", snap, (("zfs", "snapshot", "-r", snap),),
                            f"zfs rollback -r {snap}   # from a rescue system or boot environment")
    raise SnapshotError(f"not a host snapshot provider: {provider!r}")


def host_restore(disk: Mapping[str, Any], ident: str) -> tuple[tuple[str, ...], ...]:
    """The commands that put a btrfs subvolume back to its snapshot (tools/rollback --disk-snapshot).

    The live subvolume is kept as `<target>.gpufleet-replaced-<ident>` (with the snapshots nested
    in it: a read-only snapshot cannot move); a writable snapshot of the snapshot takes its place.
    Only for btrfs subvolumes that are not the running root or a mount point: those are restored
    by booting the snapshot (the manifest's restore hint).
    """
    provider, name, target = disk.get("provider"), disk.get("name") or "", disk.get("target") or ""
    if provider != "btrfs":
        raise SnapshotError(f"restoring a {provider} snapshot is not automated")
    if not target:
        target = name.rsplit("/.gpufleet-snapshots/", 1)[0] if "/.gpufleet-snapshots/" in name else ""
    if not target.startswith("/") or target.rstrip("/") == "" or not name.startswith(target.rstrip("/") + "/"):
        raise SnapshotError(f"the snapshot of the running root ({target or '?'}) is restored by booting it")
    target = target.rstrip("/")
    fresh, replaced = f"{target}.gpufleet-restore-{ident}", f"{target}.gpufleet-replaced-{ident}"
    return (("btrfs", "subvolume", "snapshot", name, fresh),
            ("mv", "-T", target, replaced),
            ("mv", "-T", fresh, target))


def shell(argvs: Sequence[Sequence[str]]) -> str:
    return " && ".join(" ".join(shlex.quote(a) for a in argv) for argv in argvs)


# --- command provider (controller) -------------------------------------------------------------


class _Strict(string.Formatter):
    """str.format with only plain {name} fields: no attribute/index access, no unknown names."""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, str]:
        if not field_name.isidentifier():
            raise SnapshotError(f"snapshot command: only plain {{name}} fields are allowed, got {{{field_name}}}")
        if field_name not in kwargs:
            raise SnapshotError(f"snapshot command: unknown field {{{field_name}}}; known: {', '.join(sorted(kwargs))}")
        return kwargs[field_name], field_name


def command_argv(template: Sequence[str] | str, variables: Mapping[str, Any]) -> list[str]:
    """The argv of the command provider: every template word filled in on its own.

    A host variable can never add words or shell syntax: substitution happens after splitting,
    and the result is run without a shell.
    """
    words = shlex.split(template) if isinstance(template, str) else list(template)
    if not words:
        raise SnapshotError("rollout_snapshot is `command` but rollout_snapshot_command is empty")
    values = {k: "" if v is None else str(v) for k, v in variables.items()}
    return [_Strict().vformat(word, (), values) for word in words]


def command_env(variables: Mapping[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({f"GPUFLEET_{k.upper()}": "" if v is None else str(v) for k, v in variables.items()})
    return env


def command_name(argv: Sequence[str]) -> str:
    """What messages and the manifest call the command: its program's name, never its
    arguments (a cloud CLI's argv may hold a token)."""
    return os.path.basename(argv[0]) if argv else "?"


def run_command(template: Sequence[str] | str, variables: Mapping[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """Run the command provider on the controller; raise SnapshotError when it fails."""
    argv = command_argv(template, variables)
    name = command_name(argv)
    try:
        proc = subprocess.run(argv, env=command_env(variables), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise SnapshotError(f"snapshot command {name} did not finish within {exc.timeout:g} s") from None
    except OSError as exc:
        raise SnapshotError(f"snapshot command {name} could not run: {exc.strerror}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise SnapshotError(f"snapshot command {name} exited {proc.returncode}: {' | '.join(tail)}")
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return {"provider": "command", "command": name, "name": lines[-1].strip() if lines else variables.get("snapshot"),
            "restore": f"restore the snapshot {lines[-1].strip() if lines else variables.get('snapshot')} "
                       f"with the tool that made it ({name})"}
