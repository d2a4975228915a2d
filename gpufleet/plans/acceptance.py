"""The acceptance plan: is this host fit to take jobs? Pure: facts and measurements in, findings out.

A node earns its way into service (issue 46): after its first converge, after every rollout
batch before it is resumed, and on its own (`tools/health --burn-in`). What it is judged on:

- the performance probe (bf16 matmul, device-memory copy, intra-node all-reduce) against the
  GPU model's minimums, measured where a live GPU of the model was probed, derived (a measured
  fraction of its datasheet peak) elsewhere, and said which (gpufleet/data/acceptance.yaml);
- a multi-node all-reduce with a known-good peer, its bus bandwidth against the minimum of the
  tier's nccl_profile (gloo on CPU where the GPUs are simulated: run and summed, never judged);
- the InfiniBand/RoCE ports, read before and after: down, or an error counter that grew, FAILs
  naming the port.

A minimum that does not apply (no figure for the GPU model, a CPU run) is never a PASS: an unknown
model is a WARN naming it, a CPU run a SKIP saying what was not judged.
"""
from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping, Sequence

from gpufleet.config.settings import Settings
from gpufleet.plans import perf
from gpufleet import yamlload

PASS, FAIL, WARN, SKIP = "pass", "fail", "warn", "skip"
AREA = "acceptance"


@dataclass(frozen=True)
class Floor:
    """One minimum and where it comes from (`basis` starts with "measured" or "derived")."""

    value: float
    unit: str
    basis: str

    @property
    def measured(self) -> bool:
        return self.basis.startswith("measured")

    def describe(self) -> str:
        return f"minimum {self.value:g} {self.unit}, {self.basis}"


@dataclass(frozen=True)
class Finding:
    name: str
    status: str
    message: str = ""
    fix: str = ""
    area: str = AREA

    def line(self) -> str:
        text = f"[{self.status.upper()}] {self.area}: {self.name}"
        text += f": {self.message}" if self.message else ""
        return text + (f" -> fix: {self.fix}" if self.fix and self.status in (FAIL, WARN) else "")

    def to_json(self) -> dict[str, str]:
        return {"area": self.area, "name": self.name, "status": self.status, "message": self.message, "fix": self.fix}


@lru_cache(maxsize=1)
def data() -> Mapping[str, Any]:
    text = importlib.resources.files("gpufleet").joinpath("data/acceptance.yaml").read_text(encoding="utf-8")
    loaded: Mapping[str, Any] = yamlload.safe_load(text)
    return loaded


# --- minimums as data ---------------------------------------------------------------------------

def model_floors(model: str) -> dict[str, Floor]:
    """{"matmul": Floor, "memory": Floor} of one GPU of `model` ({}: no known minimum)."""
    table, share = data()["measured"], float(data()["min_of_typical"])
    if model in table:
        row = table[model]
        basis = f"measured: {share:.0%} of {{typical}} typical ({row['where']})"
        return {"matmul": Floor(round(row["matmul_tflops"] * share, 1), "TFLOP/s",
                                basis.format(typical=f"{row['matmul_tflops']:g} TFLOP/s")),
                "memory": Floor(round(row["memory_gbs"] * share, 1), "GB/s",
                                basis.format(typical=f"{row['memory_gbs']:g} GB/s"))}
    derived = perf.minimums(model)
    out = {}
    if derived.matmul_tflops:
        out["matmul"] = Floor(derived.matmul_tflops, "TFLOP/s",
                              f"derived: {perf.MATMUL_MIN_FRACTION:.1%} of the datasheet bf16 peak")
    if derived.memory_gbs:
        out["memory"] = Floor(derived.memory_gbs, "GB/s",
                              f"derived: {perf.MEMORY_MIN_FRACTION:.1%} of the datasheet memory bandwidth")
    return out


