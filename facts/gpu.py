"""
GPU state as seen through nvidia-smi, gathered by **one** remote command
(``GpuState``) so a deploy asks the host once and gets everything it needs:
per-GPU identity, memory, persistence and clocks; the supported clock pairs;
the topology matrix; the running compute processes; and a status telling why
the rest is empty (no nvidia-smi, driver not loaded, driver/library mismatch).

The individual parsers are pure functions so they can be tested on each
recorded nvidia-smi output separately.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import FactParseError, JsonMixin, begin, fail, nonblank, opt_int, opt_str, split_sections, with_values
from .mig import MigStateData, parse_mig

GpuStatus = Literal["ok", "no-nvidia-smi", "driver-not-loaded", "mismatch", "error"]

# Fields asked for by GpuState, in this order (the noheader output has no header
# to map columns by, so the parser needs the list).
GPU_QUERY_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "pci.bus_id",
    "pci.device_id",
    "driver_version",
    "memory.total",
    "persistence_mode",
    "clocks.applications.graphics",
    "clocks.applications.memory",
    "clocks.default_applications.graphics",
    "clocks.default_applications.memory",
    "clocks.max.graphics",
    "clocks.max.memory",
    "compute_cap",
)

# Asked in the same query, after GPU_QUERY_FIELDS, and printed apart in MigState's shape
# (index, bus id, these): a no-op needs MigState's own nvidia-smi call only when a GPU has MIG
# on or pending (gpufleet/config/hostfacts.py mig_state), one nvidia-smi start fewer per run.
MIG_MODE_FIELDS: tuple[str, ...] = ("mig.mode.current", "mig.mode.pending")

# The compute processes as GpuState asks them: fields no user can write. A process's name is its
# argv[0], which its user chooses and nvidia-smi prints raw, newlines and all (seen on an H200):
# read apart, in PROCESS_NAME_FIELDS, and sent back hex-encoded (parse_process_names), so that no
# text a user wrote can start a line of GpuState's output (a section marker, a process, a GPU).
COMPUTE_APPS_FIELDS: tuple[str, ...] = ("pid", "used_memory", "gpu_uuid")
PROCESS_NAME_FIELDS: tuple[str, ...] = ("pid", "process_name")

# nvidia-smi accepts several spellings for a field, and prints a header that may
# differ from the spelling asked for (it accepts clocks_throttle_reasons.* but
# prints clocks_event_reasons.*). Normalise every spelling to one name.
_FIELD_ALIASES = {
    "clocks.applications.gr": "clocks.applications.graphics",
    "clocks.applications.mem": "clocks.applications.memory",
    "clocks.default_applications.gr": "clocks.default_applications.graphics",
    "clocks.default_applications.mem": "clocks.default_applications.memory",
    "clocks.max.gr": "clocks.max.graphics",
    "clocks.max.mem": "clocks.max.memory",
    "gpu_bus_id": "pci.bus_id",
    "used_gpu_memory": "used_memory",
}


def _normalise_field(name: str) -> str:
    # Headers carry units ("memory.total [MiB]"); the field name is the first word.
    name = name.strip().split(" [", 1)[0].strip()
    name = name.replace("clocks_throttle_reasons.", "clocks_event_reasons.")
    return _FIELD_ALIASES.get(name, name)


class ClockPair(NamedTuple):
    """(memory MHz, graphics MHz): the order nvidia-smi -ac takes them in."""

    mem: int
    gfx: int


@dataclass(frozen=True)
class GpuInfo(JsonMixin):
    index: int
    uuid: str
    name: str
    bus_id: str  # nvidia-smi form: '00000000:00:06.0'
    device_id: str | None  # '0x2335' (None when the query did not ask for it)
    driver_version: str | None
    memory_mib: int | None
    persistence: bool | None
    app_clocks: ClockPair | None
    default_app_clocks: ClockPair | None
    max_clocks: ClockPair | None
    compute_cap: str | None  # '9.0'
    # Any other queried field, by (normalised) name, as printed; None for N/A.
    extra: dict[str, str | None] = field(default_factory=dict)

    @property
    def pci_slot(self) -> str:
        """The bus id in sysfs form ('0000:00:06.0'), as in facts.pci."""
        domain, _, rest = self.bus_id.partition(":")
        return f"{int(domain, 16):04x}:{rest.lower()}"


@dataclass(frozen=True)
class GpuProcess(JsonMixin):
    pid: int
    process_name: str | None
    used_memory_mib: int | None
    gpu_uuid: str | None


@dataclass(frozen=True)
class GpuTopology(JsonMixin):
    """
    ``nvidia-smi topo -m``: ``links[a][b]`` is the connection between devices a
    and b ('X' for self, 'NV18', 'PIX', 'SYS', ...); affinities per device.
    """

    devices: list[str] = field(default_factory=list)  # ['GPU0', 'GPU1', 'NIC0']
    links: dict[str, dict[str, str]] = field(default_factory=dict)
    cpu_affinity: dict[str, str | None] = field(default_factory=dict)  # {'GPU0': '0-31'}
    numa_affinity: dict[str, str | None] = field(default_factory=dict)  # {'GPU0': '0'}
    gpu_numa_id: dict[str, str | None] = field(default_factory=dict)  # {'GPU0': None}
    nics: dict[str, str] = field(default_factory=dict)  # {'NIC0': 'mlx5_0'}

    def link(self, a: str, b: str) -> str | None:
        return self.links.get(a, {}).get(b)

    def nvlinks(self, a: str, b: str) -> int:
        """Number of bonded NVLinks between a and b (0 when not NVLink-connected)."""
        match = re.fullmatch(r"NV(\d+)", self.link(a, b) or "")
        return int(match.group(1)) if match else 0


@dataclass(frozen=True)
class GpuStateData(JsonMixin):
    status: GpuStatus
    gpus: list[GpuInfo] = field(default_factory=list)
    # Per GPU bus id ('00000000:00:06.0'): {memory MHz: [graphics MHz, highest first]}
    supported_clocks: dict[str, dict[int, list[int]]] = field(default_factory=dict)
    topology: GpuTopology = field(default_factory=GpuTopology)
    processes: list[GpuProcess] = field(default_factory=list)
    # What nvidia-smi said when status is not 'ok'.
    error: str | None = None
    # Parts that failed while the main query worked (e.g. topo -m in a VM).
    warnings: list[str] = field(default_factory=list)
    # On a mismatch, newer nvidia-smi prints the user-space NVML version.
    nvml_version: str | None = None
    # Every GPU's MIG mode (no instances), as MigState's own query reads it; None: not asked.
    mig_modes: MigStateData | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def driver_version(self) -> str | None:
        versions = {gpu.driver_version for gpu in self.gpus if gpu.driver_version}
        return versions.pop() if len(versions) == 1 else None

    def gpu(self, bus_id: str) -> GpuInfo | None:
        for gpu in self.gpus:
            if gpu.bus_id == bus_id:
                return gpu
        return None


# ---------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------


def _split_csv(line: str, count: int, what: str) -> list[str]:
    # nvidia-smi separates values with ", " and never quotes; GPU names contain
    # no comma (process names may: parse_compute_apps handles those itself).
    parts = [part.strip() for part in line.split(",")]
    if len(parts) != count:
        raise fail(f"expected {count} comma-separated values in {what}, got {len(parts)}", line)
    return parts


def _looks_like_header(line: str, first_field: str) -> bool:
    return line.split(",", 1)[0].strip() == first_field


def _pair(mem: int | None, gfx: int | None) -> ClockPair | None:
    if mem is None or gfx is None:
        return None
    return ClockPair(mem, gfx)


def _persistence(value: str | None, line: str) -> bool | None:
    if value is None:
        return None
    if value in ("Enabled", "On"):
        return True
    if value in ("Disabled", "Off"):
        return False
    raise fail("expected Enabled/Disabled for persistence_mode", line)


def _device_id(value: str | None, line: str) -> str | None:
    # pci.device_id is the combined id 0xDDDDVVVV (device, vendor): 0x233510DE.
    if value is None:
        return None
    match = re.fullmatch(r"0x([0-9a-fA-F]{4})([0-9a-fA-F]{4})", value)
    if not match:
        raise fail("expected pci.device_id like 0x233510DE", line)
    return "0x" + match.group(1).lower()


_REQUIRED_GPU_FIELDS = ("index", "uuid", "name", "pci.bus_id")


def parse_query_gpu(lines: Sequence[str], fields: Sequence[str] = GPU_QUERY_FIELDS) -> list[GpuInfo]:
    """
    Parse ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``.

    With a header line (``--format=csv``) columns are mapped by the header and
    ``fields`` is ignored; without one they are mapped by ``fields`` (the list
    the command asked for). Units ("143771 MiB", "1980 MHz") are accepted.
    """
    lines = nonblank(lines)
    if lines and _looks_like_header(lines[0], "index"):
        names = [_normalise_field(name) for name in lines[0].split(",")]
        lines = lines[1:]
    else:
        names = [_normalise_field(name) for name in fields]
    missing = [name for name in _REQUIRED_GPU_FIELDS if name not in names]
    if missing:
        raise fail(f"query-gpu fields lack {', '.join(missing)}")

    gpus = []
    for line in lines:
        values = dict(zip(names, _split_csv(line, len(names), "query-gpu output")))
        raw = {name: opt_str(value) for name, value in values.items()}

        def number(name: str) -> int | None:  # called only within this iteration
            return opt_int(values[name], name) if name in values else None  # noqa: B023

        index = number("index")
        uuid, name, bus_id = raw["uuid"], raw["name"], raw["pci.bus_id"]
        if index is None or uuid is None or name is None or bus_id is None:
            raise fail("query-gpu line lacks index, uuid, name or bus id", line)
        if not re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]", bus_id):
            raise fail("expected a PCI bus id like 00000000:00:06.0", line)
        known = {
            "index", "uuid", "name", "pci.bus_id", "pci.device_id", "driver_version",
            "memory.total", "persistence_mode", "compute_cap",
            "clocks.applications.graphics", "clocks.applications.memory",
            "clocks.default_applications.graphics", "clocks.default_applications.memory",
            "clocks.max.graphics", "clocks.max.memory",
        }  # fmt: skip
        gpus.append(
            GpuInfo(
                index=index,
                uuid=uuid,
                name=name,
                bus_id=bus_id,
                device_id=_device_id(raw.get("pci.device_id"), line),
                driver_version=raw.get("driver_version"),
                memory_mib=number("memory.total"),
                persistence=_persistence(raw.get("persistence_mode"), line),
                app_clocks=_pair(
                    number("clocks.applications.memory"), number("clocks.applications.graphics")
                ),
                default_app_clocks=_pair(
                    number("clocks.default_applications.memory"),
                    number("clocks.default_applications.graphics"),
                ),
                max_clocks=_pair(number("clocks.max.memory"), number("clocks.max.graphics")),
                compute_cap=raw.get("compute_cap"),
                extra={key: value for key, value in raw.items() if key not in known},
            )
        )
    return gpus


_BUS_LINE = re.compile(r"^GPU ([0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])\s*$")
_KEY_VALUE = re.compile(r"^\s+(\S[^:]*?)\s*:\s*(.*?)\s*$")


def parse_supported_clocks(lines: Sequence[str]) -> dict[str, dict[int, list[int]]]:
    """
    Parse ``nvidia-smi -q -d SUPPORTED_CLOCKS`` into
    ``{bus_id: {memory MHz: [graphics MHz, ...]}}`` (graphics in printed
    order, highest first). GPUs reporting "Supported Clocks : N/A" map to {}.
    """
    result: dict[str, dict[int, list[int]]] = {}
    current: dict[int, list[int]] | None = None
    memory: int | None = None
    for line in lines:
        bus = _BUS_LINE.match(line)
        if bus:
            current = result.setdefault(bus.group(1), {})
            memory = None
            continue
        match = _KEY_VALUE.match(line)
        if not match or current is None:
            # Banner, timestamp, driver version and "Supported Clocks" headings.
            continue
        key, value = match.groups()
        if key == "Memory":
            memory = opt_int(value, "supported memory clock")
            if memory is not None:
                current.setdefault(memory, [])
        elif key == "Graphics":
            if memory is None:
                raise fail("supported graphics clock before any memory clock", line)
            gfx = opt_int(value, "supported graphics clock")
            if gfx is not None:
                current[memory].append(gfx)
    return result


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TOPO_DEVICE = re.compile(r"^(GPU|NIC|CPU)\d+$")
_TOPO_ATTRIBUTES = {
    "CPU Affinity": "cpu_affinity",
    "NUMA Affinity": "numa_affinity",
    "GPU NUMA ID": "gpu_numa_id",
}


def parse_topology(lines: Sequence[str]) -> GpuTopology:
    """
    Parse ``nvidia-smi topo -m``: a tab-separated matrix whose header may carry
    ANSI underline codes, followed by attribute columns (CPU Affinity, NUMA
    Affinity, GPU NUMA ID), a legend and, with NICs, a "NIC Legend".
    """
    cleaned = [_ANSI.sub("", line) for line in lines]
    body = nonblank(cleaned)
    if not body:
        return GpuTopology()
    header = [cell.strip() for cell in body[0].split("\t")]
    columns = [cell for cell in header if cell]
    devices = [cell for cell in columns if _TOPO_DEVICE.match(cell)]
    attributes = columns[len(devices) :]
    if not devices or columns[: len(devices)] != devices:
        raise fail("topo -m header does not start with device columns", lines[0])

    topology = GpuTopology(devices=devices)
    in_nic_legend = False
    for line in body[1:]:
        stripped = line.strip()
        if stripped == "NIC Legend:":
            in_nic_legend = True
            continue
        if in_nic_legend:
            nic = re.fullmatch(r"(NIC\d+)\s*:\s*(\S+)", stripped)
            if nic:
                topology.nics[nic.group(1)] = nic.group(2)
            continue
        cells = [cell.strip() for cell in line.split("\t")]
        if not _TOPO_DEVICE.match(cells[0]):
            # Legend lines ("  X    = Self", ...).
            continue
        name, row = cells[0], cells[1:]
        if len(row) < len(devices):
            raise fail(f"topo -m row has fewer than {len(devices)} link cells", line)
        topology.links[name] = {
            device: row[position] for position, device in enumerate(devices) if row[position]
        }
        # The attribute cells are tab-separated with an occasional empty cell
        # (the real H200 output has "0\t\tN/A" under "NUMA Affinity\tGPU NUMA ID"),
        # so map the non-empty ones in order.
        values = [cell for cell in row[len(devices) :] if cell]
        for position, attribute in enumerate(attributes):
            target = _TOPO_ATTRIBUTES.get(attribute)
            if target is None:
                continue
            value = values[position] if position < len(values) else ""
            getattr(topology, target)[name] = opt_str(value)
    if not topology.links:
        raise fail("topo -m printed a header but no device rows", lines[0])
    return topology


def parse_compute_apps(
    lines: Sequence[str], fields: Sequence[str] = COMPUTE_APPS_FIELDS
) -> list[GpuProcess]:
    """
    Parse ``nvidia-smi --query-compute-apps=... --format=csv[,noheader,nounits]``
    (header optional, as for parse_query_gpu). A process name containing ", "
    is kept whole.
    """
    lines = nonblank(lines)
    if lines and _looks_like_header(lines[0], "pid"):
        names = [_normalise_field(name) for name in lines[0].split(",")]
        lines = lines[1:]
    else:
        names = [_normalise_field(name) for name in fields]
    if "pid" not in names:
        raise fail("query-compute-apps fields lack pid")
    processes = []
    for line in lines:
        if line.strip() == "No running processes found":
            continue
        parts = [part.strip() for part in line.split(",")]
        extra = len(parts) - len(names)
        if extra < 0:
            raise fail(f"expected {len(names)} comma-separated values in compute-apps output", line)
        if extra and "process_name" in names:
            at = names.index("process_name")
            parts[at : at + extra + 1] = [", ".join(parts[at : at + extra + 1])]
        elif extra:
            raise fail(f"expected {len(names)} comma-separated values in compute-apps output", line)
        values = dict(zip(names, parts))
        pid = opt_int(values["pid"], "pid")
        if pid is None:
            raise fail("compute-apps line without a pid", line)
        processes.append(
            GpuProcess(
                pid=pid,
                process_name=opt_str(values.get("process_name", "")),
                used_memory_mib=(
                    opt_int(values["used_memory"], "used_memory")
                    if "used_memory" in values
                    else None
                ),
                gpu_uuid=opt_str(values.get("gpu_uuid", "")),
            )
        )
    return processes


_HEX = re.compile(r"(?:[0-9a-f]{2})*")
_NAME_RECORD = re.compile(r"(\d+), (.*)", re.DOTALL)


def printable(text: str) -> str:
    """`text` with every character a terminal or a log would act on (newline, escape, ...)
    written as its Python escape: a process name as a message may show it."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def parse_process_names(lines: Sequence[str], pids: Sequence[int]) -> dict[int, str | None] | None:
    """{pid: name} from GpuState's process-names section: nvidia-smi's `pid, process_name` lines,
    hex-encoded on the host. A name may hold newlines, so a record starts only where a line begins
    with the pid of a process the compute-apps section listed; any other line continues the name
    before it. The names are text for people (escaped by printable()), never for a decision: a name
    shaped to look like another record can only mislabel a process, never add or hide one (the
    processes are compute-apps' own lines). None: not hex (not this script's output)."""
    text = "".join(line.strip() for line in lines)
    if not _HEX.fullmatch(text):
        return None
    known, names = {str(pid) for pid in pids}, {}
    current: str | None = None
    # each record ends with a newline: the last one's is taken off, the others' are the split
    for line in bytes.fromhex(text).decode("utf-8", "replace").removesuffix("\n").split("\n"):
        record = _NAME_RECORD.fullmatch(line)
        if record and record.group(1) in known and int(record.group(1)) not in names:
            current = record.group(1)
            names[int(current)] = record.group(2)
        elif current is not None:
            names[int(current)] += "\n" + line
    return {pid: opt_str(printable(name)) for pid, name in names.items()}


