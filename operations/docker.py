"""Docker operations: verified apt keyrings, daemon.json merged (validated where dockerd can), the
NVIDIA CDI spec when it is stale, and a GPU smoke test that says why it did not run.

Each operation reads facts and yields only what is needed. pyinfra 3 runs an operation's body
twice: once while planning (to show what would change) and again when executing, against the
host as the earlier operations of this run left it. Decisions that depend on packages installed
earlier in the same run (dockerd present? nvidia-ctk present?) are therefore taken again at
execution time, and skip reasons are logged then (not while planning).
"""
from __future__ import annotations

from collections.abc import Generator
from io import StringIO
from typing import Sequence

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation
from pyinfra.operations import files

from gpufleet.operations import as_op
from gpufleet.operations.notice import executing as _executing, say as _say

from gpufleet.facts.docker import (DaemonJson, DockerEngine, DockerEngineState, DockerLive, DockerLiveState,
                                   NvidiaCdi)
from gpufleet.facts.packages import KeyringFingerprints
from gpufleet.facts.gpu import GpuState
from gpufleet.plans import dockerconf
from gpufleet.controller.run_summary import outcome
from gpufleet.config.failures import fail, fail_now


@operation()
def apt_keyring(path: str, key_url: str, fingerprint: str) -> Generator[StringCommand, None, None]:
    """Install the OpenPGP key at `key_url` as the binary keyring `path`, only if its primary
    fingerprint is `fingerprint` (a mirror or a man in the middle cannot swap keys).

    + path: keyring file for `signed-by=` (e.g. /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg)
    + key_url: where the (armored or binary) public key is published
    + fingerprint: expected 40-hex primary-key fingerprint
    """
    fingerprint = fingerprint.replace(" ", "").upper()
    current = host.get_fact(KeyringFingerprints, path=path)
    if current == [fingerprint]:
        host.noop(f"{path} holds exactly key {fingerprint}")
        return
    script = (
        'set -e; t=$(mktemp -d); trap \'rm -rf "$t"\' EXIT; '
        '/usr/lib/apt/apt-helper download-file "$1" "$t/key"; '
        'export GNUPGHOME="$t/home"; mkdir -m 700 "$GNUPGHOME"; '
        'gpg --batch --no-tty --quiet --import "$t/key" 2>/dev/null || true; '
        'got=$(gpg --batch --no-tty --with-colons --list-keys | awk -F: \'$1=="pub"{w=1;next} $1=="fpr"&&w{print $10;w=0}\' | tr "\\n" " "); '
        'case " $got " in *" $2 "*) ;; *) echo "gpufleet: the key at $1 has fingerprint(s) [${got% }], expected $2: not installed" >&2; exit 1;; esac; '
        'gpg --batch --no-tty --export "$2" > "$t/keyring"; install -D -m 644 "$t/keyring" "$3"'
    )
    yield StringCommand("sh", "-c", QuoteString(script), "gpufleet-keyring",
                        QuoteString(key_url), QuoteString(fingerprint), QuoteString(path))


_LIVE_RESTORE_CHECK = (
    'l=$(timeout 20 docker info --format "{{.LiveRestoreEnabled}}" 2>/dev/null); '
    '[ "$l" = true ] || { echo "gpufleet: live-restore is not on in the running dockerd (docker info: ${l:-no answer}): '
    'not restarting it under running containers" >&2; exit 1; }')


