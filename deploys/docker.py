"""Docker engine and NVIDIA container toolkit: containers see the GPUs, the operator's Docker
configuration survives.

Story of a host, part 4 (after the driver):

1. **Engine** from Debian/Ubuntu (`docker_source: distro`: docker.io, plus docker-cli where the
   distribution splits it out) or from Docker's repository (`docker_source: docker`: docker-ce,
   `docker_repo_url` may point at a mirror; the key must have `docker_repo_fingerprint`). Held
   with apt-mark, like the driver, so no upgrade restarts every container behind your back.
2. **NVIDIA container toolkit** from NVIDIA's repository or a mirror (`docker_toolkit_repo_url`,
   key checked against `docker_toolkit_repo_fingerprint`), pinned to `docker_toolkit_version`
   and held. (unattended-upgrades' GPU blacklist lives in deploys/hardening.py and already
   covers ^nvidia- and ^libnvidia-.)
3. **daemon.json merged, not overwritten** (gpufleet/plans/dockerconf.py): the nvidia runtime, the
   tier's default runtime, `default-shm-size`, `default-ulimits`, `features.cdi`, `live-restore`
   (on by default); every other key is kept. A malformed daemon.json fails that host at planning time and is left byte-identical.
   Validated with `dockerd --validate` where the engine has it (Docker 23+).
4. **CDI spec** /etc/cdi/nvidia.yaml (`nvidia-ctk cdi generate`) where a GPU and the toolkit are
   present; regenerated when it is older than the driver's packages or misses a GPU.
5. **Apply a change without killing jobs**: reload dockerd (SIGHUP) when the changed keys allow
   it; restart it only where no GPU container runs, or where live-restore (turned on by a reload
   first) keeps them running (`docker_restart_with_gpu_containers`). Otherwise the keys that need
   a restart are left out of the file and reported PENDING, in the run's output, at its end and
   by the validation gate, until a run finds the GPU containers gone.
6. **GPU smoke test** (`docker run --rm --gpus all IMAGE nvidia-smi -L`) after any change of the
   above; skipped with a logged reason when it cannot run (`deploys/docker_smoke.py` runs it on
   demand).
Settings: gpufleet/data/tiers.yaml (`docker_*`).
"""
from __future__ import annotations

from io import StringIO
from typing import Any


from pyinfra import host
from pyinfra.api import deploy
from pyinfra.facts.server import Arch
from pyinfra.operations import apt, files, systemd

from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.packages import AptCandidates
from gpufleet.facts.packages import PackageVersions
from gpufleet.plans import dockerconf
from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.config.failures import refuse
from gpufleet.config.hostfacts import gpu_state, os_release
from gpufleet.plans.repos import (DOCKER_KEYRING, DOCKER_LIST, TOOLKIT_KEYRING, TOOLKIT_LIST, TOOLKIT_PACKAGES,  # noqa: F401
                            apt_url, docker_sources_line, dpkg_arch, toolkit_sources_line)
from gpufleet.config.settings import Settings, host_settings
from gpufleet.operations import docker as docker_ops
from gpufleet.operations.daemon_reload import dev_char_links
from gpufleet.operations.holds import held

CDI_SPEC = "/etc/cdi/nvidia.yaml"

# Engine packages per source: installed, then held together with their runtime pieces.
ENGINE = {
    "docker": {"install": ("docker-ce", "docker-ce-cli", "containerd.io"),
               "hold": ("docker-ce", "docker-ce-cli", "containerd.io"),
               "conflicts": ("docker.io",)},
    "distro": {"install": ("docker.io",), "optional": ("docker-cli",),
               "hold": ("docker.io", "containerd", "runc"), "conflicts": ("docker-ce",)},
}




@deploy("Docker engine and NVIDIA container toolkit")
def docker() -> None:
    settings = host_settings(host)
    installed = _refused_or_installed(settings)  # planning-time refusals: nothing changed on a host that fails
    if installed is None:
        return
    _sources(settings)
    installs = _packages(settings, installed)
    configured = _configuration(settings, installed)
    _smoke_test(settings, installs + configured)


def _refused_or_installed(settings: Settings) -> dict[str, Any] | None:
    """What is installed of both engines and the toolkit, or None: refused (named), nothing changed."""
    current = host.get_fact(DaemonJson, path=dockerconf.DAEMON_JSON)
    try:
        dockerconf.parse(current.raw if current.exists else None)
    except dockerconf.MalformedDaemonJson as exc:
        refuse(host, "docker daemon.json",
               f"{dockerconf.DAEMON_JSON} is malformed: {exc}. gpufleet merges into it and will not "
               "guess (it was left untouched)",
               "fix or remove the file, then re-run")
        return None
    engine = ENGINE[settings.docker_source]
    installed = host.get_fact(PackageVersions,
                              packages=[*engine["conflicts"], *engine["install"], *engine.get("optional", ()),
                                        "nvidia-container-toolkit"])
    other = [p for p in engine["conflicts"] if installed.get(p)]
    if other:
        refuse(host, "docker_source",
               f"docker_source is {settings.docker_source} but {', '.join(other)} (the other engine) is installed",
               "remove it (or set docker_source to match) and re-run")
        return None

    return installed


