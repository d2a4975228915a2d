"""tools/rollback: put hosts back to a manifest (see deploys/rollback.py)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from gpufleet.config.failures import stop_line
from gpufleet.operations.drain import BUSY_MARK
from gpufleet.controller.inventory_source import InventorySource

from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.manifest import ManifestError, load_manifest


def latest_manifest(manifests_dir: Path, host: str) -> Path | None:
    found = sorted((manifests_dir / host).glob("[0-9]*T[0-9]*Z.json"))   # named by their id
    return found[-1] if found else None


def rollback(inventory: str | InventorySource, hosts: list[str], manifest: Path | None, manifests_dir: Path, reboot: bool,
             force: bool, dry_run: bool, out: TextIO = sys.stdout, from_disk: bool = False,
             assume_yes: bool = False, stdin: TextIO | None = None, prog: str = "tools/rollback") -> int:
    from gpufleet.controller import hostlock, staging
    from gpufleet.rollout import progress

    hostlock.install()  # each step locks its hosts at their first change (issue 14: no two at once)
    staging.install()  # sudo transfers stage in the login user's private folder
    t0 = time.monotonic()
    stdin = stdin if stdin is not None else sys.stdin
    # no -y and no one to ask: no further than the dry run (pyinfra's rule)
    unattended = not dry_run and not assume_yes and not progress.is_terminal(stdin)
    asked = hosts
    hosts = _not_excluded(inventory, hosts, out)
    if asked and not hosts:
        return 0
    docs = _manifests(inventory, hosts, manifest, manifests_dir, out)
    if isinstance(docs, int):
        return docs
    if not (dry_run or unattended) and not progress.confirmed(
            f"Roll back {len(docs)} host(s) as shown above? (-y skips this question)", assume_yes, stdin, out):
        print("not confirmed: nothing changed", file=out)
        return 1
    if dry_run or unattended:
        code = _dry_run(inventory, docs, out)
        if unattended:
            print(progress.unattended_line(prog, f"roll back {len(docs)} host(s)"), file=out, flush=True)
            return 1
        return code
    failed: dict[str, str] = {}   # host -> step: why
    code = 0
    by_target: dict[str, list[str]] = {}
    for h, doc in docs.items():
        by_target.setdefault(doc["driver"]["installed"], []).append(h)
    for target, names in by_target.items():
        ctx = RolloutContext(target=target, manifests_dir=manifests_dir, force=force)
        ctx.manifests.update({h: docs[h] for h in names})
        active = _restore(inventory, ctx, names, _steps(from_disk, reboot), failed, out)
        code = 1 if failed else code
        if not reboot:
            for h in active:
                print(f"  {h}: packages restored; reboot it to load driver {target} (or use --reboot)", file=out)
    print(f"rollback: {time.monotonic() - t0:.1f}s wall", file=out)
    return _named(failed, out) or code


def _not_excluded(inventory: str | InventorySource, hosts: list[str], out: TextIO) -> list[str]:
    """The hosts asked for, less those --exclude leaves out (each said)."""
    if not (isinstance(inventory, InventorySource) and inventory.exclude):
        return hosts
    left_out = set(inventory.excluded(inventory.load()))
    for h in [h for h in hosts if h in left_out]:
        print(f"{h}: excluded (--exclude): not rolled back", file=out)
    return [h for h in hosts if h not in left_out]


def _manifests(inventory: str | InventorySource, hosts: list[str], manifest: Path | None, manifests_dir: Path,
               out: TextIO) -> dict[str, dict[str, Any]] | int:
    """Each host's manifest, checked (ours, as gpufleet wrote it) and shown; or the exit code 2
    of an error, said, before anything runs as root on a host."""
    from .session import inventory_hosts

    known = inventory_hosts(inventory)
    missing = [h for h in hosts if h not in known]
    if missing:
        print(f"error: not in {inventory}: {', '.join(missing)}", file=out)
        return 2
    if manifest and len(hosts) != 1:
        print("error: --manifest goes with exactly one host", file=out)
        return 2
    docs = {}
    for h in hosts:
        path = manifest or latest_manifest(manifests_dir, h)
        if not path or not Path(path).exists():
            print(f"error: no manifest for {h} in {manifests_dir / h}", file=out)
            return 2
        try:   # ours and as gpufleet wrote it, before anything runs as root on the host
            docs[h] = load_manifest(path, h)
        except ManifestError as exc:
            print(f"error: {exc}", file=out)
            return 2
        _show(h, path, docs[h], out)
    return docs


def _show(h: str, path: Path, doc: dict[str, Any], out: TextIO) -> None:
    print(f"{h}: manifest {path} ({doc['reason']}, taken {time.strftime('%F %T', time.localtime(doc['created']))})",
          file=out)
    print(f"  driver back to {doc['driver']['installed']} (was loaded: {doc['driver']['loaded']}); "
          f"{len(doc['packages'])} packages, holds: {' '.join(doc['holds']) or 'none'}", file=out)
    disk = doc.get("disk_snapshot")
    if disk:
        print(f"  disk snapshot taken before the upgrade: {disk.get('provider')} {disk.get('name')}", file=out)
        print(f"  if packages are not enough, restore it (--disk-snapshot does it for btrfs subvolumes): "
              f"{disk.get('restore')}", file=out)
    else:
        print("  no disk snapshot was configured (rollout_snapshot: none): packages and /etc files only", file=out)


def _dry_run(inventory: str | InventorySource, docs: dict[str, dict[str, Any]], out: TextIO) -> int:
    """Read nothing, change nothing: only whether each host answers, so that a dry run does not
    promise a rollback the real one could not reach."""
    from .session import run_step

    result = run_step(inventory, list(docs), _answers, reasons={})
    for h in result.ok:
        print(f"  {h}: reachable", file=out, flush=True)
    return _named({h: f"dry run: {why}" for h, why in result.failed.items()}, out, dry_run=True)


def _steps(from_disk: bool, reboot: bool) -> list[tuple[str, Callable[..., Any]]]:
    """The rollback's steps, in order."""
    from gpufleet.deploys import rollback as steps
    from gpufleet.deploys import upgrade

    from .runner import tune_and_cdi

    plan: list[tuple[str, Callable[..., Any]]] = [("restore", steps.restore)]
    if from_disk:
        plan.append(("disk snapshot", steps.restore_disk))
    if reboot:
        # as the rollout after its reboot: the tuning, and the CDI spec the restored driver
        # made stale (else the next all.py regenerates it: not a no-op)
        plan += [("reboot", upgrade.reboot), ("tune", tune_and_cdi), ("validate", upgrade.validate)]
    return plan


