"""Performance probe arithmetic: what the probe measured, in TFLOP/s and GB/s, against minimums.

Pure functions, no I/O. The probe script (gpufleet/probe/perf_probe.py) runs on the host and
reports only raw facts (matrix sizes, bytes, iterations, seconds); every number the validation
gate compares is computed here, so the arithmetic is unit-tested once:

- matrix multiply C = A @ B with A m x k and B k x n: 2*m*n*k floating-point operations
  (one multiply and one add per inner-product term);
- device-memory bandwidth from a device-to-device copy of N bytes: 2*N bytes moved (read N,
  write N), as CUDA's bandwidthTest and nvbandwidth count it;
- all-reduce over n ranks of S bytes each taking t seconds: algorithm bandwidth algbw = S / t,
  bus bandwidth busbw = algbw * 2(n-1)/n (nccl-tests' PERFORMANCE.md: a ring all-reduce sends
  and receives 2(n-1)/n of the data on every link, so busbw is comparable to link speed
  whatever n is).

Expected minimums per GPU model are 90 % of what a healthy GPU of that model typically reaches
(measured where we have a measurement, else the measured fraction of its datasheet peak: dense
BF16 tensor TFLOP/s, memory bandwidth, NVLink bandwidth per direction). Models without a known
peak are measured and reported, never judged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Mapping

GB = 1e9
TERA = 1e12

# A minimum catches a slow GPU, not only a dead one: 90 % of what a healthy GPU of the model
# typically reaches in the probe. Typical, measured by this probe on a live 1 x H200 (driver
# 580.159.04, 2026-12-02, two runs): bf16 8192^3 matmul 778.7 and 794.3 TFLOP/s (79.5 % of the
# 989 TFLOP/s dense peak), device-to-device copy 4233 and 4212 GB/s (88.0 % of 4800 GB/s).
# Models without a measurement of their own are expected at the same fractions of their
# datasheet peak (derived, not measured: TYPICAL names the measured ones).
MIN_OF_TYPICAL = 0.9
MATMUL_TYPICAL_FRACTION = round((778.7 + 794.3) / 2 / 989.0, 3)    # 0.795
MEMORY_TYPICAL_FRACTION = round((4233.0 + 4212.0) / 2 / 4800.0, 3)  # 0.880
MATMUL_MIN_FRACTION = round(MIN_OF_TYPICAL * MATMUL_TYPICAL_FRACTION, 3)
MEMORY_MIN_FRACTION = round(MIN_OF_TYPICAL * MEMORY_TYPICAL_FRACTION, 3)
# NCCL all-reduce bus bandwidth over NVLink: no measurement on a multi-GPU host of our own yet, so
# the minimum stays at half the per-direction NVLink bandwidth; the probe now sends GiB-scale
# messages (perf_probe.py --allreduce-mib 2048), where NCCL's bus bandwidth levels off
# (nccl-tests PERFORMANCE.md: small messages are latency-bound)
ALLREDUCE_MIN_FRACTION = 0.5

#: measured typical (bf16 TFLOP/s, memory GB/s) per model, each with where it was measured
TYPICAL: Mapping[str, tuple[float, float, str]] = {
    "NVIDIA H200": ((778.7 + 794.3) / 2, (4233.0 + 4212.0) / 2, "gpufleet's probe, live 1 x H200, 2026-12-02"),
}


@dataclass(frozen=True)
class Peak:
    """Datasheet peaks of one GPU model (None: not known / not supported)."""

    bf16_tflops: float | None  # dense (no sparsity) BF16 tensor-core TFLOP/s
    memory_gbs: float | None  # device memory bandwidth, GB/s (10^9 bytes/s)
    nvlink_gbs: float | None = None  # NVLink bandwidth per direction per GPU, GB/s


# nvidia-smi names (compat.yaml) -> datasheet peaks. BF16 needs Ampere or newer: Turing and
# Volta boards have no BF16 tensor cores, so no matmul minimum applies to them.
PEAKS: Mapping[str, Peak] = {
    "NVIDIA H100 80GB HBM3": Peak(989.0, 3350.0, 450.0),
    "NVIDIA H200": Peak(989.0, 4800.0, 450.0),
    "NVIDIA B200": Peak(2250.0, 8000.0, 900.0),
    "NVIDIA A100-SXM4-40GB": Peak(312.0, 1555.0, 300.0),
    "NVIDIA A100-SXM4-80GB": Peak(312.0, 2039.0, 300.0),
    "NVIDIA A100-PCIE-40GB": Peak(312.0, 1555.0),
    "NVIDIA A100 80GB PCIe": Peak(312.0, 1935.0),
    "NVIDIA H100 PCIe": Peak(756.0, 2000.0),
    "NVIDIA A10": Peak(125.0, 600.0),
    "NVIDIA A30": Peak(165.0, 933.0),
    "NVIDIA A40": Peak(149.7, 696.0),
    "NVIDIA L4": Peak(121.0, 300.0),
    "NVIDIA L40": Peak(181.0, 864.0),
    "NVIDIA L40S": Peak(362.0, 864.0),
    "Tesla T4": Peak(None, 320.0),
    "Tesla V100-SXM2-16GB": Peak(None, 900.0, 150.0),
}


# --- counts -----------------------------------------------------------------------------------

def matmul_flops(m: int, n: int, k: int) -> int:
    """Floating-point operations of one (m x k) @ (k x n) matrix multiply: 2*m*n*k."""
    for name, value in (("m", m), ("n", n), ("k", k)):
        if value <= 0:
            raise ValueError(f"matrix dimension {name} must be positive, got {value}")
    return 2 * m * n * k


def copy_bytes_moved(nbytes: int) -> int:
    """Bytes a device-to-device copy of `nbytes` moves through device memory: read + write."""
    if nbytes <= 0:
        raise ValueError(f"copy size must be positive, got {nbytes}")
    return 2 * nbytes


def busbw_factor(ranks: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n."""
    if ranks < 1:
        raise ValueError(f"an all-reduce needs at least one rank, got {ranks}")
    return 2 * (ranks - 1) / ranks


