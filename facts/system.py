"""
System facts: OS release, and CPU/NUMA/memory resources in one command.
Only /proc, /sys, grep and the shell are used.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

from ._common import JsonMixin, begin, fail, nonblank, read_files, split_sections, with_values


@dataclass(frozen=True)
class OsReleaseData(JsonMixin):
    id: str | None = None  # 'ubuntu'
    version_id: str | None = None  # '24.04'
    version_codename: str | None = None  # 'noble'
    id_like: list[str] = field(default_factory=list)  # ['debian']
    pretty_name: str | None = None


def parse_os_release(lines: Sequence[str]) -> OsReleaseData:
    """Parse os-release(5): KEY=value lines, values optionally shell-quoted."""
    values: dict[str, str] = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, raw = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z0-9_]+", key):
            raise fail("expected KEY=value in os-release", line)
        try:
            words = shlex.split(raw)
        except ValueError as error:
            raise fail(f"badly quoted os-release value ({error})", line) from error
        values[key] = " ".join(words)
    return OsReleaseData(
        id=values.get("ID") or None,
        version_id=values.get("VERSION_ID") or None,
        version_codename=values.get("VERSION_CODENAME")
        or values.get("UBUNTU_CODENAME")
        or None,
        id_like=values.get("ID_LIKE", "").split(),
        pretty_name=values.get("PRETTY_NAME") or None,
    )


class OsRelease(FactBase[OsReleaseData]):
    """
    Returns the OS release from /etc/os-release (or /usr/lib/os-release):

    .. code:: python

        OsReleaseData(id="ubuntu", version_id="24.04", version_codename="noble",
                      id_like=["debian"], pretty_name="Ubuntu 24.04.2 LTS")
    """

    @override
    @staticmethod
    def default() -> OsReleaseData:
        return OsReleaseData()

    @override
    def command(self) -> str:
        return "cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release 2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> OsReleaseData:
        return parse_os_release(output)


@dataclass(frozen=True)
class SystemResourcesData(JsonMixin):
    logical_cpus: int = 1
    physical_cores: int = 1
    sockets: int = 1
    numa_nodes: int = 1
    memory_total_kib: int | None = None

    @property
    def memory_total_mib(self) -> int | None:
        return None if self.memory_total_kib is None else self.memory_total_kib // 1024


def _cpuinfo_pairs(lines: Sequence[str]) -> tuple[int, set[tuple[str, str]]]:
    """(processor count, {(physical id, core id)}) from filtered /proc/cpuinfo."""
    processors = 0
    pairs: set[tuple[str, str]] = set()
    physical: str | None = None
    core: str | None = None

    def flush() -> None:
        if physical is not None and core is not None:
            pairs.add((physical, core))

    for line in nonblank(lines):
        key, sep, value = line.partition(":")
        if not sep:
            raise fail("expected 'key : value' in /proc/cpuinfo", line)
        key, value = key.strip(), value.strip()
        if key == "processor":
            flush()
            processors += 1
            physical = core = None
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
    flush()
    return processors, pairs


def parse_system_resources(lines: Sequence[str]) -> SystemResourcesData:
    """Parse the output of SYSTEM_RESOURCES_COMMAND (see SystemResources)."""
    sections, _ = split_sections(lines)

    processors, pairs = _cpuinfo_pairs(sections.get("cpuinfo", []))
    if not pairs:
        # ARM servers (Grace) and some VMs print no physical/core ids in
        # /proc/cpuinfo; /sys/devices/system/cpu/cpuN/topology has them.
        topology = nonblank(sections.get("cpu-topology", []))
        for line in topology:
            parts = line.split()
            if len(parts) != 2:
                raise fail("expected 'package core' from cpu topology", line)
            pairs.add((parts[0], parts[1]))
        processors = processors or len(topology)

    nproc_lines = nonblank(sections.get("nproc", []))
    nproc = None
    if nproc_lines:
        if not nproc_lines[0].strip().isdigit():
            raise fail("expected a number from nproc", nproc_lines[0])
        nproc = int(nproc_lines[0])

    logical = processors or nproc or 1
    cores = len(pairs) or nproc or logical
    sockets = len({physical for physical, _ in pairs}) or 1

    nodes = [line.strip() for line in nonblank(sections.get("numa", []))]
    for node in nodes:
        if not re.fullmatch(r"node\d+", node):
            raise fail("expected nodeN from /sys/devices/system/node", node)

    memory = None
    for line in sections.get("meminfo", []):
        match = re.fullmatch(r"MemTotal:\s+(\d+)\s*kB", line.strip())
        if match:
            memory = int(match.group(1))
        elif line.startswith("MemTotal:"):
            raise fail("unexpected MemTotal line in /proc/meminfo", line)

    return SystemResourcesData(
        logical_cpus=logical,
        physical_cores=cores,
        sockets=sockets,
        numa_nodes=len(nodes) or 1,
        memory_total_kib=memory,
    )


def system_resources_command(proc_root: str = "/proc", sys_root: str = "/sys") -> str:
    """The SystemResources command; the roots exist so tests can use fake trees."""
    return with_values("\n".join(
        [
            begin("cpuinfo"),
            """grep -E '^(processor|physical id|core id)[[:space:]]*:' "$proc/cpuinfo" 2>/dev/null""",
            begin("cpu-topology"),
            'for c in "$cpus"/cpu[0-9]*/topology; do',
            '  if [ -r "$c/physical_package_id" ] && [ -r "$c/core_id" ]; then',
            # the shell's read, not cat: two processes per CPU are hundreds on a big server
            '    ' + read_files("$c", physical_package_id="pkg", core_id="core") + 'echo "$pkg $core"',
            "  fi",
            "done",
            begin("nproc"),
            "nproc 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null",
            begin("numa"),
            'for n in "$nodes"/node[0-9]*; do',
            '  if [ -d "$n" ]; then echo "${n##*/}"; fi',
            "done",
            begin("meminfo"),
            """grep '^MemTotal:' "$proc/meminfo" 2>/dev/null""",
            "true",
        ]
    ), proc=proc_root, cpus=sys_root + "/devices/system/cpu", nodes=sys_root + "/devices/system/node")


class SystemResources(FactBase[SystemResourcesData]):
    """
    Returns CPU, NUMA and memory totals: physical cores are the unique
    (physical id, core id) pairs of /proc/cpuinfo (or of /sys cpu topology,
    falling back to nproc); sockets the unique physical ids; NUMA nodes the
    /sys/devices/system/node/nodeN entries (1 when there are none):

    .. code:: python

        SystemResourcesData(logical_cpus=224, physical_cores=112, sockets=2,
                            numa_nodes=2, memory_total_kib=2113389544)
    """

    @override
    @staticmethod
    def default() -> SystemResourcesData:
        return SystemResourcesData()

    @override
    def command(self) -> str:
        return system_resources_command()

    @override
    def process(self, output: list[str]) -> SystemResourcesData:
        return parse_system_resources(output)


_SHA_LINE = re.compile(r"^([0-9a-f]{64})  (/.+)$")


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


class UnitActive(FactBase[str]):
    """
    ``systemctl is-active UNIT``: "active", "inactive", "failed", "activating"... or
    "unknown" where the unit does not exist or systemctl is missing:

    .. code:: python

        host.get_fact(UnitActive, unit="nvidia-fabricmanager.service")  # "active"
    """

    @override
    @staticmethod
    def default() -> str:
        return "unknown"

    @override
    def command(self, unit: str) -> StringCommand:
        return StringCommand("systemctl", "is-active", QuoteString(unit), "2>/dev/null", "||", "true")

    @override
    def process(self, output: list[str]) -> str:
        words = [line.strip() for line in output if line.strip()]
        return words[0] if words else "unknown"