def intra_node_floor(model: str, gpus: int, nvlink: bool) -> Floor | None:
    """The all-reduce bus bandwidth minimum among the GPUs of one host (None: one GPU, or an
    NVLink model without a known NVLink bandwidth)."""
    if gpus < 2:
        return None
    intra = data()["intra_node"]
    if not nvlink:
        return Floor(float(intra["pcie_busbw_gbs"]), "GB/s", "derived: a PCIe ring (gpufleet/data/acceptance.yaml)")
    peak = perf.PEAKS.get(model)
    if peak is None or not peak.nvlink_gbs:
        return None
    share = float(intra["nvlink_fraction"])
    return Floor(round(peak.nvlink_gbs * share, 1), "GB/s",
                 f"derived: {share:.0%} of {peak.nvlink_gbs:g} GB/s NVLink per direction")


def inter_node_floor(profile: str) -> Floor | None:
    row = data()["inter_node"].get(profile)
    return None if row is None else Floor(float(row["busbw_gbs"]), "GB/s", str(row["basis"]))


# --- the probe ------------------------------------------------------------------------------------

FIX_SLOW = ("a slow GPU: read `tools/health HOST` (clocks, throttling, PCIe width, ECC), re-run the acceptance "
            "once the host is idle; if it stays below, swap the GPU (RMA)")


def judge_probe(result: perf.ProbeResult, models: Mapping[int, str], nvlink: bool) -> list[Finding]:
    """The probe's measurements against the per-model minimums: one finding per measurement.

    `models` maps CUDA index -> nvidia-smi name. A CPU measurement is a SKIP (no minimum of a GPU
    applies to it); a GPU with no known minimum is a WARN naming the model."""
    if result.status != "ok":
        return [Finding("performance probe", WARN if result.status == "skipped" else FAIL,
                        f"{result.status}: {result.reason}",
                        "install the tier's PyTorch runtime (deploys/pytorch.py) and re-run")]
    out = []
    for m in result.measurements:
        name = f"{m.metric} {m.device}"
        value = f"{m.value:.1f} {m.unit}"
        if m.device == "cpu":
            out.append(Finding(name, SKIP, f"{value} on the CPU: not judged (no GPU minimum applies to a CPU run)"))
            continue
        index = _index(m.device)
        model = models.get(index) if index is not None else None
        floor = _floor_for(m, model, models, nvlink)
        if floor is None:
            which = model or ", ".join(sorted(set(models.values()))) or "unknown GPU"
            out.append(Finding(name, WARN, f"{value}: no known minimum for {which}: measured, not judged",
                               "add the model's figures to gpufleet/data/acceptance.yaml (measure a healthy one)"))
        elif m.value >= floor.value:
            out.append(Finding(name, PASS, f"{value} ({floor.describe()})"))
        else:
            out.append(Finding(name, FAIL, f"{value} < {floor.describe()}", FIX_SLOW))
    out += [Finding(f"probe {s.split(':', 1)[0]}", SKIP, s.split(":", 1)[-1].strip()) for s in result.skipped]
    return out


def _index(device: str) -> int | None:
    head = device.removeprefix("cuda:").split("-", 1)[0]
    return int(head) if device.startswith("cuda:") and head.isdigit() else None


def _floor_for(m: perf.Measurement, model: str | None, models: Mapping[int, str], nvlink: bool) -> Floor | None:
    if m.metric in ("matmul", "memory"):
        return model_floors(model).get(m.metric) if model else None
    names = set(models.values())
    if len(names) != 1:
        return None
    return intra_node_floor(names.pop(), len(models), nvlink)


# --- the fabric -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AllReduce:
    """What the multi-node all-reduce with a known-good peer did (apps/acceptance.py runs it)."""

    peer: str
    ok: bool
    backend: str = ""           # nccl | gloo
    ranks: int = 0
    busbw_gbs: float | None = None
    simulated: bool = False     # the GPUs are simulated: gloo on CPU
    detail: str = ""            # the sum it checked, or why it did not run
    transport: str = ""         # NCCL's NCCL_DEBUG=INFO: "NET/IB", "NET/Socket", "P2P/IPC"...
    no_runtime: bool = False    # the tier's PyTorch runtime is missing on the host: not run
    gdr: bool = False           # a network channel ran GPUDirect RDMA (".../GDRDMA" in NCCL's line)


FIX_PEERS = ("the hosts cannot reach each other for training: check the firewall lets the peers in "
             "(firewall_cluster_cidrs, `nft list table inet gpufleet`), routes and the data interface; re-run")


ALLREDUCE = "multi-node all-reduce with a known-good peer"


