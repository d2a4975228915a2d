"""Docker engine and NVIDIA container toolkit: containers see the GPUs, the operator's Docker
configuration survives.

Story of a host, part 4 (after the driver):

1. **Engine** from Debian/Ubuntu (`docker_source: distro`: docker.io, plus docker-cli where the
   distribution splits it out) or from Docker's repository (`docker_source: docker`: docker-ce,
   `docker_repo_url` may point at a mirror; the key must have `docker_repo_fingerprint`). Held
   with apt-mark, like the driver, so no upgrade restarts every container behind your back.
2. **NVIDIA container toolkit** from NVIDIA's repository or a mirror (`docker_toolkit_repo_url`,
   key checked against `docker_toolkit_repo_fingerprint`), pinned to `docker_toolkit_version`
   and held. (unattended-upgrades' GPU blacklist, gpufleet/apt_policy.py, covers ^nvidia- and
   ^libnvidia-.)
3. **daemon.json merged, not overwritten** (gpufleet/plans/dockerconf.py): the nvidia runtime, the
   tier's default runtime, `default-shm-size`, `default-ulimits`, `features.cdi`, `live-restore`
   (on by default); every other key is kept. A malformed daemon.json fails that host at
   planning time and is left byte-identical.
   Validated with `dockerd --validate` where the engine has it (Docker 23+).
4. **CDI spec** /etc/cdi/nvidia.yaml (`nvidia-ctk cdi generate`) where a GPU and the toolkit are
   present; regenerated when it is older than the driver's packages or misses a GPU.
5. **Apply a change without killing jobs**: reload dockerd (SIGHUP) when the changed keys allow
   it; restart it only where no GPU container runs, or where live-restore (turned on by a reload
   first) keeps them running (`docker_restart_with_gpu_containers`). Otherwise the keys that need
   a restart are left out of the file and reported PENDING, in the run's output, at its end and
   by the validation gate, until a run finds the GPU containers gone.
6. **GPU smoke test** (`docker run --rm --gpus all IMAGE nvidia-smi -L`) after any change of the
   above (never reported as a pass when skipped: the log says why it could not run).
Settings: gpufleet/data/tiers.yaml (`docker_*`). The decisions are gpufleet/plans/docker.py's
(DockerPlan); this file applies them.
"""
from __future__ import annotations

from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.server import Arch
from pyinfra.operations import apt, files, systemd

from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.config.failures import refuse
from gpufleet.explain import explained
from gpufleet.config.hostfacts import gpu_state, os_release
from gpufleet.config.settings import Settings, host_settings
from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.packages import AptCandidates, PackageVersions
from gpufleet.operations import docker as docker_ops
from gpufleet.operations.daemon_reload import dev_char_links
from gpufleet.operations.holds import held
from gpufleet.operations.apt_index import lists_refreshed
from gpufleet.plans import dockerconf
from gpufleet.plans.docker import CDI_SPEC, ENGINES, AptSource, DockerPlan, plan, repositories
from gpufleet.plans.refusal import Refusal
from gpufleet.plans.repos import dpkg_arch


@deploy("Docker")
def docker() -> None:
    settings = host_settings(host)
    planned = _plan(settings)
    if isinstance(planned, Refusal):  # planning time: nothing changed on the host
        refuse(host, planned.key, planned.reason, planned.fix)
        return
    _sources(planned)
    installs = _packages(planned)
    configured = _configuration(settings, planned)
    if planned.smoke_image is not None:
        changed = [op for op in installs + configured if op is not None]
        docker_ops.gpu_smoke_test(
            name=explained("Run a GPU container (nvidia-smi -L) to prove the change", "A GPU container lists the GPUs after a change: the engine, the toolkit and the runtime work together"),
            image=planned.smoke_image,
            expected=any(op.will_change for op in changed),
            _if=lambda: any(op.did_change() for op in changed),
        )


def _plan(settings: Settings) -> DockerPlan | Refusal:
    """The host's facts, read for the plan (apt-cache only where the engine is not complete)."""
    current = host.get_fact(DaemonJson, path=dockerconf.DAEMON_JSON)
    engine = ENGINES[settings.docker_source]
    installed = host.get_fact(PackageVersions, packages=engine.watched())
    candidates = (None if not engine.optional or engine.complete(installed) else
                  host.get_fact(AptCandidates, packages=list(engine.optional)))
    rel = os_release(host)
    return plan(settings, daemon_raw=current.raw if current.exists else None, installed=installed,
                candidates=candidates,
                repos=repositories(settings, rel.id, rel.version_codename, dpkg_arch(host.get_fact(Arch) or "x86_64")),
                gpu_uuids=_gpu_uuids())


def _gpu_uuids() -> list[str]:
    return [g.uuid for g in getattr(gpu_state(host), "gpus", []) or [] if getattr(g, "uuid", None)]