# ---------------------------------------------------------------------------
# The fact
# ---------------------------------------------------------------------------

_QUERY = ",".join(GPU_QUERY_FIELDS)
_APPS = ",".join(COMPUTE_APPS_FIELDS)

# One POSIX-sh script. Each part is preceded by "::gpufleet:: begin NAME" and
# followed by "::gpufleet:: rc NAME N". When the first query fails (no driver,
# mismatch, ...) the others would fail the same way, so the script stops there.
# nvidia-smi hangs on a wedged GPU, hence `timeout` when the host has it.
# nvidia-smi is looked for in PATH and in the usual driver locations (a
# non-login SSH shell may have a short PATH). The script always exits 0: a
# failing nvidia-smi is a state to report, not a failed fact.
#
# The supported clock pairs are fixed for a board and driver, and printing them is one of the
# slower nvidia-smi calls, so root keeps them for the boot: in STATIC_CACHE (/run: gone at
# reboot), a folder only root can enter (created 0700 by root; used only when it is a real folder,
# root's, 0700, so nobody else can have put or linked anything there), keyed by the boot, the
# nvidia-smi used and the whole query-gpu answer (GPU identities, driver version, clocks): any
# change to those asks nvidia-smi again. The topology is not kept: an NVLink that goes down must
# show in the next run. Not root (no sudo): nothing kept, every call made.
STATIC_CACHE = "/run/gpufleet-facts"
_STATIC_PART = "\n".join([
    "k=$( { cat /proc/sys/kernel/random/boot_id; echo \"$smi\"; printf '%s\\n' \"$q\"; } 2>/dev/null | cksum)",
    'f=$static_cache/gpu-static; ok=',
    'if [ "$(id -u)" = 0 ]; then',
    '  [ -e "$static_cache" ] || mkdir -m 700 "$static_cache" 2>/dev/null',
    '  if [ -d "$static_cache" ] && [ ! -L "$static_cache" ] && [ "$(stat -c \'%u %a\' "$static_cache" 2>/dev/null)" = "0 700" ]; then ok=1; fi',
    "fi",
    'if [ -n "$ok" ] && [ -f "$f" ] && [ ! -L "$f" ] && [ "$(head -n 1 "$f")" = "$k" ]; then',
    '  tail -n +2 "$f"',
    "else",
    "  s=$(" + begin("supported-clocks") + '; $t "$smi" -q -d SUPPORTED_CLOCKS 2>&1; '
    'echo "::gpufleet:: rc supported-clocks $?")',
    "  printf '%s\\n' \"$s\"",
    '  case "$s" in',
    '    *"::gpufleet:: rc supported-clocks 0") if [ -n "$ok" ]; then',
    '      n=$(mktemp "$static_cache/.gpu-static.XXXXXX" 2>/dev/null) && printf \'%s\\n%s\\n\' "$k" "$s" > "$n" && mv -f "$n" "$f" 2>/dev/null',
    "    fi ;;",
    "  esac",
    "fi",
])


