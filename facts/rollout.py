"""Facts a driver rollout needs besides the GPU/driver/package facts: Slurm, the /etc files a
manifest records, the versions apt can install, GPU containers, and the reboot marker."""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, fail, with_values
from .packages import quoted_package_names

_SHA_LINE = re.compile(r"^([0-9a-f]{64})  (/.+)$")


@dataclass(frozen=True)
class SlurmNodeData(JsonMixin):
    scontrol: str | None      # path of scontrol, None when Slurm's client is not installed
    node: str                 # the Slurm node name (short host name)
    state: str | None = None  # State= of `scontrol show node`, e.g. IDLE, DRAINED, MIXED+DRAIN


class SlurmNode(FactBase[SlurmNodeData]):
    """Whether Slurm's `scontrol` exists on the host, the host's Slurm node name and state."""

    @override
    def command(self) -> str:
        return ("echo \"node $(hostname -s)\"; "
                "if p=$(command -v scontrol); then echo \"scontrol $p\"; "
                "scontrol show node \"$(hostname -s)\" 2>/dev/null | tr ' ' '\\n' | grep '^State=' || true; fi")

    @override
    def process(self, output: list[str]) -> SlurmNodeData:
        node, scontrol, state = "", None, None
        for line in output:
            key, _, value = line.strip().partition(" ")
            if key == "node":
                node = value
            elif key == "scontrol":
                scontrol = value
            elif line.startswith("State="):
                state = line.strip()[len("State="):]
        return SlurmNodeData(scontrol, node, state)


class EtcFiles(FactBase[dict[str, str]]):
    """sha256 of every existing file matching the shell globs: {path: sha256}."""

    @override
    @staticmethod
    def default() -> dict[str, str]:
        return {}

    @override
    def command(self, patterns: Sequence[str]) -> str:
        for p in patterns:
            if not p.startswith("/") or not re.fullmatch(r"[\w./*?\-]+", p):
                raise ValueError(f"not an absolute glob: {p!r}")
        # the globs are expanded on purpose (checked above: no blanks); non-matches are skipped
        return with_values('for f in $globs; do [ -f "$f" ] && sha256sum "$f"; done; true', globs=" ".join(patterns))

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        files = {}
        for line in output:
            match = _SHA_LINE.match(line.rstrip("\n"))
            if not match:
                raise fail("expected 'sha256  path' from sha256sum", line)
            files[match.group(2)] = match.group(1)
        return files


class AptVersions(FactBase[dict[str, list[str]]]):
    """Versions apt can install, per package, newest first (`apt-cache madison`, no update)."""

    @override
    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    @override
    def command(self, packages: Sequence[str]) -> str:
        return " ".join(["apt-cache madison", quoted_package_names(packages), "2>/dev/null || true"])

    @override
    def process(self, output: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for line in output:
            parts = [p.strip() for p in line.split("|")]
            if len(parts) < 3:
                continue
            name, version = parts[0], parts[1]
            if version not in found.setdefault(name, []):
                found[name].append(version)
        return found


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


class PathExists(FactBase[bool]):
    """Whether `path` exists (any type)."""

    @override
    @staticmethod
    def default() -> bool:
        return False

    @override
    def command(self, path: str) -> str:
        return with_values('test -e "$path" && echo yes || echo no', path=path)

    @override
    def process(self, output: list[str]) -> bool:
        return bool(output) and output[-1].strip() == "yes"
