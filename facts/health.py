"""
GPU health as nvidia-smi and the kernel log report it, in **one** remote command (``GpuHealth``):
per GPU the ECC mode and error counts, the row remapper (Ampere and later) or retired pages
(earlier GPUs), the clock event (throttle) reasons, temperatures, power against its default
limit, the PCIe link against its maximum, compute and MIG mode, the NVLink fabric state, the
state of each NVLink (``nvidia-smi nvlink -s``), and the XID events the NVIDIA driver logged
since boot, or since the health watch last reset that GPU. Read-only. The classes and fixes
live in the core (gpufleet/plans/health.py); this only reads.

The field list is the one recorded on a live H200 (tests/fixtures/nvidia/h200-x1/health/
query-health-noheader.txt), in this order: the noheader output is mapped by position.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, begin, fail, opt_int, opt_str, split_sections

HEALTH_FIELDS: tuple[str, ...] = (
    "index", "pci.bus_id", "name", "driver_version", "ecc.mode.current",
    "ecc.errors.corrected.volatile.total", "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.corrected.aggregate.total", "ecc.errors.uncorrected.aggregate.total",
    "retired_pages.single_bit_ecc.count", "retired_pages.double_bit.count", "retired_pages.pending",
    "remapped_rows.correctable", "remapped_rows.uncorrectable", "remapped_rows.pending", "remapped_rows.failure",
    "clocks_event_reasons.active", "clocks_event_reasons.hw_slowdown", "clocks_event_reasons.hw_thermal_slowdown",
    "clocks_event_reasons.hw_power_brake_slowdown", "clocks_event_reasons.sw_thermal_slowdown",
    "clocks_event_reasons.sw_power_cap", "temperature.gpu", "temperature.memory", "power.draw", "power.limit",
    "power.default_limit", "pcie.link.gen.current", "pcie.link.gen.max", "pcie.link.width.current",
    "pcie.link.width.max", "compute_mode", "mig.mode.current", "mig.mode.pending", "fabric.state", "fabric.status",
)

# The NVIDIA driver's XID line, as the kernel logs it (the driver's own format, from the line's
# start: a process name later on the line cannot make another XID or another GPU):
#   [ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=..., GPU has fallen off the bus.
# (older drivers print the device without "PCI:", MIG instances add " GPU-I:NN"; XID 79 lines of
# newer drivers carry no pid). Newer drivers may also say a GPU fell off the bus with no XID line:
#   NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330) ... has fallen off the bus ...
_XID = re.compile(r"^(?:\[\s*([\d.]+)\]\s+)?NVRM: Xid \((?:PCI:)?([0-9a-fA-F]{4,8}:)?"
                  r"([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.\d)?(?: GPU-I:\d+)?\): (\d{1,4}),")
_OFF_THE_BUS = re.compile(r"^(?:\[\s*([\d.]+)\]\s+)?NVRM: The NVIDIA GPU ([0-9a-fA-F]{4,8}:)?([0-9a-fA-F]{2}):"
                          r"([0-9a-fA-F]{2})\.\d\b.* has fallen off the bus")
#: what a "fallen off the bus" line without an XID counts as
OFF_THE_BUS_XID = 79
_LINK = re.compile(r"^\s*Link (\d+): (.*)$")
_GPU_LINE = re.compile(r"^GPU (\d+): ")


@dataclass(frozen=True)
class GpuHealthReading(JsonMixin):
    index: int
    bus_id: str
    name: str
    ecc_mode: str | None                  # Enabled | Disabled; None: no ECC on this GPU
    ecc_corrected_volatile: int | None    # since the driver loaded
    ecc_uncorrected_volatile: int | None
    ecc_corrected_aggregate: int | None   # the GPU's lifetime
    ecc_uncorrected_aggregate: int | None
    retired_single_bit: int | None        # pre-Ampere: dynamic page retirement (None: remapping instead)
    retired_double_bit: int | None
    retired_pending: bool | None
    remapped_correctable: int | None      # Ampere and later: row remapping
    remapped_uncorrectable: int | None
    remap_pending: bool | None
    remap_failure: bool | None
    clock_events: int | None              # the active clock event reasons, a bit mask
    hw_slowdown: bool | None
    hw_thermal_slowdown: bool | None
    hw_power_brake: bool | None
    sw_thermal_slowdown: bool | None
    sw_power_cap: bool | None
    temperature: int | None
    memory_temperature: int | None
    power_draw: float | None
    power_limit: float | None
    power_default_limit: float | None
    pcie_gen: int | None
    pcie_gen_max: int | None
    pcie_width: int | None
    pcie_width_max: int | None
    compute_mode: str | None
    mig_mode: str | None
    mig_pending: str | None
    fabric_state: str | None              # NVSwitch systems: Completed once Fabric Manager trained it
    fabric_status: str | None
    nvlinks: tuple[tuple[int, bool], ...] = ()   # (link, up) from nvidia-smi nvlink -s
    xids: tuple[int, ...] = ()                   # XIDs logged for this GPU since boot or its last reset
    # read through NVML where python3 and nvidia-ml-py are on the host (None: not read)
    pcie_replays: int | None = None              # PCIe replay counter since the driver loaded
    thermal_violation_ms: int | None = None      # time the clocks were held down for temperature
    power_violation_ms: int | None = None        # ... for the power limit
    temperature_slowdown: int | None = None      # the GPU's own slowdown threshold, C
    recovery_action: int | None = None           # nvmlGpuRecoveryAction_t: 0 none, 1 GPU reset, 2 node reboot, ...


@dataclass(frozen=True)
class GpuHealthData(JsonMixin):
    status: str                                  # ok | no-nvidia-smi | error
    gpus: tuple[GpuHealthReading, ...] = ()
    error: str | None = None                     # what nvidia-smi said when status is error
    kernel_log: bool = True                      # the kernel log could be read (XIDs)
    unmatched_xids: tuple[tuple[str, int], ...] = ()   # (PCI bus:device, XID) of no listed GPU
    nvml: bool = False                           # NVML answered (python3 and nvidia-ml-py on the host)
    #: the health watch's last journal event (deploys/health_watch.py): (unix time, class, action)
    last_event: tuple[float, str, str] | None = None


def _flag(value: str, what: str, yes: str = "Yes", no: str = "No") -> bool | None:
    v = opt_str(value)
    if v is None:
        return None
    if v in (yes, "Active"):
        return True
    if v in (no, "Not Active"):
        return False
    raise fail(f"expected {yes}/{no} or Active/Not Active for {what}", value)


def _float(value: str, what: str) -> float | None:
    v = opt_str(value)
    if v is None:
        return None
    try:
        return float(v.split()[0])
    except ValueError:
        raise fail(f"expected a number for {what}", value) from None


def _mask(value: str) -> int | None:
    v = opt_str(value)
    if v is None:
        return None
    if not re.fullmatch(r"0x[0-9a-fA-F]+", v):
        raise fail("expected a hexadecimal mask for clocks_event_reasons.active", value)
    return int(v, 16)


def bus_key(bus_id: str) -> str:
    """'00000000:3B:00.0' or '0000:3b:00' -> '3b:00': how the kernel's XID line and nvidia-smi
    name the same GPU."""
    parts = bus_id.lower().split(":")
    return ":".join(p.split(".")[0] for p in parts[-2:])


def parse_reading(line: str) -> GpuHealthReading:
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != len(HEALTH_FIELDS):
        raise fail(f"expected {len(HEALTH_FIELDS)} comma-separated health fields from nvidia-smi", line)
    v = dict(zip(HEALTH_FIELDS, cells))
    n = lambda key: opt_int(v[key], key)  # noqa: E731
    index = n("index")
    if index is None or not re.fullmatch(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d", v["pci.bus_id"]):
        raise fail("expected a GPU index and PCI bus id", line)
    return GpuHealthReading(
        index=index, bus_id=v["pci.bus_id"], name=v["name"], ecc_mode=opt_str(v["ecc.mode.current"]),
        ecc_corrected_volatile=n("ecc.errors.corrected.volatile.total"),
        ecc_uncorrected_volatile=n("ecc.errors.uncorrected.volatile.total"),
        ecc_corrected_aggregate=n("ecc.errors.corrected.aggregate.total"),
        ecc_uncorrected_aggregate=n("ecc.errors.uncorrected.aggregate.total"),
        retired_single_bit=n("retired_pages.single_bit_ecc.count"), retired_double_bit=n("retired_pages.double_bit.count"),
        retired_pending=_flag(v["retired_pages.pending"], "retired_pages.pending"),
        remapped_correctable=n("remapped_rows.correctable"), remapped_uncorrectable=n("remapped_rows.uncorrectable"),
        remap_pending=_flag(v["remapped_rows.pending"], "remapped_rows.pending"),
        remap_failure=_flag(v["remapped_rows.failure"], "remapped_rows.failure"),
        clock_events=_mask(v["clocks_event_reasons.active"]),
        hw_slowdown=_flag(v["clocks_event_reasons.hw_slowdown"], "hw_slowdown"),
        hw_thermal_slowdown=_flag(v["clocks_event_reasons.hw_thermal_slowdown"], "hw_thermal_slowdown"),
        hw_power_brake=_flag(v["clocks_event_reasons.hw_power_brake_slowdown"], "hw_power_brake_slowdown"),
        sw_thermal_slowdown=_flag(v["clocks_event_reasons.sw_thermal_slowdown"], "sw_thermal_slowdown"),
        sw_power_cap=_flag(v["clocks_event_reasons.sw_power_cap"], "sw_power_cap"),
        temperature=n("temperature.gpu"), memory_temperature=n("temperature.memory"),
        power_draw=_float(v["power.draw"], "power.draw"), power_limit=_float(v["power.limit"], "power.limit"),
        power_default_limit=_float(v["power.default_limit"], "power.default_limit"),
        pcie_gen=n("pcie.link.gen.current"), pcie_gen_max=n("pcie.link.gen.max"),
        pcie_width=n("pcie.link.width.current"), pcie_width_max=n("pcie.link.width.max"),
        compute_mode=opt_str(v["compute_mode"]), mig_mode=opt_str(v["mig.mode.current"]),
        mig_pending=opt_str(v["mig.mode.pending"]), fabric_state=opt_str(v["fabric.state"]),
        fabric_status=opt_str(v["fabric.status"]),
    )


def parse_nvlinks(lines: list[str]) -> dict[int, tuple[tuple[int, bool], ...]]:
    """GPU index -> ((link, up), ...) from `nvidia-smi nvlink -s` (no output: no NVLink)."""
    out: dict[int, list[tuple[int, bool]]] = {}
    gpu: int | None = None
    for line in lines:
        if not line.strip():
            continue
        head = _GPU_LINE.match(line)
        if head:
            gpu = int(head.group(1))
            out.setdefault(gpu, [])
            continue
        link = _LINK.match(line)
        if not link or gpu is None:
            raise fail("expected 'GPU N: ...' or 'Link N: ...' from nvidia-smi nvlink -s", line)
        out[gpu].append((int(link.group(1)), "inactive" not in link.group(2).lower()))
    return {g: tuple(links) for g, links in out.items()}


def parse_xid_events(lines: list[str]) -> list[tuple[str, int, float | None]]:
    """(PCI bus:device, XID, the kernel's timestamp: seconds since boot, None when the line has
    none) of each XID line of the kernel log, oldest first."""
    found: list[tuple[str, int, float | None]] = []
    for line in lines:
        m = _XID.match(line.strip())
        if m:
            found.append((f"{m.group(3)}:{m.group(4)}".lower(), int(m.group(5)), _stamp(m.group(1))))
            continue
        off = _OFF_THE_BUS.match(line.strip())
        if off:
            found.append((f"{off.group(3)}:{off.group(4)}".lower(), OFF_THE_BUS_XID, _stamp(off.group(1))))
    return found


def _stamp(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def parse_xids(lines: list[str]) -> list[tuple[str, int]]:
    """(PCI bus:device, XID) of each XID line of the kernel log, oldest first."""
    return [(bus, code) for bus, code, _ in parse_xid_events(lines)]


def since_reset(events: list[tuple[str, int, float | None]], resets: dict[str, float]) -> list[tuple[str, int]]:
    """The XIDs logged after the last reset of their GPU (issue 45: a GPU that was reset is judged
    on what it logged since, not since boot). `resets`: bus:device -> the kernel clock (seconds
    since boot, as the XID lines stamp) of that GPU's last reset in this boot. A line without a
    timestamp counts: it cannot be shown to be older."""
    return [(bus, code) for bus, code, t in events
            if bus not in resets or t is None or t > resets[bus]]


#: the on-node health watch's folder (gpufleet/plans/health_watch.py: root's, 0700): its
#: record of GPU resets this boot, read here so that every reader judges XIDs since the last reset
WATCH_DIR = "/var/lib/gpufleet-health"
#: the health watch's append-only journal (gpufleet/plans/health_watch.py writes it through the node's checker)
WATCH_JOURNAL = WATCH_DIR + "/journal.jsonl"
_RESET = re.compile(r"^reset ([0-9a-f]{2}:[0-9a-f]{2}) ([0-9a-f-]{36}) (\d+(?:\.\d+)?)$")
_EVENT = re.compile(r"^event (\d+(?:\.\d+)?) (ok|monitor|reset|reboot|drain|rma) ([a-z-]+)$")


def parse_resets(lines: list[str], boot: str) -> dict[str, float]:
    """bus:device -> kernel clock of its last reset, from the watch's `resets` lines of this boot
    (lines of another boot: that boot's resets say nothing of this one's XIDs)."""
    out: dict[str, float] = {}
    for line in lines:
        m = _RESET.match(line.strip())
        if m and m.group(2) == boot:
            out[m.group(1)] = max(out.get(m.group(1), 0.0), float(m.group(3)))
    return out


# What NVML adds to nvidia-smi's query (nvidia-ml-py's pynvml, the functions named by the keys of
# the recording tests/fixtures/nvidia/h200-x1/health/nvml-health.txt): one JSON line per GPU, an
# unanswered call "ERR ..." as there. Without `pynvml` it prints nothing and exits 0.
NVML_SCRIPT = r"""
import json
try:
    import pynvml as n