# --- rates ------------------------------------------------------------------------------------

def _positive(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError(f"elapsed time must be positive, got {seconds}")
    return seconds


def matmul_tflops(m: int, n: int, k: int, iterations: int, seconds: float) -> float:
    """TFLOP/s of `iterations` multiplies of m x k by k x n that took `seconds` in all."""
    return matmul_flops(m, n, k) * iterations / _positive(seconds) / TERA


def copy_bandwidth_gbs(nbytes: int, iterations: int, seconds: float) -> float:
    """Device-memory bandwidth, GB/s, of `iterations` copies of `nbytes`."""
    return copy_bytes_moved(nbytes) * iterations / _positive(seconds) / GB


def allreduce_algbw_gbs(nbytes: int, iterations: int, seconds: float) -> float:
    """All-reduce algorithm bandwidth, GB/s: bytes per rank / time per all-reduce."""
    if nbytes <= 0:
        raise ValueError(f"all-reduce size must be positive, got {nbytes}")
    return nbytes * iterations / _positive(seconds) / GB


def allreduce_busbw_gbs(nbytes: int, ranks: int, iterations: int, seconds: float) -> float:
    """All-reduce bus bandwidth, GB/s: algbw * 2(n-1)/n (nccl-tests)."""
    return allreduce_algbw_gbs(nbytes, iterations, seconds) * busbw_factor(ranks)


# --- minimums ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Minimums:
    matmul_tflops: float | None
    memory_gbs: float | None
    busbw_gbs: float | None


def minimums(model: str, gpus: int = 1, nvlink: bool = False) -> Minimums:
    """Expected minimums for one GPU of `model` (busbw only for 2+ NVLink-connected GPUs)."""
    peak = PEAKS.get(model)
    if peak is None:
        return Minimums(None, None, None)
    busbw = None
    if gpus >= 2 and nvlink and peak.nvlink_gbs:
        busbw = round(peak.nvlink_gbs * ALLREDUCE_MIN_FRACTION, 1)
    measured = TYPICAL.get(model)
    matmul: float | None
    memory: float | None
    if measured:
        matmul = round(measured[0] * MIN_OF_TYPICAL, 1) if peak.bf16_tflops else None
        memory = round(measured[1] * MIN_OF_TYPICAL, 1)
    else:
        matmul = round(peak.bf16_tflops * MATMUL_MIN_FRACTION, 1) if peak.bf16_tflops else None
        memory = round(peak.memory_gbs * MEMORY_MIN_FRACTION, 1) if peak.memory_gbs else None
    return Minimums(matmul_tflops=matmul, memory_gbs=memory, busbw_gbs=busbw)


# --- probe output -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    metric: str  # matmul | memory | allreduce
    device: str  # "cuda:0", "cpu", "cuda:0-3" (all-reduce)
    value: float  # TFLOP/s (matmul) or GB/s
    unit: str
    minimum: float | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.minimum is None or self.value >= self.minimum

    def describe(self) -> str:
        judged = "" if self.minimum is None else (
            f" (minimum {self.minimum:g})" if self.ok else f" < minimum {self.minimum:g}")
        return f"{self.metric} {self.device}: {self.value:.1f} {self.unit}{judged}"


@dataclass(frozen=True)
class ProbeResult:
    status: str  # ok | skipped | error
    reason: str = ""
    torch: str | None = None
    cuda_devices: int = 0
    measurements: tuple[Measurement, ...] = ()
    skipped: tuple[str, ...] = ()  # "allreduce: needs 2+ CUDA devices"

    @property
    def failures(self) -> list[Measurement]:
        return [m for m in self.measurements if not m.ok]


def parse_probe_output(lines: Iterable[str], models: Mapping[int, str] | None = None,
                       nvlink: bool = False) -> ProbeResult:
    """Turn the probe's JSON lines into measurements judged against per-model minimums.

    `models` maps CUDA device index -> nvidia-smi name (from GpuState); `nvlink` says whether
    every GPU pair is NVLink-connected (only then is an all-reduce minimum set)."""
    models = dict(models or {})
    records = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            raise ValueError(f"probe printed a line that is not JSON: {line[:200]!r}") from error
    if not records:
        return ProbeResult(status="error", reason="the probe printed nothing")
    head = records[0]
    if head.get("status") != "ok":
        return ProbeResult(status=str(head.get("status", "error")), reason=str(head.get("reason", "")))
    measurements: list[Measurement] = []
    skipped: list[str] = []
    cuda_devices = int(head.get("cuda_devices", 0))
    for rec in records[1:]:
        metric = rec.get("metric")
        if rec.get("status") == "skipped":
            skipped.append(f"{metric}: {rec.get('reason', '')}")
            continue
        if rec.get("status") == "error":
            skipped.append(f"{metric}: error: {rec.get('reason', '')}")
            continue
        device = str(rec.get("device", "?"))
        index = rec.get("index")
        model = models.get(index) if isinstance(index, int) else None
        if metric == "matmul":
            m, n, k = int(rec["m"]), int(rec["n"]), int(rec["k"])
            value = matmul_tflops(m, n, k, int(rec["iterations"]), float(rec["seconds"]))
            minimum = minimums(model).matmul_tflops if model and rec.get("dtype") == "bfloat16" else None
            measurements.append(Measurement("matmul", device, value, "TFLOP/s", minimum,
                                            f"{rec.get('dtype')} {m}x{k} @ {k}x{n}"))
        elif metric == "memory":
            value = copy_bandwidth_gbs(int(rec["bytes"]), int(rec["iterations"]), float(rec["seconds"]))
            minimum = minimums(model).memory_gbs if model else None
            measurements.append(Measurement("memory", device, value, "GB/s", minimum,
                                            f"copy of {int(rec['bytes'])} bytes"))
        elif metric == "allreduce":
            ranks = int(rec["ranks"])
            value = allreduce_busbw_gbs(int(rec["bytes"]), ranks, int(rec["iterations"]), float(rec["seconds"]))
            names = set(models.values())
            minimum = None
            if len(names) == 1:
                minimum = minimums(names.pop(), gpus=ranks, nvlink=nvlink).busbw_gbs
            measurements.append(Measurement("allreduce busbw", device, value, "GB/s", minimum,
                                            f"{ranks} ranks, {int(rec['bytes'])} bytes"))
        else:
            raise ValueError(f"probe reported an unknown metric {metric!r}")
    return ProbeResult(status="ok", torch=head.get("torch"), cuda_devices=cuda_devices,
                       measurements=tuple(measurements), skipped=tuple(skipped))
