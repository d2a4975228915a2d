"""What is recorded of a host before its driver changes: the packages a manifest lists, a disk
snapshot where the tier says so, the manifest and the /etc archive, copied to the controller.
Shared by the rollout's snapshot deploy (deploys/upgrade.py) and the driver deploy's in-place
upgrade (driver_upgrade_in_place), so both record the same way."""
from __future__ import annotations

import time
from typing import Any

from pyinfra import host

from gpufleet.explain import explained
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.kernel import DriverState
from gpufleet.facts.packages import HeldPackages, PackageVersions
from gpufleet.facts.system import EtcFiles
from gpufleet.rollout import manifest as mf
from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.snapshot import snapshot_name
from gpufleet.config.settings import host_settings
from gpufleet.operations.snapshot import (controller_snapshot_taken, copied_to_controller, disk_snapshot_taken,
                                          etc_archived, manifest_written)


def installed_packages() -> dict[str, Any]:
    """The host's driver, CUDA, cuDNN, toolkit and prebuilt module packages (manifest patterns),
    the CUDA toolkit's own -X-Y libraries (held at its release by deploys/driver.py), and, where
    Ubuntu's prebuilt modules are installed, the kernel flavour metapackages that move with them
    (held with them by deploys/driver.py). All recorded in the manifest, put back by rollback."""
    installed = host.get_fact(PackageVersions, packages=list(mf.PACKAGE_PATTERNS))
    more = mf.toolkit_component_patterns(installed) + mf.kernel_metapackages(installed)
    if more:
        found = host.get_fact(PackageVersions, packages=more)
        installed = {**installed, **found}
    return installed


def snapshot_and_manifest(ctx: RolloutContext) -> None:
    """The disk snapshot (rollout_snapshot), the /etc archive and the manifest, on the host and
    copied to the controller (ctx.manifests_dir)."""
    settings = host_settings(host)
    created = time.time()
    ident = mf.manifest_id(created)
    gpus = host.get_fact(GpuState)
    driver = host.get_fact(DriverState)
    installed = installed_packages()
    holds = host.get_fact(HeldPackages)
    etc = host.get_fact(EtcFiles, patterns=list(mf.ETC_FILES))
    disk: dict[str, Any] = {}
    if settings.rollout_snapshot in ("lvm", "btrfs", "zfs"):
        disk_snapshot_taken(name=explained(f"Snapshot ({settings.rollout_snapshot})", f"Take an {settings.rollout_snapshot} snapshot of "
                                                                            f"{settings.rollout_snapshot_target}"),
                            provider=settings.rollout_snapshot, target=settings.rollout_snapshot_target,
                            ident=ident, size=settings.rollout_snapshot_size, record=disk)
    elif settings.rollout_snapshot == "command":
        variables = {"host": host.name, "address": host.data.get("ssh_hostname") or host.name,
                     "tier": settings.tier, "snapshot": f"{snapshot_name(ident)}-{host.name}", "id": ident,
                     "from_version": driver.userspace_version or "", "to_version": ctx.target}
        controller_snapshot_taken(name=explained("Snapshot (command)", "Take a disk snapshot with the snapshot command (on the controller)"),
                                  template=list(settings.rollout_snapshot_command), variables=variables, record=disk)
    remote = f"{mf.HOST_DIR}/{ident}.json"
    tarball = f"{mf.HOST_DIR}/{ident}.etc.tar.gz"
    etc_archived(name=explained("Archive /etc files", "Archive the apt sources, pins, keyrings and GPU configuration files"),
                 tarball=tarball, paths=sorted(etc))
    name = host.name

    def build() -> str:
        doc = mf.build(host=name, ident=ident, created=created,
                       reason=f"driver upgrade {driver.userspace_version} -> {ctx.target}" + "".join(
                           f", {change}" for change in mf.stack_changes(installed, ctx.stack.get(name, {}))),
                       packages=installed, holds=holds, etc_files=etc,
                       driver={"loaded": driver.module_version, "installed": driver.userspace_version,
                               "flavour": driver.module_flavour},
                       gpus=mf.gpu_record(gpus), disk_snapshot=disk if settings.rollout_snapshot != "none" else None)
        ctx.manifests[name] = doc
        return mf.dumps(doc)

    manifest_written(name=explained("Write the manifest", f"Write the manifest {remote}"), dest=remote, build=build)
    local = ctx.manifests_dir / host.name
    ctx.manifest_paths[host.name] = str(local / f"{ident}.json")
    copied_to_controller(name=explained("Copy the manifest", "Copy the manifest and the /etc archive to the controller"),
                         pairs=[(remote, str(local / f"{ident}.json")), (tarball, str(local / f"{ident}.etc.tar.gz"))])