def judge_allreduce(run: AllReduce | None, profile: str) -> list[Finding]:
    name = ALLREDUCE
    if run is None:
        return [Finding(name, WARN, "no known-good peer to run it with: the fabric between hosts is not proven",
                        "name a peer (--peer HOST), or accept a host that already serves")]
    if run.no_runtime:
        # the gate's PyTorch check names the missing runtime; the fabric is unproven, not failed
        return [Finding(name, WARN, f"not run: {run.detail}", "install the tier's PyTorch runtime "
                                                              "(pytorch_runtime; deploys/pytorch.py) and re-run")]
    if not run.ok:
        return [Finding(name, FAIL, f"with {run.peer}: {run.detail}", FIX_PEERS)]
    ran = f"with {run.peer}, {run.ranks} ranks, {run.backend}: {run.detail}"
    out = [Finding(name, PASS, ran + (" (GPUs simulated: gloo on CPU)" if run.simulated else ""))]
    bw = f"{run.busbw_gbs:.2f} GB/s" if run.busbw_gbs is not None else "not measured"
    floor = inter_node_floor(profile)
    bw_name = f"multi-node all-reduce bus bandwidth (nccl_profile {profile})"
    if run.simulated or run.backend != "nccl":
        out.append(Finding(bw_name, SKIP, f"{bw} over {run.backend} on CPU: not judged "
                                          f"({floor.describe() if floor else 'no minimum'} applies to NCCL on GPUs)"))
    elif floor is None:
        out.append(Finding(bw_name, WARN, f"{bw}: no known minimum for nccl_profile {profile}",
                           "add it to gpufleet/data/acceptance.yaml inter_node"))
    elif run.busbw_gbs is not None and run.busbw_gbs >= floor.value:
        out.append(Finding(bw_name, PASS, f"{bw} ({floor.describe()}){_transport(run)}"))
    else:
        out.append(Finding(bw_name, FAIL, f"{bw} < {floor.describe()}{_transport(run)}",
                           "a slow or down rail, NCCL on sockets instead of RDMA (NCCL_DEBUG=INFO names the "
                           "transport), GPUDirect RDMA off (nvidia-peermem): tools/health HOST, then re-run"))
    rdma = profile in ("ib", "roce") and not run.simulated and run.backend == "nccl"
    if rdma and run.transport and "IB" not in run.transport:
        out.append(Finding("NCCL used RDMA", FAIL, f"NCCL ran over {run.transport}, not IB/RoCE (nccl_profile {profile})",
                           "check NCCL_IB_HCA names HCAs the host has, their ports ACTIVE (ibstat), the "
                           "rdma-core libraries installed, NCCL_IB_DISABLE unset; re-run"))
    elif rdma and run.transport.startswith("NET/IB") and not run.gdr:
        # NCCL falls back to staging through host memory without a word: its channel lines are
        # the only evidence (net.cc: "via NET/%s/%d%s..." with "/GDRDMA" when GPUDirect RDMA runs)
        out.append(Finding("GPUDirect RDMA", FAIL, f"NCCL ran over {run.transport} without GPUDirect RDMA on any "
                                                   f"channel (nccl_profile {profile} expects it)",
                           "load nvidia-peermem (gpufleet's tuning loads it on ib/roce: `lsmod | grep peermem`, "
                           "re-run all.py), and check the GPU and HCA share a PCIe switch "
                           "(`nvidia-smi topo -m`: PIX/PXB, not SYS); re-run"))
    return out


def _transport(run: AllReduce) -> str:
    return f", NCCL over {run.transport}" if run.transport else ""


@dataclass(frozen=True)
class IbPort:
    """One InfiniBand/RoCE port as /sys/class/infiniband says (facts/network.py IbCounters)."""

    device: str
    port: int
    state: str = ""
    phys_state: str = ""
    counters: tuple[tuple[str, int], ...] = ()

    @property
    def name(self) -> str:
        return f"{self.device} port {self.port}"

    def counter(self, key: str) -> int | None:
        return dict(self.counters).get(key)


FIX_PORT = ("a flapping or erroring link: reseat or replace the cable/transceiver, check the switch port "
            "(ibdiagnet, `perfquery -x`), clear the counters (`perfquery -R`) and re-run the acceptance")