def gpu_state_command(processes: bool = True, static_cache: str = STATIC_CACHE) -> str:
    """GpuState's script (tests give `static_cache` a folder of their own)."""
    lines = [
        "smi=$(command -v nvidia-smi 2>/dev/null) || smi=",
        'if [ -z "$smi" ]; then',
        "  for p in /usr/bin/nvidia-smi /usr/local/nvidia/bin/nvidia-smi"
        " /run/current-system/sw/bin/nvidia-smi /opt/nvidia/bin/nvidia-smi; do",
        '    if [ -x "$p" ]; then smi=$p; break; fi',
        "  done",
        "fi",
        'if [ -z "$smi" ]; then echo "::gpufleet:: status no-nvidia-smi"; exit 0; fi',
        "t=; if command -v timeout >/dev/null 2>&1; then t='timeout 60'; fi",
        begin("query-gpu"),
        'q=$($t "$smi" --query-gpu="$gpu_query,$mig_query" --format=csv,noheader,nounits 2>&1)',
        "rc=$?",
        # the MIG columns go to a section of their own, in MigState's shape; the query-gpu
        # section (and the static cache's key) stay what they were without them
        'if [ "$rc" -eq 0 ]; then',
        "  m=$(printf '%s\\n' \"$q\" | cut -d, -f1,$bus_column,$((gpu_columns + 1))-)",
        "  q=$(printf '%s\\n' \"$q\" | cut -d, -f1-$gpu_columns)",
        "fi",
        "if [ -n \"$q\" ]; then printf '%s\\n' \"$q\"; fi",
        'echo "::gpufleet:: rc query-gpu $rc"',
        'if [ "$rc" -ne 0 ]; then exit 0; fi',
        begin("mig-modes"),
        "printf '%s\\n' \"$m\"",
        _STATIC_PART,
        begin("topology"),
        '$t "$smi" topo -m 2>&1',
        'echo "::gpufleet:: rc topology $?"',
    ]
    if processes:  # planning and validation never look at them: a no-op saves the call
        lines += [
            begin("compute-apps"),
            'a=$($t "$smi" --query-compute-apps="$gpu_apps" --format=csv,noheader,nounits 2>&1); rc=$?',
            "if [ -n \"$a\" ]; then printf '%s\\n' \"$a\"; fi",
            'echo "::gpufleet:: rc compute-apps $rc"',
            # the names, only when a process runs: one line of hex (nothing a user wrote is
            # printed as text), at most 64 KiB of nvidia-smi's answer
            'if [ "$rc" -eq 0 ] && [ -n "$a" ]; then',
            "  " + begin("process-names"),
            '  $t "$smi" --query-compute-apps="$gpu_names" --format=csv,noheader 2>/dev/null | head -c 65536'
            " | od -An -v -tx1 | tr -d ' \\n'; echo",
            "fi",
        ]
    apps = {"gpu_apps": _APPS, "gpu_names": ",".join(PROCESS_NAME_FIELDS)} if processes else {}
    return with_values("\n".join([*lines, "exit 0"]), gpu_query=_QUERY, **apps, static_cache=static_cache,
                       mig_query=",".join(MIG_MODE_FIELDS), gpu_columns=len(GPU_QUERY_FIELDS),
                       bus_column=GPU_QUERY_FIELDS.index("pci.bus_id") + 1)


