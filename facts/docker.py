"""
Docker facts: the existing daemon.json (exact bytes), the engine and its systemd unit, the
NVIDIA CDI spec, apt keyring fingerprints and apt candidates. Read-only; hosts without Docker
give "absent" answers rather than failing.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import MARK, JsonMixin, fail, split_sections, with_values

# --------------------------------------------------------------------------------------------
# daemon.json
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DaemonJsonFile(JsonMixin):
    exists: bool
    raw: bytes | None = None  # exact content (None when absent)

    def to_json(self) -> dict:
        return {"exists": self.exists,
                "content": None if self.raw is None else self.raw.decode("utf-8", "replace")}


class DaemonJson(FactBase):
    """
    The exact bytes of Docker's daemon.json (base64 on the wire, so nothing is lost):

    .. code:: python

        DaemonJsonFile(exists=True, raw=b'{"log-driver": ...}')
    """

    @override
    def command(self, path: str = "/etc/docker/daemon.json") -> str:
        return with_values('if [ -f "$path" ]; then echo "$mark exists yes"; base64 -w0 < "$path"; echo; '
                           'else echo "$mark exists no"; fi', path=path, mark=MARK)

    @override
    def process(self, output: list[str]) -> DaemonJsonFile:
        return parse_daemon_json_output(output)


def parse_daemon_json_output(output: Sequence[str]) -> DaemonJsonFile:
    sections, values = split_sections(output)
    exists = values.get("exists")
    if exists not in ("yes", "no"):
        raise fail("daemon.json fact: missing exists marker", "\n".join(output))
    if exists == "no":
        return DaemonJsonFile(False)
    payload = "".join(line.strip() for line in sections[""])
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise fail("daemon.json fact: not base64", payload[:80]) from None
    return DaemonJsonFile(True, raw)


# --------------------------------------------------------------------------------------------
# The engine and its unit
# --------------------------------------------------------------------------------------------

_DOCKERD_VERSION = re.compile(r"^Docker version ([0-9][^\s,]*)")


@dataclass(frozen=True)
class DockerEngineState(JsonMixin):
    dockerd_version: str | None = None    # "26.1.5+dfsg1", None = no dockerd
    cli: bool = False                      # the docker CLI is installed
    active_state: str = "inactive"         # systemd ActiveState of docker.service
    sub_state: str = ""
    load_state: str = "not-found"
    n_restarts: int = 0                    # NRestarts (automatic restarts by systemd)
    main_start_monotonic: int = 0          # ExecMainStartTimestampMonotonic (us): changes on every (re)start

    @property
    def installed(self) -> bool:
        return self.dockerd_version is not None

    @property
    def running(self) -> bool:
        return self.active_state == "active"

    @property
    def major(self) -> int | None:
        if not self.dockerd_version:
            return None
        m = re.match(r"(\d+)", self.dockerd_version)
        return int(m.group(1)) if m else None

    @property
    def can_validate(self) -> bool:
        """`dockerd --validate` exists from Docker 23.0."""
        return (self.major or 0) >= 23


class DockerEngine(FactBase):
    """dockerd's version, whether the CLI is there, and docker.service's state and restart marks."""

    @override
    def command(self) -> str:
        return with_values(
            'echo "$mark begin version"; dockerd --version 2>/dev/null || true; '
            'echo "$mark begin unit"; systemctl show docker.service -p LoadState -p ActiveState -p SubState '
            "-p NRestarts -p ExecMainStartTimestampMonotonic 2>/dev/null || true; "
            'if command -v docker >/dev/null 2>&1; then echo "$mark cli yes"; else echo "$mark cli no"; fi',
            mark=MARK)

    @override
    def process(self, output: list[str]) -> DockerEngineState:
        return parse_docker_engine(output)


def parse_docker_engine(output: Sequence[str]) -> DockerEngineState:
    sections, values = split_sections(output)
    version = None
    for line in sections.get("version", []):
        m = _DOCKERD_VERSION.match(line.strip())
        if m:
            version = m.group(1)
    unit: dict[str, str] = {}
    for line in sections.get("unit", []):
        key, sep, value = line.strip().partition("=")
        if sep:
            unit[key] = value

    def num(key: str) -> int:
        value = unit.get(key, "0") or "0"
        if not value.isdigit():
            raise fail(f"docker.service {key}: expected a number", value)
        return int(value)

    return DockerEngineState(
        dockerd_version=version,
        cli=values.get("cli") == "yes",
        active_state=unit.get("ActiveState", "inactive"),
        sub_state=unit.get("SubState", ""),
        load_state=unit.get("LoadState", "not-found"),
        n_restarts=num("NRestarts"),
        main_start_monotonic=num("ExecMainStartTimestampMonotonic"),
    )


# --------------------------------------------------------------------------------------------
# CDI spec
# --------------------------------------------------------------------------------------------

# Driver packages whose files the CDI spec points at (Debian/Ubuntu names, NVIDIA's and the
# distributions'); the newest dpkg file list among them is "when the driver last changed".
DRIVER_PACKAGE_GLOBS = ("libnvidia-ml1", "libcuda1", "libnvidia-compute-*", "nvidia-driver*",
                        "libnvidia-ml*", "nvidia-smi")


@dataclass(frozen=True)
class CdiState(JsonMixin):
    ctk: bool = False                      # nvidia-ctk is installed
    spec_mtime: int | None = None          # epoch seconds of the spec, None = no spec
    driver_mtime: int | None = None        # newest dpkg file list of an installed driver package
    devices: list[str] = field(default_factory=list)  # `nvidia-ctk cdi list`: "nvidia.com/gpu=0", ...

    def stale_reasons(self, gpu_uuids: Sequence[str]) -> list[str]:
        """Why the spec must be (re)generated; empty when it is current."""
        if self.spec_mtime is None:
            return ["no CDI spec yet"]
        reasons = []
        if self.driver_mtime is not None and self.driver_mtime > self.spec_mtime:
            reasons.append("the driver packages changed after the spec was generated")
        missing = [u for u in gpu_uuids if f"nvidia.com/gpu={u}" not in self.devices]
        if missing:
            reasons.append(f"`nvidia-ctk cdi list` lacks {', '.join(missing)}")
        return reasons


class NvidiaCdi(FactBase):
    """The NVIDIA CDI spec: its age against the driver's packages, and the devices it lists."""

    @override
    def command(self, spec: str = "/etc/cdi/nvidia.yaml") -> str:
        lists = " ".join("/var/lib/dpkg/info/" + g + ".list" for g in DRIVER_PACKAGE_GLOBS)
        return with_values(
            'if command -v nvidia-ctk >/dev/null 2>&1; then echo "$mark ctk yes"; else echo "$mark ctk no"; fi; '
            'if [ -f "$spec" ]; then echo "$mark spec_mtime" $(stat -c %Y "$spec"); fi; '
            "m=$(stat -c %Y $lists 2>/dev/null | sort -n | tail -1); "  # globs: split and expanded
            'if [ -n "$m" ]; then echo "$mark driver_mtime" $m; fi; '
            'echo "$mark begin list"; if command -v nvidia-ctk >/dev/null 2>&1; then nvidia-ctk cdi list 2>/dev/null || true; fi',
            spec=spec, lists=lists, mark=MARK)

    @override
    def process(self, output: list[str]) -> CdiState:
        return parse_cdi(output)


