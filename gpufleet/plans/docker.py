"""The Docker plan: which engine and toolkit packages a host gets, from which repositories, what
gpufleet merges into daemon.json and what of that would need a dockerd restart, the CDI spec and
the smoke test (pure; deploys/docker.py applies it, tests/unit/test_docker_plan.py checks it).

Refused before anything changes: a daemon.json gpufleet cannot merge into (left untouched), or
the other engine installed (docker_source: docker with Debian's docker.io, or the reverse).
The daemon.json merge itself is gpufleet/plans/dockerconf.py's (the validation gate reads it too).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING
from dataclasses import dataclass

from pyinfra.facts.server import Arch

from gpufleet.config.hostfacts import gpu_state, os_release
from gpufleet.config.settings import Settings
from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.packages import AptCandidates, PackageVersions
from gpufleet.plans import dockerconf
from gpufleet.plans.refusal import Refusal
if TYPE_CHECKING:
    from pyinfra.api import Host

from gpufleet.plans.repos import (DOCKER_KEYRING, DOCKER_LIST, TOOLKIT_KEYRING, TOOLKIT_LIST, TOOLKIT_PACKAGES,
                                  apt_url, docker_sources_line, dpkg_arch, toolkit_sources_line)

CDI_SPEC = "/etc/cdi/nvidia.yaml"
TOOLKIT = "nvidia-container-toolkit"


@dataclass(frozen=True)
class Engine:
    """One docker_source's packages: installed, then held with their runtime pieces."""

    install: tuple[str, ...]
    hold: tuple[str, ...]
    conflicts: tuple[str, ...]  # the other engine's: never both
    # Debian 13 moved the CLI out of docker.io; Debian 12 and Ubuntu still ship it inside.
    optional: tuple[str, ...] = ()

    def watched(self) -> list[str]:
        """The packages whose installed versions the plan reads (PackageVersions' argument)."""
        return [*self.conflicts, *self.install, *self.optional, TOOLKIT]

    def complete(self, installed: Mapping[str, str | None]) -> bool:
        """Installed already: what came with it says which optional packages it has, without
        asking apt-cache (40 ms of a no-op run's host time)."""
        return all(installed.get(p) for p in self.install)


ENGINES = {
    "docker": Engine(install=("docker-ce", "docker-ce-cli", "containerd.io"),
                     hold=("docker-ce", "docker-ce-cli", "containerd.io"), conflicts=("docker.io",)),
    "distro": Engine(install=("docker.io",), hold=("docker.io", "containerd", "runc"), conflicts=("docker-ce",),
                     optional=("docker-cli",)),
}


@dataclass(frozen=True)
class AptSource:
    """A repository: its key (installed only with this fingerprint) and its sources line."""

    keyring: str
    key_url: str
    fingerprint: str
    list_path: str
    line: str


@dataclass(frozen=True)
class DaemonPlan:
    """daemon.json: gpufleet's keys (`defaults`), how a change reaches a running dockerd
    (`restart_policy`: docker_restart_with_gpu_containers), other reasons for a restart, and,
    against the file read at planning, the keys that change and those needing a restart."""

    defaults: dockerconf.DockerDefaults
    restart_policy: str
    restart_for: tuple[str, ...]
    changed: tuple[str, ...]
    restart_keys: tuple[str, ...]


@dataclass(frozen=True)
class DockerPlan:
    source: str                          # docker_source: docker | distro
    engine_packages: tuple[str, ...]
    toolkit_version: str
    toolkit_packages: tuple[str, ...]    # pinned: name=version
    hold: tuple[str, ...]
    toolkit_repo: AptSource
    docker_repo: AptSource | None        # Docker's own repository (docker_source: docker)
    daemon: DaemonPlan
    cdi_gpus: tuple[str, ...]            # GPU UUIDs the CDI spec must list
    cdi_skipped: str | None              # why no CDI spec (None: there is one, or docker_cdi is off)
    smoke_image: str | None              # None: docker_smoke_image is none


def engine_refusal(settings: Settings, daemon_raw: bytes | None,
                   installed: Mapping[str, str | None]) -> Refusal | None:
    """Why the host is refused (None: it is not): a daemon.json that is not mergeable, or the
    other engine installed."""
    try:
        dockerconf.parse(daemon_raw)
    except dockerconf.MalformedDaemonJson as exc:
        return Refusal("docker", "docker daemon.json",
                       f"{dockerconf.DAEMON_JSON} is malformed: {exc}. gpufleet merges into it and will not "
                       "guess (it was left untouched)", "fix or remove the file, then re-run")
    other = [p for p in ENGINES[settings.docker_source].conflicts if installed.get(p)]
    if other:
        return Refusal("docker", "docker_source",
                       f"docker_source is {settings.docker_source} but {', '.join(other)} (the other engine) is installed",
                       "remove it (or set docker_source to match) and re-run")
    return None