GPU_STATE_COMMAND = gpu_state_command()
GPU_STATE_COMMAND_WITHOUT_PROCESSES = gpu_state_command(processes=False)


def _failure_status(rc: int, text: str) -> GpuStatus:
    if "Driver/library version mismatch" in text:
        return "mismatch"
    # Exit code 9 is documented as "NVIDIA driver is not loaded"; the message is
    # "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA
    # driver. Make sure that the latest NVIDIA driver is installed and running."
    if rc == 9 or "couldn't communicate with the NVIDIA driver" in text:
        return "driver-not-loaded"
    return "error"


def parse_gpu_state(lines: Sequence[str]) -> GpuStateData:
    """Parse the whole output of GPU_STATE_COMMAND (see GpuState)."""
    sections, values = split_sections(lines, strict=True)
    if values.get("status") == "no-nvidia-smi":
        # the script prints it alone, or not at all
        if len(values) > 1 or any(nonblank(part) for part in sections.values()):
            raise fail("GpuState output has a no-nvidia-smi status among other output", "\n".join(lines[:5]))
        return GpuStateData(status="no-nvidia-smi")
    if "rc query-gpu" not in values:
        raise fail(
            "GpuState output has neither a status nor a query-gpu exit code",
            "\n".join(lines[:5]),
        )
    rc_text = values["rc query-gpu"]
    if not rc_text.isdigit():
        raise fail("non-numeric exit code for query-gpu", rc_text)
    rc = int(rc_text)
    query_lines = sections.get("query-gpu", [])
    if rc != 0:
        text = "\n".join(nonblank(query_lines)).strip()
        if rc == 124:
            text = (text + "\n" if text else "") + "nvidia-smi timed out (60 s)"
        nvml = re.search(r"NVML library version:\s*(\S+)", text)
        return GpuStateData(
            status=_failure_status(rc, text),
            error=text or f"nvidia-smi exited with {rc}",
            nvml_version=nvml.group(1) if nvml else None,
        )

    gpus = parse_query_gpu(query_lines)
    warnings = []
    parsed: dict[str, object] = {}
    parsers = {
        "supported-clocks": parse_supported_clocks,
        "topology": parse_topology,
        "compute-apps": parse_compute_apps,
    }
    mig_modes = None
    if "mig-modes" in sections:
        try:
            mig_modes = parse_mig(nonblank(sections["mig-modes"]))
        except FactParseError:  # not in MigState's shape: MigState is asked on its own
            warnings.append("mig-modes: not in the expected shape")
    for name, parser in parsers.items():
        part_rc = values.get(f"rc {name}")
        if name == "compute-apps" and part_rc is None and name not in sections:
            continue  # not asked (GpuState(processes=False)): no processes, and no warning
        if part_rc != "0":
            message = " ".join(nonblank(sections.get(name, []))).strip()
            warnings.append(f"{name}: exit {part_rc}: {message}"[:500])
            continue
        parsed[name] = parser(sections.get(name, []))

    processes: list[GpuProcess] = parsed.get("compute-apps", [])  # type: ignore[assignment]
    if "process-names" in sections:
        names = parse_process_names(sections["process-names"], [p.pid for p in processes])
        if names is None:
            warnings.append("process-names: not in the expected shape")
        else:
            processes = [dataclasses.replace(p, process_name=names.get(p.pid)) for p in processes]
    return GpuStateData(
        status="ok",
        gpus=gpus,
        supported_clocks=parsed.get("supported-clocks", {}),  # type: ignore[arg-type]
        topology=parsed.get("topology", GpuTopology()),  # type: ignore[arg-type]
        processes=processes,
        warnings=warnings,
        mig_modes=mig_modes,
    )