def parse_cdi(output: Sequence[str]) -> CdiState:
    sections, values = split_sections(output)

    def opt_num(key: str) -> int | None:
        value = values.get(key)
        if value is None:
            return None
        if not value.isdigit():
            raise fail(f"CDI fact {key}: expected a number", value)
        return int(value)

    devices = [line.strip() for line in sections.get("list", []) if re.fullmatch(r"\S+/\S+=\S+", line.strip())]
    return CdiState(ctk=values.get("ctk") == "yes", spec_mtime=opt_num("spec_mtime"),
                    driver_mtime=opt_num("driver_mtime"), devices=devices)


# --------------------------------------------------------------------------------------------
# The running daemon: live-restore, and the containers using GPUs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DockerLiveState(JsonMixin):
    answered: bool = False                 # dockerd answered `docker info`
    live_restore: bool = False             # LiveRestoreEnabled of the running daemon
    gpu_containers: list[str] = field(default_factory=list)  # names of running containers using GPUs
    containers: int = 0                    # running containers, GPU or not


def container_uses_gpu(inspect: dict) -> bool:
    """A running container with GPUs: a --gpus request (driver nvidia or capability gpu), a CDI
    device of NVIDIA's kinds (--device nvidia.com/gpu=...), a /dev/nvidia* device, or the nvidia
    runtime with NVIDIA_VISIBLE_DEVICES naming GPUs (the toolkit's legacy mode, CUDA images set it)."""
    hc = inspect.get("HostConfig") or {}
    for req in hc.get("DeviceRequests") or []:
        caps = [c for group in (req.get("Capabilities") or []) for c in (group or [])]
        if req.get("Driver") == "nvidia" or "gpu" in caps:
            return True
        if req.get("Driver") == "cdi" and any(str(d).startswith("nvidia.com/") for d in req.get("DeviceIDs") or []):
            return True
    for dev in hc.get("Devices") or []:
        path = str(dev.get("PathOnHost") or "")
        if path.startswith(("nvidia.com/", "/dev/nvidia")):
            return True
    if hc.get("Runtime") == "nvidia":
        env = dict(e.split("=", 1) for e in ((inspect.get("Config") or {}).get("Env") or []) if "=" in e)
        if env.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower() not in ("", "void", "none"):
            return True
    return False


