"""The validation gate, docker: containers see the GPUs; daemon.json is gpufleet.plans.dockerconf's."""
from __future__ import annotations

from gpufleet.checks.gate import FAIL, FIX_DEPLOY, PASS, SKIP, WARN, Context, Result, check
from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.gpu_checks import ContainerGpus
from gpufleet.plans import dockerconf


@check("docker")
def containers_see_gpus(ctx: Context) -> Result:
    name = "containers see the GPUs"
    data = ctx.fact(ContainerGpus)
    found = (f"docker {'present' if data.docker else 'absent'}, nvidia runtime "
             f"{'yes' if data.nvidia_runtime else 'no'}, {len(data.gpu_indices)} CDI GPUs")
    if not data.docker:
        return Result("docker", name, SKIP, "no docker on this host")
    gpus = len(ctx.gpu.gpus) if ctx.gpu.ok else 0
    problems = []
    if data.active != "active":
        problems.append(f"docker.service is {data.active}")
    if ctx.settings.docker_default_runtime == "nvidia" and not data.nvidia_runtime:
        problems.append("dockerd has no nvidia runtime")
    if ctx.settings.docker_cdi and len(data.gpu_indices) != gpus:
        problems.append(f"CDI lists {len(data.gpu_indices)} GPUs, nvidia-smi {gpus}")
    if problems:
        return Result("docker", name, FAIL, "; ".join(problems), FIX_DEPLOY)
    return Result("docker", name, PASS, found)


@check("docker")
def daemon_json_current(ctx: Context) -> Result:
    """Validation: daemon.json holds every gpufleet key; what a run left pending shows here."""
    name = "daemon.json has gpufleet's keys (no Docker change pending)"
    if not ctx.fact(ContainerGpus).docker:
        return Result("docker", name, SKIP, "no docker on this host")
    current = ctx.fact(DaemonJson, path=dockerconf.DAEMON_JSON)
    try:
        existing = dockerconf.parse(current.raw if current.exists else None)
    except dockerconf.MalformedDaemonJson as exc:
        return Result("docker", name, WARN, f"{dockerconf.DAEMON_JSON} is malformed: {exc}", "fix the file, then run deploys/all.py")
    keys = dockerconf.changed_keys(existing, dockerconf.merge(existing, dockerconf.DockerDefaults.from_settings(ctx.settings)))
    if not keys:
        return Result("docker", name, PASS, f"live-restore {'on' if ctx.settings.docker_live_restore else 'off'}")
    return Result("docker", name, WARN, f"not yet in {dockerconf.DAEMON_JSON}: {', '.join(keys)} (a Docker restart "
                  "was left pending while GPU containers ran, or the file was changed)",
                  "run deploys/all.py once the GPU containers have stopped (or set "
                  "docker_restart_with_gpu_containers: always)")