def _repository(source: AptSource, key_name: str, list_name: str) -> list[OperationMeta]:
    return [
        docker_ops.apt_keyring(name=key_name, path=source.keyring, key_url=source.key_url,
                               fingerprint=source.fingerprint),
        files.put(name=list_name, src=StringIO(source.line), dest=source.list_path, mode="644"),
    ]


def _sources(planned: DockerPlan) -> None:
    """NVIDIA's container toolkit repository (and Docker's), keys checked by fingerprint."""
    source_ops = _repository(planned.toolkit_repo, explained("Trust NVIDIA's container toolkit key (fingerprint checked)", "The toolkit repository's key, kept only if its fingerprint is the pinned one"),
                             explained("Use NVIDIA's container toolkit repository",
                                       "NVIDIA's apt repository for the toolkit, signed-by its own keyring"))
    if planned.docker_repo is not None:
        source_ops += _repository(planned.docker_repo,
                                  explained("Trust Docker's release key (fingerprint checked)",
                                            "Docker's key, kept only if its fingerprint is the pinned one"),
                                  explained("Use Docker's repository for the engine",
                                            "Docker's apt repository (docker_source: docker), signed-by its own keyring"))
    lists_refreshed(
        name=explained("Read the new package sources", "apt reads the repositories just added, before installing from "
                       "them: their lists only, not the whole archive's again"),
        paths=[r.list_path for r in (planned.toolkit_repo, planned.docker_repo) if r is not None],
        _if=lambda: any(op.did_change() for op in source_ops),
    )


def _packages(planned: DockerPlan) -> list[OperationMeta | None]:
    """Engine and toolkit, pinned and held; returns the install operations."""
    toolkit_op = apt.packages(
        name=explained(f"Install the NVIDIA container toolkit {planned.toolkit_version}", "The NVIDIA container toolkit at the tier's version, from NVIDIA's repository"),
        packages=list(planned.toolkit_packages), no_recommends=True, cache_time=APT_CACHE_SECONDS,
        extra_install_args="--allow-change-held-packages --allow-downgrades",
    )
    engine_op = apt.packages(
        name=explained(f"Install the Docker engine ({'Docker' if planned.source == 'docker' else 'distribution'} packages)",
                       "The engine docker_source names, from Docker's repository or the distribution's"),
        packages=list(planned.engine_packages), no_recommends=True, cache_time=APT_CACHE_SECONDS,
    )
    # held: upgrades happen only through gpufleet, never restart every container behind your back
    held(name=explained("Hold the engine and toolkit packages", "Hold the engine and toolkit packages so upgrades happen only through gpufleet"), packages=list(planned.hold))
    # NVIDIA's udev rule, now and at each boot: a daemon-reload then keeps GPU containers' devices
    dev_char_links(name=explained("Link every NVIDIA device in /dev/char", "Link every NVIDIA device in /dev/char, now and at each boot (NVIDIA's udev rule): a daemon-reload then keeps GPU containers' devices"))
    return [toolkit_op, engine_op]


def _configuration(settings: Settings, planned: DockerPlan) -> list[OperationMeta | None]:
    """daemon.json, the CDI spec, the service; returns the operations that can change them."""
    # the nvidia runtime and the tier's container defaults, every other key kept
    config_op = docker_ops.daemon_json(
        name=explained("Merge gpufleet's keys into daemon.json", "Merge the nvidia runtime and the tier's container defaults into daemon.json; the operator's other keys stay"),
        defaults=planned.daemon.defaults,
        restart_with_gpu_containers=planned.daemon.restart_policy,
        restart_for=planned.daemon.restart_for,
    )
    cdi_op = None
    if planned.cdi_gpus:
        cdi_op = docker_ops.cdi_spec(name=explained("Generate the CDI spec for the GPUs when missing or stale", "The CDI spec (/etc/cdi/nvidia.yaml) names the GPUs containers may ask for: written when missing or stale"),
                                     gpu_uuids=list(planned.cdi_gpus), output=CDI_SPEC)
    elif planned.cdi_skipped:
        host.noop(planned.cdi_skipped)
    systemd.service(
        name=explained("Keep Docker running and enabled at boot", "dockerd runs now and starts at every boot"),
        service="docker.service", running=True, enabled=True,
    )
    return [config_op, cdi_op]


@deploy("CDI spec (new driver)")
def cdi_after_driver_change() -> None:
    """The CDI spec lists the driver's libraries: after tools/rollout moved the driver it is stale,
    and regenerating it there keeps the next deploys/all.py a no-op."""
    settings = host_settings(host)
    if not settings.docker_cdi:
        host.noop("docker_cdi is false: no CDI spec")
        return
    uuids = _gpu_uuids()
    if not uuids:
        host.noop("no GPU visible to nvidia-smi: no CDI spec")
        return
    docker_ops.cdi_spec(name=explained("Regenerate the CDI spec for the new driver when stale", "After a driver change the CDI spec must name the new libraries: regenerated when stale"), gpu_uuids=uuids, output=CDI_SPEC)


# `pyinfra INVENTORY deploys/docker.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