def _sources(settings: Settings) -> None:
    """NVIDIA's container toolkit repository (and Docker's), keys checked by fingerprint."""
    rel = os_release(host)
    arch = dpkg_arch(host.get_fact(Arch) or "x86_64")
    toolkit_url = apt_url(settings, settings.docker_toolkit_repo_url)
    source_ops = [
        docker_ops.apt_keyring(
            name="Trust NVIDIA's container toolkit key (fingerprint checked)",
            path=TOOLKIT_KEYRING, key_url=f"{toolkit_url.rstrip('/')}/gpgkey",
            fingerprint=settings.docker_toolkit_repo_fingerprint),
        files.put(
            name="Use NVIDIA's container toolkit repository",
            src=StringIO(toolkit_sources_line(toolkit_url)), dest=TOOLKIT_LIST, mode="644"),
    ]
    if settings.docker_source == "docker":
        os_id = rel.id or "debian"
        docker_url = apt_url(settings, settings.docker_repo_url)
        source_ops += [
            docker_ops.apt_keyring(
                name="Trust Docker's release key (fingerprint checked)",
                path=DOCKER_KEYRING, key_url=f"{docker_url.rstrip('/')}/{os_id}/gpg",
                fingerprint=settings.docker_repo_fingerprint),
            files.put(
                name="Use Docker's repository for the engine",
                src=StringIO(docker_sources_line(docker_url, os_id, rel.version_codename or "", arch)),
                dest=DOCKER_LIST, mode="644"),
        ]
    apt.update(
        name="Read the new package sources",
        _if=lambda: any(op.did_change() for op in source_ops),
    )


def _packages(settings: Settings, installed: dict[str, Any]) -> list[Any]:
    """Engine and toolkit, pinned and held; returns the install operations."""
    engine = ENGINE[settings.docker_source]
    engine_packages = list(engine["install"])
    hold = list(engine["hold"])
    optional = engine.get("optional", ())
    if optional:
        # Debian 13 moved the CLI out of docker.io; Debian 12 and Ubuntu still ship it inside.
        # Once the engine is installed, what came with it tells which, without asking apt-cache
        # (40 ms of a no-op run's host time).
        if all(installed.get(p) for p in engine["install"]):
            extra = [p for p in optional if installed.get(p)]
        else:
            candidates = host.get_fact(AptCandidates, packages=list(optional))
            extra = [p for p in optional if candidates.get(p) or installed.get(p)]
        engine_packages += extra
        hold += extra
    toolkit = [f"{p}={settings.docker_toolkit_version}" for p in TOOLKIT_PACKAGES]
    toolkit_op = apt.packages(
        name=f"Install the NVIDIA container toolkit {settings.docker_toolkit_version}",
        packages=toolkit, no_recommends=True, cache_time=APT_CACHE_SECONDS,
        extra_install_args="--allow-change-held-packages --allow-downgrades",
    )
    engine_op = apt.packages(
        name=f"Install the Docker engine ({'Docker' if settings.docker_source == 'docker' else 'distribution'} packages)",
        packages=engine_packages, no_recommends=True, cache_time=APT_CACHE_SECONDS,
    )
    held(name="Hold the engine and toolkit packages so upgrades happen only through gpufleet",
         packages=sorted({*hold, *TOOLKIT_PACKAGES}))
    dev_char_links(name="Link every NVIDIA device in /dev/char, now and at each boot (NVIDIA's udev rule): "
                        "a daemon-reload then keeps GPU containers' devices")
    return [toolkit_op, engine_op]


def _configuration(settings: Settings, installed: dict[str, Any]) -> list[Any]:
    """daemon.json, the CDI spec, the service; returns the operations that can change them."""
    config_op = docker_ops.daemon_json(
        name="Merge the nvidia runtime and the tier's container defaults into daemon.json",
        defaults=dockerconf.DockerDefaults.from_settings(settings),
        restart_with_gpu_containers=settings.docker_restart_with_gpu_containers,
        # dockerd registers `--gpus` only if the toolkit's hook exists when it starts
        restart_for=() if installed.get("nvidia-container-toolkit") else
        ("the NVIDIA container toolkit was installed (dockerd registers --gpus when it starts)",),
    )
    uuids = [g.uuid for g in getattr(gpu_state(host), "gpus", []) or [] if getattr(g, "uuid", None)]
    cdi_op = None
    if settings.docker_cdi:
        if uuids:
            cdi_op = docker_ops.cdi_spec(
                name="Generate the CDI spec for the GPUs when missing or stale",
                gpu_uuids=uuids, output=CDI_SPEC)
        else:
            host.noop("no GPU visible to nvidia-smi: no CDI spec")
    systemd.service(
        name="Keep Docker running and enabled at boot",
        service="docker.service", running=True, enabled=True,
    )
    return [config_op, cdi_op]


def _smoke_test(settings: Settings, ops: list[Any]) -> None:
    """After a change: a GPU container (nvidia-smi -L) proves it."""
    if settings.docker_smoke_image != "none":
        changed = [op for op in ops if op is not None]
        docker_ops.gpu_smoke_test(
            name="Run a GPU container (nvidia-smi -L) to prove the change",
            image=settings.docker_smoke_image,
            expected=any(op.will_change for op in changed),
            _if=lambda: any(op.did_change() for op in changed),
        )


@deploy("Container device spec after a driver change")
def cdi_after_driver_change() -> None:
    """The CDI spec lists the driver's libraries: after tools/rollout moved the driver it is stale,
    and regenerating it there keeps the next deploys/all.py a no-op."""
    settings = host_settings(host)
    if not settings.docker_cdi:
        host.noop("docker_cdi is false: no CDI spec")
        return
    uuids = [g.uuid for g in getattr(gpu_state(host), "gpus", []) or [] if getattr(g, "uuid", None)]
    if not uuids:
        host.noop("no GPU visible to nvidia-smi: no CDI spec")
        return
    docker_ops.cdi_spec(name="Regenerate the CDI spec for the new driver when stale", gpu_uuids=uuids, output=CDI_SPEC)


# `pyinfra INVENTORY deploys/docker.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
