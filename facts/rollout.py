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


# The reason every drain gpufleet sets starts with this: a node drained for another reason (by an
# admin, by Slurm's health check) is never resumed by gpufleet.
SLURM_REASON_TAG = "gpufleet"


@dataclass(frozen=True)
class SlurmNodeData(JsonMixin):
    scontrol: str | None      # path of scontrol, None when Slurm's client is not installed
    node: str                 # the Slurm node name (rollout_slurm_node_name, default the short host name)
    state: str | None = None  # sinfo's long state: idle, mixed, allocated, draining, drained, down*...; None = unknown
    reason: str = ""          # the drain/down reason Slurm shows (sinfo -R)
    error: str = ""           # why the state could not be read (slurmctld unreachable, node unknown)
    available_features: tuple[str, ...] = ()   # scontrol show node: AvailableFeatures
    active_features: tuple[str, ...] = ()      # ActiveFeatures

    @property
    def drain_set(self) -> bool:
        """Drain requested (draining: jobs still running; or drained)."""
        return bool(self.state and self.state.startswith(("drain", "drng")))

    @property
    def drained(self) -> bool:
        """Drained and no job left on it (sinfo: drained, not draining)."""
        return bool(self.state and self.state.startswith("drained"))

    @property
    def ours(self) -> bool:
        """Drained by gpufleet (the reason carries its tag)."""
        return self.reason.startswith(SLURM_REASON_TAG)


class SlurmNode(FactBase[SlurmNodeData]):
    """Whether Slurm's `scontrol` exists on the host, the host's Slurm node name, its state and
    drain reason (from sinfo, which asks slurmctld)."""

    @override
    def command(self, node: str = "") -> str:
        if node and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", node):
            raise ValueError(f"not a Slurm node name: {node!r}")
        return with_values(
                "n=${node:-$(hostname -s)}; echo \"node $n\"; "
                "if p=$(command -v scontrol); then echo \"scontrol $p\"; "
                "out=$(sinfo -h -N -n \"$n\" -o '%T|%E' 2>&1); rc=$?; "
                "if [ $rc -ne 0 ]; then echo \"error $out\" | head -1; "
                "elif [ -z \"$out\" ]; then echo \"error node $n is not in the Slurm cluster\"; "
                "else echo \"$out\" | head -1 | sed 's/^/state /'; "
                "scontrol show node -o \"$n\" 2>/dev/null | tr ' ' '\\n' | sed -n 's/^\\(Available\\|Active\\)Features=/features \\1 /p'; "
                "fi; fi", node=node)

    @override
    def process(self, output: list[str]) -> SlurmNodeData:
        node, scontrol, state, reason, error = "", None, None, "", ""
        available: tuple[str, ...] = ()
        active: tuple[str, ...] = ()
        for line in output:
            key, _, value = line.strip().partition(" ")
            if key == "node":
                node = value
            elif key == "scontrol":
                scontrol = value
            elif key == "state":
                state, _, reason = value.partition("|")
                reason = "" if reason == "none" else reason
            elif key == "error":
                error = value
            elif key == "features":
                kind, _, names = value.partition(" ")
                found = tuple(f for f in names.split(",") if f and f != "(null)")
                if kind == "Available":
                    available = found
                elif kind == "Active":
                    active = found
        return SlurmNodeData(scontrol, node, state, reason, error, available, active)


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


@dataclass(frozen=True)
class PackageChangeData(JsonMixin):
    running: bool               # gpufleet-package-change.service is still at work
    result: str | None          # its Result= (success, exit-code, signal...), None when never run
    status: int | None          # its main process's exit status
    audit: tuple[str, ...]      # `dpkg --audit` lines: packages an interrupted change left half done


class PackageChange(FactBase[PackageChangeData]):
    """The last driver package change run as a transient unit (operations/driver_upgrade.py) and
    what `dpkg --audit` reports."""

    @override
    def command(self) -> str:
        return ("systemctl show -p LoadState -p SubState -p Result -p ExecMainStatus "
                "gpufleet-package-change.service 2>/dev/null; "
                "dpkg --audit 2>&1 | sed 's/^/audit: /'; true")

    @override
    def process(self, output: list[str]) -> PackageChangeData:
        props, audit = {}, []
        for line in output:
            if line.startswith("audit: "):
                if line[7:].strip():
                    audit.append(line[7:].rstrip())
            elif "=" in line:
                key, _, value = line.strip().partition("=")
                props[key] = value
        loaded = props.get("LoadState") == "loaded"
        status = props.get("ExecMainStatus", "")
        return PackageChangeData(
            running=loaded and props.get("SubState", "") in ("start", "start-pre", "start-post", "running"),
            result=props.get("Result") if loaded else None,
            status=int(status) if loaded and status.isdigit() else None,
            audit=tuple(audit))