@operation()
def daemon_json(defaults: dockerconf.DockerDefaults, path: str = dockerconf.DAEMON_JSON,
                restart_with_gpu_containers: str = "live-restore", restart_for: Sequence[str] = ()
                ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """Merge gpufleet's keys into Docker's daemon.json, keeping every other key; write only when
    the merged JSON differs, and bring the running dockerd to it without killing GPU work: a
    reload (SIGHUP) where the changed keys allow it, a restart only where no GPU container runs
    or live-restore keeps them running (dockerconf.apply_plan); otherwise the restart-needing
    keys are left out of the file and reported pending. Where dockerd has `--validate` (Docker
    23+) the new file is checked before it replaces the old one; otherwise that is said.

    + defaults: the host's DockerDefaults (runtime, CDI, shm size, ulimits, live-restore)
    + path: daemon.json path
    + restart_with_gpu_containers: never | live-restore | always (docker_restart_with_gpu_containers)
    + restart_for: other reasons dockerd needs a restart (applied under the same rules)
    """
    current = host.get_fact(DaemonJson, path=path)
    try:
        existing = dockerconf.parse(current.raw if current.exists else None)
    except dockerconf.MalformedDaemonJson as exc:
        # The deploy refuses the host at planning time; this is the race where it broke since.
        yield fail(host, "docker daemon.json", f"{path} is malformed ({exc}); left untouched",
                   "fix or remove the file, then re-run")
        return
    merged = dockerconf.merge(existing, defaults)
    write = dockerconf.needs_write(existing, merged)
    # Nothing asked of dockerd on a no-op run (restart_for is empty once the toolkit is there).
    engine = host.get_fact(DockerEngine) if write or restart_for else None
    if engine is None or (not write and not engine.running):
        host.noop(f"{path} already has gpufleet's keys")
        return
    live = host.get_fact(DockerLive) if engine.running else DockerLiveState()
    # A dockerd that does not answer may still run containers: assume it does.
    unknown = [] if live.answered or not engine.running else ["(dockerd did not answer `docker ps`)"]
    plan = dockerconf.apply_plan(existing, merged, running=engine.running,
                                 live_restore_on=live.live_restore, gpu_containers=live.gpu_containers or unknown,
                                 policy=restart_with_gpu_containers, containers=live.containers,
                                 restart_for=tuple(restart_for))
    if plan.pending:
        outcome(host).docker_pending = (plan.pending, plan.why)
        _say(f"daemon.json change PENDING (not applied): {', '.join(plan.pending)} need a Docker restart; "
             f"{plan.why}. It is applied by the first run after they stop")
    else:
        outcome(host).docker_pending = None
    replaced = [k for k in dockerconf.replaced_keys(existing, merged) if k.split(".")[0] not in plan.pending]
    if replaced and _executing():
        logger.warning(f"{host.print_prefix}daemon.json: the tier's value replaces the operator's for "
                       f"{', '.join(replaced)} (override in the inventory to keep it)")
    if any(step[0].startswith("write") for step in plan.steps):
        yield from files.directory._inner(path=path.rsplit("/", 1)[0] or "/", mode="755")
    for step in plan.steps:
        if step[0] in ("write", "write-reloadable"):
            doc = merged if step[0] == "write" else dockerconf.partial(existing, merged, list(step[1]))
            yield from _write(engine, path, dockerconf.render(doc))
        elif step[0] == "reload":
            # docker.service's ExecReload sends dockerd SIGHUP: the reloadable keys apply in place.
            yield StringCommand("systemctl", "reload", "docker.service")
        elif step[0] == "check-live-restore":
            yield StringCommand("sh", "-c", QuoteString(_LIVE_RESTORE_CHECK))
        elif step[0] == "restart":
            # docker.service allows 3 starts a minute (StartLimitBurst): right after the package's
            # own start or an operator's restart, a refused start would leave dockerd down.
            yield StringCommand("sh", "-c", QuoteString(
                "systemctl reset-failed docker.service 2>/dev/null; systemctl restart docker.service"))


def _write(engine: DockerEngineState, path: str, text: str) -> Generator[StringCommand, None, None]:
    if engine.can_validate:
        staged = f"{path}.gpufleet-new"
        yield from files.put._inner(src=StringIO(text), dest=staged, mode="644")
        yield StringCommand(
            "sh", "-c", QuoteString(
                'dockerd --validate --config-file "$1" || { rm -f "$1"; '
                'echo "gpufleet: dockerd --validate refused the merged daemon.json; $2 unchanged" >&2; exit 1; }; '
                'mv -f "$1" "$2"'),
            "gpufleet-daemon-json", QuoteString(staged), QuoteString(path))
    else:
        why = (f"dockerd {engine.dockerd_version} has no --validate (Docker < 23)" if engine.installed
               else "dockerd is not installed")
        _say(f"daemon.json written without `dockerd --validate`: {why}")
        yield from files.put._inner(src=StringIO(text), dest=path, mode="644")


@operation()
def cdi_spec(gpu_uuids: Sequence[str], output: str = "/etc/cdi/nvidia.yaml") -> Generator[StringCommand, None, None]:
    """Generate the NVIDIA CDI spec when it is missing, older than the driver's packages, or does
    not list every GPU the host has.

    + gpu_uuids: the GPUs the facts see (each must appear as nvidia.com/gpu=<uuid>)
    + output: spec path
    """
    state = host.get_fact(NvidiaCdi, spec=output)
    if not state.ctk:
        host.noop("nvidia-ctk is not installed yet: no CDI spec")
        return
    reasons = state.stale_reasons(gpu_uuids)
    if not reasons:
        host.noop(f"{output} is current ({len(state.devices)} CDI devices)")
        return
    if _executing():
        logger.info(f"{host.print_prefix}CDI spec: {'; '.join(reasons)}")
    yield StringCommand("nvidia-ctk", "cdi", "generate", QuoteString(f"--output={output}"))


@operation()
def gpu_smoke_test(image: str, expected: bool = True) -> Generator[StringCommand | FunctionCommand, None, None]:
    """`docker run --rm --gpus all IMAGE nvidia-smi -L`, where the engine runs and GPUs are present.

    Skipped with a visible reason (never reported as a pass) when the engine is not running, the
    host shows no GPU, or the image is neither on the host nor pullable. The image is pulled when
    missing (that pull is the only thing done before the test).

    + image: container image to run (the toolkit mounts nvidia-smi into it)
    + expected: whether planning expects the test to run (shown as a change in the plan only then)
    """
    if not _executing():
        # What will exist at execution time is not known yet: show the test as planned.
        if not expected:
            host.noop("GPU smoke test: nothing planned to change, so nothing to prove")
            return
        yield StringCommand("docker", "run", "--rm", "--gpus", "all", QuoteString(image), "nvidia-smi", "-L")
        return
    engine = host.get_fact(DockerEngine)
    reason = None
    if not engine.running:
        reason = f"the Docker engine is not running (docker.service {engine.active_state}/{engine.sub_state})"
    elif not engine.cli:
        reason = "the docker CLI is not installed"
    else:
        gpus = host.get_fact(GpuState)
        if not getattr(gpus, "gpus", None):
            reason = "nvidia-smi shows no GPU on the host"
    if reason is None:
        ok, out = as_op.run(host,
            StringCommand("sh", "-c", QuoteString('docker image inspect "$1" >/dev/null 2>&1 || timeout 600 docker pull -q "$1"'),
                          "gpufleet-pull", QuoteString(image)))
        if not ok:
            last = (out.stderr_lines or out.stdout_lines or ["no output"])[-1]
            reason = f"image {image} is not on the host and cannot be pulled ({last.strip()})"
    if reason is not None:
        logger.warning(f"{host.print_prefix}GPU smoke test SKIPPED (not passed): {reason}")
        return
    uuids = [g.uuid for g in gpus.gpus if getattr(g, "uuid", None)]
    yield FunctionCommand(_smoke_run, (image, uuids), {})


def _smoke_run(state: State, host: Host, image: str, uuids: list[str]) -> bool:
    """Run the container, print what it sees, and pass only when it lists every GPU of the host."""
    ok, out = as_op.run(host, StringCommand(
        "timeout", "300", "docker", "run", "--rm", "--gpus", "all", QuoteString(image), "nvidia-smi", "-L"))
    lines = [line.strip() for line in (out.stdout_lines if out else []) if line.strip()]
    errors = [line.strip() for line in (out.stderr_lines if out else []) if line.strip() and "WARNING" not in line]
    for line in lines:
        logger.info(f"{host.print_prefix}GPU smoke test: container sees {line}")
    missing = [u for u in uuids if not any(u in line for line in lines)]
    if ok and lines and not missing:
        logger.info(f"{host.print_prefix}GPU smoke test PASSED: `docker run --gpus all {image} nvidia-smi -L` "
                    f"lists all {len(uuids)} GPU(s) of the host")
        return True
    why = (f"exit status non-zero: {errors[-1] if errors else 'no output'}" if not ok else
           f"the container does not see {', '.join(missing)}" if missing else "the container listed no GPU")
    return fail_now(state, host, "docker", f"GPU smoke test FAILED: {why}",
                           "check the NVIDIA container toolkit and the driver on the host (docker run --gpus all "
                           f"{image} nvidia-smi -L by hand), then re-run")