class GpuState(FactBase[GpuStateData]):
    """
    Returns everything nvidia-smi knows about the host's GPUs, from one remote
    command, with a ``status`` saying why it is empty when it is
    ('ok' | 'no-nvidia-smi' | 'driver-not-loaded' | 'mismatch' | 'error'):

    .. code:: python

        GpuStateData(
            status="ok",
            gpus=[
                GpuInfo(index=0, uuid="GPU-517ec679-...", name="NVIDIA H200",
                        bus_id="00000000:00:06.0", device_id="0x2335",
                        driver_version="580.159.04", memory_mib=143771,
                        persistence=True, app_clocks=(3201, 1980),
                        default_app_clocks=(3201, 1980), max_clocks=(3201, 1980),
                        compute_cap="9.0"),
                ...
            ],
            supported_clocks={"00000000:00:06.0": {3201: [1980, 1965, ...], 2201: [...]}},
            topology=GpuTopology(devices=["GPU0", "GPU1"],
                                 links={"GPU0": {"GPU0": "X", "GPU1": "NV18"}, ...},
                                 cpu_affinity={"GPU0": "0-31", ...}, ...),
            processes=[],
            error=None,
        )
    """

    @override
    @staticmethod
    def default() -> GpuStateData:
        return GpuStateData(status="no-nvidia-smi")

    @override
    def command(self, processes: bool = True) -> str:
        # processes=False leaves out the compute processes (then always []).
        return GPU_STATE_COMMAND if processes else GPU_STATE_COMMAND_WITHOUT_PROCESSES

    @override
    def process(self, output: list[str]) -> GpuStateData:
        return parse_gpu_state(output)
