"""Snapshot operations: a disk snapshot (lvm/btrfs/zfs on the host, or a command on the
controller), the /etc archive, the manifest on the host, and its copy on the controller."""
from __future__ import annotations

import functools
from collections.abc import Generator
from pathlib import Path
from typing import Any, Callable

from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation

from gpufleet.controller import controller_files
from gpufleet.config.failures import fail_now
from gpufleet.operations.remote_files import Fetch, LazyWrite
from gpufleet.rollout import snapshot as snap

# $@: tar's arguments. The archive holds /etc files (keyrings, daemon.json): created 0600.
_TAR_PRIVATE = 'umask 077 && exec tar "$@"'


@operation(is_idempotent=False)
def disk_snapshot_taken(provider: str, target: str, ident: str, size: str, record: dict[str, Any]
                        ) -> Generator[StringCommand, None, None]:
    """Take the host's disk snapshot with lvm, btrfs or zfs; what was made goes into `record`.

    + provider: lvm | btrfs | zfs
    + target: VG/LV, subvolume path, or dataset
    + ident: manifest id (the snapshot is called gpufleet-<ident>)
    + size: LVM copy-on-write size
    + record: dict filled with provider, name and restore hint
    """
    plan = snap.host_snapshot(provider, target, ident, size)
    record.update(plan.describe())
    yield StringCommand(snap.shell(plan.commands))


@operation(is_idempotent=False)
def disk_snapshot_restored(target: str, commands: list[list[str]], hint: str
                           ) -> Generator[StringCommand, None, None]:
    """Put a btrfs subvolume back to its snapshot (commands from gpufleet.rollout.snapshot.host_restore).

    + target: the subvolume; refused when it is a mount point (restore that by booting the snapshot)
    + commands: argv lists run in order
    + hint: the manual restore, printed when refused
    """
    yield StringCommand("sh", "-c", QuoteString(
        'if mountpoint -q "$1"; then echo "gpufleet: $1 is a mount point: restore it by hand: $2" >&2; exit 1; fi'),
        "check", QuoteString(target), QuoteString(hint))
    for argv in commands:
        yield StringCommand(*(QuoteString(a) for a in argv))


def _run_controller_command(state: State, host: Host, template: list[str], variables: dict[str, Any],
                            record: dict[str, Any]) -> bool:
    try:
        record.update(snap.run_command(template, variables))
    except snap.SnapshotError as exc:
        record["error"] = str(exc)
        return fail_now(state, host, "rollout_snapshot", f"snapshot failed: {exc}",
                               "make rollout_snapshot_command work for this host (run it by hand), or set "
                               "rollout_snapshot: none")
    return True


@operation(is_idempotent=False)
def controller_snapshot_taken(template: list[str], variables: dict[str, Any], record: dict[str, Any]
                              ) -> Generator[FunctionCommand, None, None]:
    """Run the `command` snapshot provider on the controller (argv, no shell), for this host.

    + template: argv with {host} {address} {snapshot} {tier} ... fields
    + variables: the values of those fields
    + record: dict filled with the command, its output's last line (snapshot name) or the error
    """
    snap.command_argv(template, variables)  # bad templates fail at planning time
    yield FunctionCommand(_run_controller_command, (template, variables, record), {})


@operation(is_idempotent=False)
def etc_archived(tarball: str, paths: list[str]) -> Generator[StringCommand, None, None]:
    """Archive the recorded /etc (and keyring) files on the host."""
    rel = [p.lstrip("/") for p in paths]
    yield StringCommand("install", "-d", "-m", "700", QuoteString(str(Path(tarball).parent)))
    tar = ("sh", "-c", QuoteString(_TAR_PRIVATE), "gpufleet-etc-archive")
    if rel:
        yield StringCommand(*tar, "-C", "/", "-czf", QuoteString(tarball), "--", *(QuoteString(p) for p in rel))
    else:
        yield StringCommand(*tar, "-czf", QuoteString(tarball), "-T", "/dev/null")




@operation(is_idempotent=False)
def manifest_written(dest: str, build: Callable[[], str]) -> Generator[StringCommand | LazyWrite, None, None]:
    """Write the manifest JSON on the host (built when it runs, after the disk snapshot), 0600
    in a 0700 directory."""
    yield StringCommand("install", "-d", "-m", "700", QuoteString(str(Path(dest).parent)))
    yield LazyWrite(dest, build, on_error=lambda state, host: fail_now(
        state, host, "rollout", f"could not write the manifest {dest} on the host",
        "make room or fix permissions under its folder, then re-run the rollout"))


def _cannot_copy(remote: str) -> Callable[[State, Host], bool]:
    return lambda state, host: fail_now(
        state, host, "rollout", f"could not copy {remote} from the host to the controller",
        "check that it exists and is readable on the host, then re-run")


@operation(is_idempotent=False)
def copied_to_controller(pairs: list[tuple[str, str]]) -> Generator[Fetch, None, None]:
    """Copy files from the host to the controller: [(remote path, local path), ...], read with
    the operation's privileges, written 0600 in 0700 directories."""
    for remote, local in pairs:
        yield Fetch(remote, functools.partial(controller_files.write, local), _cannot_copy(remote))