except ImportError:
    raise SystemExit(0)  # no nvidia-ml-py on the host: nothing to read, not an error
def get(f, *a):
    try:
        return f(*a)
    except Exception as e:
        return "ERR " + type(e).__name__ + ": " + str(e)
n.nvmlInit()
for i in range(n.nvmlDeviceGetCount()):
    h = n.nvmlDeviceGetHandleByIndex(i)
    v = lambda p: get(lambda: {"violationTime": n.nvmlDeviceGetViolationStatus(h, p).violationTime})
    ra = get(lambda: n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0])
    print(json.dumps({"index": i, "pcie_replay": get(n.nvmlDeviceGetPcieReplayCounter, h),
                      "violation_power": v(n.NVML_PERF_POLICY_POWER), "violation_thermal": v(n.NVML_PERF_POLICY_THERMAL),
                      "temp_slowdown": get(n.nvmlDeviceGetTemperatureThreshold, h, n.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                      "recovery_action": ra if isinstance(ra, str) else (ra.value.uiVal if ra.nvmlReturn == 0 else
                                                                          "ERR nvmlReturn " + str(ra.nvmlReturn))}))
"""


def _nvml_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _violation_ms(raw: object) -> int | None:
    """nvmlViolationTime_t's violationTime (nanoseconds) in milliseconds."""
    ns = _nvml_int(raw.get("violationTime")) if isinstance(raw, dict) else None
    return None if ns is None else ns // 1_000_000


def parse_nvml(lines: list[str]) -> dict[int, dict[str, int | None]]:
    """GPU index -> the NVML readings, from NVML_SCRIPT's lines (or the recorded script's JSON)."""
    import json

    text = "\n".join(lines).strip()
    docs: list[object] = []
    if text.startswith("{") and '"gpus"' in text:   # the recorded script: one document, "gpus": [...]
        docs = list(json.loads(text).get("gpus", []))
    else:
        for line in lines:
            if line.strip().startswith("{"):
                docs.append(json.loads(line))
    out: dict[int, dict[str, int | None]] = {}
    for doc in docs:
        if not isinstance(doc, dict) or _nvml_int(doc.get("index")) is None:
            raise fail("expected an NVML reading with an index", str(doc)[:200])
        ms = {key: _violation_ms(doc.get(key)) for key in ("violation_thermal", "violation_power")}
        out[int(doc["index"])] = {"pcie_replays": _nvml_int(doc.get("pcie_replay")),
                                  "thermal_violation_ms": ms["violation_thermal"],
                                  "power_violation_ms": ms["violation_power"],
                                  "temperature_slowdown": _nvml_int(doc.get("temp_slowdown")),
                                  "recovery_action": _nvml_int(doc.get("recovery_action"))}
    return out


_SCRIPT_TEMPLATE = """
if ! command -v nvidia-smi >/dev/null 2>&1; then echo '::gpufleet:: status no-nvidia-smi'; exit 0; fi
{begin_query}
q=$(nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits 2>&1); rc=$?
printf '%s\n' "$q"; echo "::gpufleet:: rc query $rc"
{begin_nvlink}
# NVLink joins two or more GPUs: a host with one is not asked again (a call costs 20-100 ms)
if [ "$(printf '%s\n' "$q" | grep -c .)" -gt 1 ]; then nvidia-smi nvlink -s 2>&1; fi
echo "::gpufleet:: rc nvlink $?"
{begin_xid}
# the kernel's ring buffer (root: kernel.dmesg_restrict), else this boot's kernel messages in the journal
if log=$(dmesg 2>/dev/null) || log=$(journalctl -k -b --no-pager -q -o cat 2>/dev/null); then
  printf '%s\n' "$log" | grep -E 'NVRM: (Xid|The NVIDIA GPU .* has fallen off the bus)' | tail -n 200
  echo '::gpufleet:: kernel-log yes'
else echo '::gpufleet:: kernel-log no'; fi
{begin_watch}
# the health watch's resets of this boot (XIDs before a GPU's reset are not held against it) and
# its last event; root's files: nothing without root
echo "::gpufleet:: boot $(cat /proc/sys/kernel/random/boot_id 2>/dev/null || echo none)"
cat {watch}/resets 2>/dev/null | tail -n 64
tail -n 1 {watch}/last-event 2>/dev/null
{begin_nvml}
# -I: isolated, no user site-packages or PYTHON* variables: the system's nvidia-ml-py or none
# (the script itself prints nothing without it: one python3 start, not an import check first)
if command -v python3 >/dev/null 2>&1; then
python3 -I - <<'GPUFLEET_NVML'
{nvml}
GPUFLEET_NVML
echo "::gpufleet:: rc nvml $?"; fi
"""


HEALTH_SCRIPT = _SCRIPT_TEMPLATE.format(begin_query=begin("query"), begin_nvlink=begin("nvlink"),
                                        begin_xid=begin("xid"), begin_nvml=begin("nvml"),
                                        begin_watch=begin("watch"), watch=WATCH_DIR,
                                        fields=",".join(HEALTH_FIELDS), nvml=NVML_SCRIPT.strip()).strip()


class GpuHealth(FactBase[GpuHealthData]):
    """
    Every GPU's health readings and the XIDs logged since boot (or the GPU's last reset), in one command:

    .. code:: python

        host.get_fact(GpuHealth)
        GpuHealthData(status="ok", gpus=(GpuHealthReading(index=0, bus_id="00000000:00:06.0", ...
                      remap_pending=False, remap_failure=False, hw_slowdown=False, ...),))
    """

    # asked at the end of a run only on hosts the run changed: a later deploy run's prefetch leaves
    # it out (tools/health, the fleet report and deploys/validate.py ask it themselves)
    gpufleet_end_of_run = True

    @override
    @staticmethod
    def default() -> GpuHealthData:
        return GpuHealthData(status="no-nvidia-smi")

    @override
    def command(self) -> str:
        return HEALTH_SCRIPT

    @override
    def process(self, output: list[str]) -> GpuHealthData:
        sections, values = split_sections(output)
        if values.get("status") == "no-nvidia-smi":
            return GpuHealthData(status="no-nvidia-smi")
        query = [line for line in sections.get("query", []) if line.strip()]
        if values.get("rc query") != "0":
            return GpuHealthData(status="error", error=" ".join(query)[:300] or "nvidia-smi failed")
        readings = [parse_reading(line) for line in query]
        links = parse_nvlinks(sections.get("nvlink", [])) if values.get("rc nvlink") == "0" else {}
        watch = sections.get("watch", [])
        xids = since_reset(parse_xid_events(sections.get("xid", [])), parse_resets(watch, values.get("boot", "")))
        last = [m for m in (_EVENT.match(line.strip()) for line in watch) if m]
        nvml = parse_nvml(sections.get("nvml", [])) if values.get("rc nvml") == "0" else {}
        by_bus = {bus_key(r.bus_id): r.index for r in readings}
        gpus = tuple(GpuHealthReading(**{**r.__dict__, "nvlinks": links.get(r.index, ()),
                                         "xids": tuple(x for bus, x in xids if by_bus.get(bus) == r.index),
                                         **nvml.get(r.index, {})})
                     for r in readings)
        return GpuHealthData(status="ok", gpus=gpus, kernel_log=values.get("kernel-log") == "yes",
                             unmatched_xids=tuple((bus, x) for bus, x in xids if bus not in by_bus), nvml=bool(nvml),
                             last_event=(float(last[-1].group(1)), last[-1].group(2), last[-1].group(3))
                             if last else None)


class HealthJournal(FactBase[list[str]]):
    """The health watch's journal (deploys/health_watch.py), its last 2000 lines: root's file, read
    with the host's sudo; none (or no watch): no line."""

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def command(self) -> str:
        return "tail -n 2000 " + WATCH_JOURNAL + " 2>/dev/null || true"

    @override
    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line.startswith("{")]