def parse_docker_live(output: Sequence[str]) -> DockerLiveState:
    import json

    sections, values = split_sections(output)
    live = values.get("live_restore")
    if live is None:
        return DockerLiveState()
    gpu, count = [], 0
    for line in sections.get("containers", []):
        line = line.strip()
        if not line:
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            raise fail("docker inspect: not JSON", line[:120]) from None
        count += 1
        if isinstance(doc, dict) and container_uses_gpu(doc):
            gpu.append(str(doc.get("Name") or doc.get("Id", "?")[:12]).lstrip("/"))
    return DockerLiveState(answered=True, live_restore=live == "true", gpu_containers=gpu, containers=count)


class DockerLive(FactBase):
    """The running dockerd's live-restore and its running containers that use GPUs (asked only
    when daemon.json must change: never on a no-op run)."""

    @override
    def command(self) -> str:
        return with_values(
            "command -v docker >/dev/null 2>&1 || exit 0; "
            "l=$(timeout 20 docker info --format '{{.LiveRestoreEnabled}}' 2>/dev/null) || exit 0; "
            'echo "$mark live_restore $l"; echo "$mark begin containers"; '
            "ids=$(timeout 20 docker ps -q --no-trunc 2>/dev/null); "
            "[ -z \"$ids\" ] || timeout 20 docker inspect --format '{{json .}}' $ids 2>/dev/null; true",
            mark=MARK)

    @override
    def process(self, output: list[str]) -> DockerLiveState:
        return parse_docker_live(output)


class GpuContainers(FactBase[list[str]]):
    """Running Docker containers that use the NVIDIA runtime or request GPUs (container ids)."""

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def command(self) -> str:
        return ("command -v docker >/dev/null 2>&1 || exit 0; "
                "docker ps -q | xargs -r docker inspect --format "
                "'{{.Id}} {{.HostConfig.Runtime}} {{json .HostConfig.DeviceRequests}}' 2>/dev/null || true")

    @override
    def process(self, output: list[str]) -> list[str]:
        ids = []
        for line in output:
            cid, _, rest = line.strip().partition(" ")
            if cid and ("nvidia" in rest.lower() or '"gpu"' in rest.lower()):
                ids.append(cid)
        return ids