def daemon_plan(settings: Settings, daemon_raw: bytes | None, toolkit_installed: bool) -> DaemonPlan:
    defaults = dockerconf.DockerDefaults.from_settings(settings)
    # dockerd registers `--gpus` only if the toolkit's hook exists when it starts
    restart_for = () if toolkit_installed else (
        "the NVIDIA container toolkit was installed (dockerd registers --gpus when it starts)",)
    existing = dockerconf.parse(daemon_raw)
    merged = dockerconf.merge(existing, defaults)
    changed = dockerconf.changed_keys(existing, merged) if existing is not None else sorted(merged)
    return DaemonPlan(defaults, settings.docker_restart_with_gpu_containers, restart_for, tuple(changed),
                      tuple(dockerconf.restart_keys(changed, restart_for)))


def repositories(settings: Settings, os_id: str | None, codename: str | None, arch: str
                 ) -> tuple[AptSource, AptSource | None]:
    """NVIDIA's container toolkit repository, and Docker's where the engine comes from it."""
    toolkit_url = apt_url(settings, settings.docker_toolkit_repo_url)  # through the package cache, if any
    toolkit = AptSource(TOOLKIT_KEYRING, f"{toolkit_url.rstrip('/')}/gpgkey", settings.docker_toolkit_repo_fingerprint,
                        TOOLKIT_LIST, toolkit_sources_line(toolkit_url))
    if settings.docker_source != "docker":
        return toolkit, None
    os_id = os_id or "debian"
    url = apt_url(settings, settings.docker_repo_url)
    docker = AptSource(DOCKER_KEYRING, f"{url.rstrip('/')}/{os_id}/gpg", settings.docker_repo_fingerprint,
                       DOCKER_LIST, docker_sources_line(url, os_id, codename or "", arch))
    return toolkit, docker


def plan(settings: Settings, *, daemon_raw: bytes | None, installed: Mapping[str, str | None],
         candidates: Mapping[str, str | None] | None, repos: tuple[AptSource, AptSource | None],
         gpu_uuids: Sequence[str]) -> DockerPlan | Refusal:
    """The plan, or why the host is refused. installed: PackageVersions of Engine.watched();
    candidates: AptCandidates of the engine's optional packages, read only where the engine is
    not complete (None otherwise); repos: repositories(); gpu_uuids: the GPUs nvidia-smi sees."""
    refusal = engine_refusal(settings, daemon_raw, installed)
    if refusal is not None:
        return refusal
    engine = ENGINES[settings.docker_source]
    if engine.complete(installed):
        extra = [p for p in engine.optional if installed.get(p)]
    else:
        extra = [p for p in engine.optional if (candidates or {}).get(p) or installed.get(p)]
    version = settings.docker_toolkit_version
    cdi_skipped = None if not settings.docker_cdi or gpu_uuids else "no GPU visible to nvidia-smi: no CDI spec"
    return DockerPlan(
        source=settings.docker_source,
        engine_packages=(*engine.install, *extra),
        toolkit_version=version,
        toolkit_packages=tuple(f"{p}={version}" for p in TOOLKIT_PACKAGES),
        hold=tuple(sorted({*engine.hold, *extra, *TOOLKIT_PACKAGES})),
        toolkit_repo=repos[0],
        docker_repo=repos[1],
        daemon=daemon_plan(settings, daemon_raw, bool(installed.get(TOOLKIT))),
        cdi_gpus=tuple(gpu_uuids) if settings.docker_cdi else (),
        cdi_skipped=cdi_skipped,
        smoke_image=None if settings.docker_smoke_image == "none" else settings.docker_smoke_image,
    )


def gpu_uuids(h: Host) -> list[str]:
    """The UUIDs of the GPUs nvidia-smi lists on `h` (the CDI spec names them)."""
    return [g.uuid for g in getattr(gpu_state(h), "gpus", []) or [] if getattr(g, "uuid", None)]


def read_plan(h: Host, settings: Settings) -> DockerPlan | Refusal:
    """The host's plan from its facts (apt-cache only where the engine is not complete): the one
    place that asks the host, for deploys/docker.py and a first converge's early install alike."""
    current = h.get_fact(DaemonJson, path=dockerconf.DAEMON_JSON)
    engine = ENGINES[settings.docker_source]
    installed = h.get_fact(PackageVersions, packages=engine.watched())
    candidates = (None if not engine.optional or engine.complete(installed) else
                  h.get_fact(AptCandidates, packages=list(engine.optional)))
    rel = os_release(h)
    return plan(settings, daemon_raw=current.raw if current.exists else None, installed=installed,
                candidates=candidates,
                repos=repositories(settings, rel.id, rel.version_codename, dpkg_arch(h.get_fact(Arch) or "x86_64")),
                gpu_uuids=gpu_uuids(h))
