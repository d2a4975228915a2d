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
On a fresh host's first converge deploys/bootstrap.py wrote the repositories and installed the
engine and toolkit earlier in the run (one apt transaction with every other package): steps 1
and 2 then find them done, and dockerd, started by its package, is configured and restarted here
as on any first install.
Settings: gpufleet/data/tiers.yaml (`docker_*`). The decisions are gpufleet/plans/docker.py's
(DockerPlan); this file applies them.
"""
from __future__ import annotations


from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import apt, systemd

from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.config.failures import refuse
from gpufleet.explain import explained
from gpufleet.config.settings import Settings, host_settings
from gpufleet.operations import docker as docker_ops
from gpufleet.operations.daemon_reload import dev_char_links
from gpufleet.operations.holds import held
from gpufleet.operations.source_steps import container_sources, written_early
from gpufleet.plans.docker import CDI_SPEC, DockerPlan, gpu_uuids, read_plan
from gpufleet.plans.refusal import Refusal


@deploy("Docker")
def docker() -> None:
    settings = host_settings(host)
    planned = read_plan(host, settings)
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


def _sources(planned: DockerPlan) -> None:
    """NVIDIA's container toolkit repository (and Docker's), keys checked by fingerprint
    (operations/source_steps.py), unless a first converge's early install (deploys/bootstrap.py)
    wrote them earlier in this run."""
    if written_early() is None:
        container_sources(planned)


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
    uuids = gpu_uuids(host)
    if not uuids:
        host.noop("no GPU visible to nvidia-smi: no CDI spec")
        return
    docker_ops.cdi_spec(name=explained("Regenerate the CDI spec for the new driver when stale", "After a driver change the CDI spec must name the new libraries: regenerated when stale"), gpu_uuids=uuids, output=CDI_SPEC)


# `pyinfra INVENTORY deploys/docker.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