def judge_ports(before: Sequence[IbPort], after: Sequence[IbPort]) -> list[Finding]:
    """Every port up after the acceptance, and no error counter grown during it. Counters that
    were already non-zero are history (said, not failed); growth while the acceptance ran is not."""
    name = "InfiniBand/RoCE ports up, no errors during the acceptance"
    if not after:
        return [Finding(name, SKIP, "no RDMA device on this host (/sys/class/infiniband is empty)")]
    then = {(p.device, p.port): p for p in before}
    watched = list(data()["ib_counters"])
    bad, history, idle = [], [], []

    def up(port: IbPort) -> bool:
        return bool(port.state == data()["ib_state"] and port.phys_state == data()["ib_phys_state"])

    for port in after:
        old = then.get((port.device, port.port))
        if not up(port):
            if old is not None and not up(old):
                # down before the acceptance began too: a port not cabled, or one NCCL is not
                # given (the gate checks the HCAs the NCCL profile names are ACTIVE)
                idle.append(f"{port.name}: {port.state or '?'}/{port.phys_state or '?'}")
            else:
                bad.append(f"{port.name}: {port.state or '?'}/{port.phys_state or '?'}")
            continue
        for key in watched:
            now, was = port.counter(key), old.counter(key) if old else None
            if now is None:
                continue
            if was is None or now > was:
                bad.append(f"{port.name}: {key} {was if was is not None else '?'} -> {now}")
            elif now:
                history.append(f"{port.name}: {key} {now}")
    ports = ", ".join(p.name for p in after if up(p))
    if bad:
        return [Finding(name, FAIL, "; ".join(bad), FIX_PORT)]
    said = f" (counted before, unchanged: {'; '.join(history)})" if history else ""
    unused = f"; down before and after, not judged: {'; '.join(idle)}" if idle else ""
    if not ports:
        return [Finding(name, WARN, f"no port ACTIVE/LinkUp{unused}", "cable a port, or check the HCAs NCCL is given "
                                                                     "(NCCL_IB_HCA; ibstat)")]
    return [Finding(name, PASS, f"{ports}: ACTIVE/LinkUp, no error counted{said}{unused}")]


# --- the verdict ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    host: str
    findings: tuple[Finding, ...]

    @property
    def failed(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    @property
    def passed(self) -> bool:
        return not self.failed

    def summary(self) -> str:
        """One line for a progress line or a state message: the first failure, with its fix."""
        if self.passed:
            warns = [f for f in self.findings if f.status == WARN]
            ran = [f.message for f in self.findings if f.status == PASS and f.name == ALLREDUCE]
            return ("accepted" + (f": all-reduce {ran[0]}" if ran else "")
                    + (f" ({len(warns)} warning(s): {warns[0].name}: {warns[0].message})" if warns else ""))
        first = self.failed[0]
        return f"{first.name}: {first.message}. Fix: {first.fix}"

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "status": "pass" if self.passed else "fail",
                "findings": [f.to_json() for f in self.findings]}


def verdict(host: str, *parts: Sequence[Finding]) -> Verdict:
    return Verdict(host, tuple(f for part in parts for f in part))


def parse_allreduce(lines: Sequence[str], peer: str) -> AllReduce:
    """One rank's lines of gpufleet/allreduce_probe.py (AllReduceRank) -> what the all-reduce did."""
    import json
    import re

    record: dict[str, Any] = {}
    transport = ""
    gdr = False
    for line in lines:
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            continue
        # NCCL INFO "Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA" (or NET/IB/0(3)/GDRDMA
        # when the send is proxied through another rank, PXN)
        seen = re.search(r" via (NET/[A-Za-z]+|P2P/[A-Za-z]+|SHM)(\S*)", line)
        if seen:
            transport = transport or seen.group(1)
            gdr = gdr or (seen.group(1).startswith("NET/") and "/GDRDMA" in seen.group(2))
    if str(record.get("reason", "")).startswith("PyTorch not importable") or not record:
        return AllReduce(peer, False, detail=str(record.get("reason") or "no answer from the all-reduce"),
                         no_runtime=True)
    if record.get("status") != "ok":
        stage = f" at the {record['stage']}" if record.get("stage") else ""
        return AllReduce(peer, False, str(record.get("backend", "")),
                         detail=f"failed{stage}: {record.get('reason') or 'no answer from the all-reduce'}")
    backend, ranks = str(record["backend"]), int(record["ranks"])
    total, want = record.get("sum") or [], float(record.get("expected", -1))
    if not total or any(abs(float(v) - want) > 1e-6 for v in total):
        return AllReduce(peer, False, backend, ranks, detail=f"wrong sum {total}, expected {want:g} on every element")
    busbw = perf.allreduce_busbw_gbs(int(record["bytes"]), ranks, int(record["iterations"]), float(record["seconds"]))
    return AllReduce(peer, True, backend, ranks, round(busbw, 3), simulated=not record.get("cuda"),
                     detail=f"sum {total[0]:g} as expected, {int(record['bytes']) >> 20} MiB x {record['iterations']}",
                     transport=transport, gdr=gdr)