def _restore(inventory: str | InventorySource, ctx: RolloutContext, names: list[str],
             plan: list[tuple[str, Callable[..., Any]]], failed: dict[str, str], out: TextIO) -> list[str]:
    """Run the steps on the hosts of one target; the hosts that came through every step (the
    others in `failed`, each with its step and why)."""
    from gpufleet.deploys import rollback as steps

    from .session import run_step

    active = list(names)
    for step, func in plan:
        t = time.monotonic()
        extra = (time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),) if func is steps.restore_disk else ()
        result = run_step(inventory, active, func, ctx, *extra, reasons=ctx.reasons)
        for h in result.ok:
            print(f"  {h}: {step} ok ({time.monotonic() - t:.1f}s)", file=out, flush=True)
        for h, why in result.failed.items():
            # GPU work found at planning, or by the idle check in the package change's command
            busy = ctx.outcomes.get(h) == "busy" or BUSY_MARK in why
            print(f"  {h}: {step} {'BUSY, not rolled back' if busy else 'FAILED'}: {why}", file=out, flush=True)
            active.remove(h)
            failed[h] = f"{step}: {why}"
    return active


def _answers() -> None:
    """The dry run's step: connecting is the whole test."""


def _named(failed: dict[str, str], out: TextIO, dry_run: bool = False) -> int:
    """1 when a host failed or was not reached, each named; else 0."""
    for h, why in failed.items():
        print(stop_line(h, "failed", "rollback", why,
                        "bring the host back (or correct its ssh_* data in the inventory) and re-run "
                        "tools/rollback for it" if "could not connect" in why
                        else "see the step's output above (-v for pyinfra's log), fix the host and re-run "
                             "tools/rollback for it"), file=out, flush=True)
    if failed:
        print(f"FAILED: {len(failed)} host(s) {'a rollback could not reach' if dry_run else 'not rolled back'}: "
              f"{', '.join(failed)}", file=out, flush=True)
    return 1 if failed else 0
