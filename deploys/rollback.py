"""Roll a host back to what a manifest recorded: package versions, holds, apt/GPU /etc files.

    tools/rollback INVENTORY HOST [HOST ...] [--manifest FILE] [--reboot]

Steps (run by gpufleet/apps/rollout/rollback.py, each its own pyinfra run):
    restore   refused (busy) while GPU work runs, unless --force: nvidia-smi's processes or a
              process holding /dev/nvidia*, at planning and again in the command that starts the
              package change; then unhold -> apt-get install --allow-downgrades pkg=recorded version ... (and remove
              driver packages the manifest did not have, e.g. a newer pinning package) -> hold
              exactly what was held; then put back recorded /etc files that changed since
    reboot    (with --reboot) only when the loaded module is not the recorded one
    tune, validate   as in deploys/upgrade.py, against the recorded versions and settings
When packages are not enough (a broken kernel, a damaged root file system) the manifest names the
disk snapshot taken before the upgrade and how to restore it; rollback prints it.
"""
from __future__ import annotations

from collections.abc import Generator

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, deploy, operation

from gpufleet.explain import explained
from gpufleet.facts.packages import HeldPackages
from gpufleet.facts.system import EtcFiles
from gpufleet.rollout import manifest as mf
from gpufleet.rollout import snapshot as snap
from gpufleet.rollout.context import RolloutContext
from gpufleet.catalog.cuda_stack import STACK_FAMILIES, STACK_GLOBS
from gpufleet.operations.driver import stack_recorded
from gpufleet.operations.drain import gpu_work
from gpufleet.operations.driver_upgrade import package_change_settled, packages_at_versions
from gpufleet.operations.snapshot import disk_snapshot_restored
from gpufleet.operations.manifest_steps import installed_packages


@operation()
def etc_files_restored(tarball: str, recorded: dict[str, str]) -> Generator[StringCommand, None, None]:
    """Put back, from the manifest's archive, the recorded files whose content changed since.

    + tarball: the /etc archive on the host
    + recorded: {path: sha256} from the manifest
    """
    if not mf.is_manifest_tarball(tarball):
        raise ValueError(f"not an archive gpufleet wrote: {tarball!r}")   # manifest_problems refused it already
    now = host.get_fact(EtcFiles, patterns=sorted(recorded)) if recorded else {}
    changed = sorted(p for p, sha in recorded.items() if now.get(p) != sha)
    if not changed:
        host.noop("the recorded /etc files are unchanged")
        return
    yield StringCommand("tar", "-C", "/", "-xzf", QuoteString(tarball), "--",
                        *(QuoteString(p.lstrip("/")) for p in changed))


@deploy("Restore packages")
def restore(ctx: RolloutContext) -> None:
    doc = ctx.manifests[host.name]
    problems = mf.manifest_problems(doc, host.name)
    if problems:   # its archive is extracted into / as root: only the one gpufleet wrote
        ctx.refuse(host, f"manifest {doc.get('id') if isinstance(doc, dict) else '?'} is not one gpufleet wrote: "
                         + "; ".join(problems[:4]), "roll back from a manifest tools/rollout took (tools/rollback "
                                                   "--manifest), or restore the host by hand")
        return
    # the project's one idle test, as the rollout and all.py make it: nvidia-smi's processes and
    # the holders of a GPU device node at planning, and again in the very command that swaps the
    # packages (a job started since is seen there, not broken); --force: neither
    busy = gpu_work(host)
    if busy and not ctx.force:
        ctx.refuse(host, f"busy: GPU work running ({', '.join(busy)}); nothing changed",
                   "let it finish (or drain the host) and re-run, or roll back anyway with --force", outcome="busy")
        return
    installed = installed_packages()   # with the kernel metapackages prebuilt modules follow
    package_change_settled(name=explained("Settle dpkg", "Let an earlier package change finish; repair an interrupted dpkg"))
    todo = mf.rollback_installs(doc, installed)
    install = dict(spec.split("=", 1) for spec in todo)
    remove = mf.rollback_removals(doc, installed)
    packages_at_versions(name=explained("Restore package versions", f"Put back the package versions of manifest {doc['id']} (unhold, "
                                                                                 "downgrade, hold)"),
                         install=install, remove=remove, hold=list(doc["holds"]), downgrade=True,
                         require_idle=not ctx.force)
    # gpufleet's record says what it installed: the manifest's CUDA toolkit / cuDNN releases again
    # (else the gate would take the rolled-back packages for a hand change)
    stack = {p: release for p, v in doc["packages"].items()
             if any(family.match(p) for _, family in STACK_FAMILIES) and (release := mf.upstream(v))}
    if stack:
        stack_recorded(name=explained("Record the CUDA/cuDNN releases", "Record the CUDA toolkit and cuDNN releases put back"), versions=stack,
                       packages=list(STACK_GLOBS))
    extra_holds = sorted({*host.get_fact(HeldPackages)} - set(doc["holds"]) - set(remove))
    if extra_holds:
        from gpufleet.operations.holds import held
        held(name=explained("Release extra holds", "Release holds the manifest did not have"), packages=extra_holds, present=False)
    etc_files_restored(name=explained("Restore /etc files", "Put back the recorded apt sources, pins, keyrings and GPU configuration"),
                       tarball=doc["etc_tarball"], recorded=doc["etc_files"])


@deploy("Restore disk snapshot")
def restore_disk(ctx: RolloutContext, ident: str) -> None:
    """Put back the disk snapshot taken before the upgrade (a btrfs subvolume; the others are
    restored by hand, as printed), the current state kept beside it."""
    doc = ctx.manifests[host.name]
    disk = doc.get("disk_snapshot")
    if not disk or disk.get("error"):
        ctx.refuse(host, f"manifest {doc['id']} records no disk snapshot"
                         + (f" ({disk['error']})" if disk and disk.get("error") else " (rollout_snapshot was none)"),
                   "roll back the packages without --disk-snapshot", area="rollout_snapshot")
        return
    try:
        commands = snap.host_restore(disk, ident)
    except snap.SnapshotError as exc:
        ctx.refuse(host, str(exc), f"restore it by hand: {disk.get('restore')}", area="rollout_snapshot")
        return
    disk_snapshot_restored(name=explained(f"Restore {commands[1][2]}",
                                         f"Put {commands[1][2]} back to the {disk['provider']} snapshot "
                                         f"{disk['name']} (the current one is kept as {commands[1][3]})"),
                           target=commands[1][2], commands=[list(c) for c in commands], hint=disk.get("restore", ""))