def plan_line(settings: Settings) -> str:
    """What the acceptance runs on this host, in one line (the plan view, docs/acceptance.md)."""
    when = ("after each tools/rollout batch, before it is resumed" if settings.acceptance_rollout
            else "by tools/health --burn-in only (acceptance_rollout: false)")
    diag = f"DCGM diagnostic level {settings.acceptance_diag_level}, " if settings.acceptance_diag_level else ""
    floor = inter_node_floor(settings.nccl_profile)
    minimum = f"busbw {floor.describe()}" if floor else f"no busbw minimum for nccl_profile {settings.nccl_profile}"
    return (f"{when}: performance probe, GPU health, {diag}all-reduce with a known-good peer on port "
            f"{settings.acceptance_port}/tcp ({settings.acceptance_allreduce_mib} MiB, {settings.acceptance_timeout} s "
            f"at most; {minimum}), InfiniBand/RoCE ports before and after")


# --- the record of a passed acceptance (facts/acceptance.py reads it) -----------------------------

FIX_ACCEPT = "gpufleet-deploy INVENTORY --accept (pairs the hosts with an accepted peer; docs/acceptance.md)"


@dataclass(frozen=True)
class Standing:
    """Is the host accepted now? `why` says what stands in the way ("" when accepted)."""

    accepted: bool
    why: str = ""
    when: str = ""      # the record's time, when there is one


def build_record(verdict: Verdict, peer: str, driver: str | None, cuda: Mapping[str, str], when: float,
                 version: str) -> dict[str, Any]:
    """What a passed acceptance leaves on the host (facts/acceptance.py RECORD): when, by which
    gpufleet, for which driver and CUDA toolkits, with which peer, and the measurements."""
    import time

    from gpufleet.facts.acceptance import RECORD_FORMAT

    return {"format": RECORD_FORMAT, "accepted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
            "accepted_at_epoch": round(when, 3), "gpufleet": version, "driver": driver or "",
            "cuda": dict(sorted(cuda.items())), "peer": peer, "host": verdict.host,
            "findings": [f.to_json() for f in verdict.findings]}


def standing(found: Any) -> Standing:
    """The host's standing from its AcceptanceRecordData: no record, or a record for another
    driver or CUDA toolkit than the host has now, is "not accepted" (a new driver is a new host
    to its jobs: the rollout's acceptance writes the record again)."""
    if found.error:
        return Standing(False, f"the acceptance record is unreadable ({found.error})")
    record = found.record
    if record is None:
        return Standing(False, "none on record")
    when = str(record.get("accepted_at", ""))
    if record.get("format") != 1:
        return Standing(False, f"a record of an unknown format {record.get('format')!r}", when)
    was, now = str(record.get("driver") or ""), found.driver or ""
    if was != now:
        return Standing(False, f"accepted {when} with driver {was or 'none'}, driver {now or 'none'} loaded now", when)
    cuda = record.get("cuda") if isinstance(record.get("cuda"), dict) else {}
    if dict(cuda) != dict(found.cuda):
        def text(toolkits: Mapping[str, Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(toolkits.items())) or "no CUDA toolkit"
        return Standing(False, f"accepted {when} with {text(cuda)}, {text(found.cuda)} now", when)
    return Standing(True, "", when)
