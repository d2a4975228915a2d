"""The apt sources and keys the driver and Docker areas write, as steps both they and a first
converge's early install (deploys/bootstrap.py) call: one writer per file.

On a host's first converge deploys/bootstrap.py writes them all first, reads the index once and
installs every package of the run in one transaction; it records here that it did, and the
areas then leave their sources to it (`written_early`) instead of writing the same files again.
Run on their own (`pyinfra INVENTORY deploys/driver.py`), or on a converged host, the areas
write them as before.
"""
from __future__ import annotations

from io import StringIO

from pyinfra import host
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import apt, files
from pyinfra.operations.util import any_changed

from gpufleet.config.hostcontext import host_context
from gpufleet.explain import explained
from gpufleet.operations import docker as docker_ops
from gpufleet.operations.apt_index import lists_refreshed
from gpufleet.operations.driver import archive_components, repo_key
from gpufleet.plans.docker import AptSource, DockerPlan
from gpufleet.plans.driver import DriverPlan
from gpufleet.plans.repos import CUDA_SOURCE

MANAGED = "# Managed by gpufleet (deploys/driver.py). Do not edit: changes are reverted.\n"

def written_early() -> list[OperationMeta] | None:
    """The operations that write this host's sources earlier in this run (None: the area writes them)."""
    early: list[OperationMeta] | None = host_context(host).sources_written_early
    return early


def mark_written_early(ops: list[OperationMeta]) -> None:
    host_context(host).sources_written_early = ops


def cuda_sources(plan: DriverPlan, refresh: bool = True) -> list[OperationMeta]:
    """NVIDIA's CUDA repository (key checked by fingerprint), or the distribution's components;
    returns the operations that change what the index is read from. `refresh`: read the changed
    sources' index here (false: the caller reads the whole index once, after every source)."""
    nvidia = plan.nvidia
    if nvidia is not None:
        apt.packages(name=explained("Install gpg", "Install gpg to check the repository key"), packages=["gpg"], no_recommends=True)
        # the key, trusted for this source only, once its fingerprint is the pinned one
        key = repo_key(name=explained(f"Trust the CUDA repository key {nvidia.fingerprint[-16:]}",
                                       f"Trust the CUDA repository key {nvidia.fingerprint} (fingerprint checked) for that source only"),
                       url=nvidia.keyring_url, fingerprint=nvidia.fingerprint, keyring=nvidia.keyring)
        source = files.put(
            name=explained("Add NVIDIA's CUDA repository (signed-by)", f"Add NVIDIA's CUDA repository {nvidia.base}/ as a signed-by source"),
            src=StringIO(MANAGED + nvidia.line),
            dest=CUDA_SOURCE, mode="644",
        )
        if refresh:
            lists_refreshed(name=explained("Read the changed sources' index", "Read the package index of the changed sources"),
                            paths=[CUDA_SOURCE], _if=any_changed(key, source))
        return [key, source]
    if plan.archive_components:
        archive = "Ubuntu" if plan.res.os_release.startswith("ubuntu") else "Debian"
        enabled = archive_components(name=explained(f"Enable {', '.join(plan.archive_components)} ({archive} archive)",
                                                   f"Enable {', '.join(plan.archive_components)} on the {archive} archive sources"),
                                     components=list(plan.archive_components))
        if refresh:
            apt.update(name=explained("Read the changed sources' index", "Read the package index of the changed sources"), _if=enabled.did_change)
        return [enabled]
    return []


def _repository(source: AptSource, key_name: str, list_name: str) -> list[OperationMeta]:
    return [
        docker_ops.apt_keyring(name=key_name, path=source.keyring, key_url=source.key_url,
                               fingerprint=source.fingerprint),
        files.put(name=list_name, src=StringIO(source.line), dest=source.list_path, mode="644"),
    ]


def container_sources(planned: DockerPlan, refresh: bool = True) -> list[OperationMeta]:
    """NVIDIA's container toolkit repository (and Docker's), keys checked by fingerprint; returns
    the operations that write them. `refresh`: as cuda_sources'."""
    source_ops = _repository(planned.toolkit_repo, explained("Trust NVIDIA's container toolkit key (fingerprint checked)", "The toolkit repository's key, kept only if its fingerprint is the pinned one"),
                             explained("Use NVIDIA's container toolkit repository",
                                       "NVIDIA's apt repository for the toolkit, signed-by its own keyring"))
    if planned.docker_repo is not None:
        source_ops += _repository(planned.docker_repo,
                                  explained("Trust Docker's release key (fingerprint checked)",
                                            "Docker's key, kept only if its fingerprint is the pinned one"),
                                  explained("Use Docker's repository for the engine",
                                            "Docker's apt repository (docker_source: docker), signed-by its own keyring"))
    if refresh:
        lists_refreshed(
            name=explained("Read the new package sources", "apt reads the repositories just added, before installing from "
                           "them: their lists only, not the whole archive's again"),
            paths=[r.list_path for r in (planned.toolkit_repo, planned.docker_repo) if r is not None],
            _if=lambda: any(op.did_change() for op in source_ops),
        )
    return source_ops
