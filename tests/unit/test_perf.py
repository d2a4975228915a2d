"""The performance probe's arithmetic (FLOP and byte counts, bus bandwidth, minimums) and the
probe script itself, run on this machine (no GPU here: it reports "no CUDA device", or
"PyTorch not installed" where torch is absent)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpufleet.plans import perf
from gpufleet.perf_probe import __file__ as PROBE

pytestmark = pytest.mark.unit


def test_matmul_flop_count_is_two_m_n_k():
    assert perf.matmul_flops(2, 3, 4) == 48
    assert perf.matmul_flops(8192, 8192, 8192) == 2 * 8192 ** 3
    with pytest.raises(ValueError):
        perf.matmul_flops(0, 1, 1)


def test_matmul_tflops():
    # 20 multiplies of 8192^3 (1.0995e12 FLOP each) in 0.0275 s = 799.6 TFLOP/s
    assert perf.matmul_tflops(8192, 8192, 8192, 20, 0.0275) == pytest.approx(2 * 8192 ** 3 * 20 / 0.0275 / 1e12)
    assert perf.matmul_tflops(1000, 1000, 1000, 1, 1.0) == pytest.approx(0.002)
    with pytest.raises(ValueError):
        perf.matmul_tflops(1, 1, 1, 1, 0)


def test_copy_moves_every_byte_twice():
    assert perf.copy_bytes_moved(1024) == 2048
    # 10 copies of 1 GiB in 1 s = 21.47 GB/s
    assert perf.copy_bandwidth_gbs(2 ** 30, 10, 1.0) == pytest.approx(2 * 2 ** 30 * 10 / 1e9)


@pytest.mark.parametrize("ranks, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
def test_busbw_factor_is_two_n_minus_one_over_n(ranks, factor):
    assert perf.busbw_factor(ranks) == pytest.approx(factor)


def test_allreduce_bus_bandwidth_as_nccl_tests():
    # nccl-tests: 8 GPUs, 1 GB per rank in 5 ms -> algbw 200 GB/s, busbw 350 GB/s
    assert perf.allreduce_algbw_gbs(10 ** 9, 1, 0.005) == pytest.approx(200.0)
    assert perf.allreduce_busbw_gbs(10 ** 9, 8, 1, 0.005) == pytest.approx(350.0)
    assert perf.allreduce_busbw_gbs(10 ** 9, 2, 1, 0.005) == pytest.approx(200.0)


def test_minimums_catch_a_slow_gpu_at_90_percent_of_typical():
    # the live H200's own measurements: 778.7 / 794.3 TFLOP/s, 4233 / 4212 GB/s
    h200 = perf.minimums("NVIDIA H200")
    assert h200.matmul_tflops == pytest.approx(0.9 * 786.5, abs=0.1) and h200.memory_gbs == pytest.approx(0.9 * 4222.5, abs=0.1)
    assert 700 < h200.matmul_tflops < 778.7 and 3700 < h200.memory_gbs < 4212   # both real runs pass, a slow GPU fails
    assert perf.MATMUL_MIN_FRACTION == pytest.approx(0.9 * 0.795, abs=0.001)


def test_minimums_are_fractions_of_the_datasheet_peak():
    h100 = perf.minimums("NVIDIA H100 80GB HBM3", gpus=8, nvlink=True)
    assert h100.matmul_tflops == pytest.approx(989 * perf.MATMUL_MIN_FRACTION, abs=0.05)
    assert h100.memory_gbs == pytest.approx(3350 * perf.MEMORY_MIN_FRACTION)
    assert h100.busbw_gbs == pytest.approx(450 * perf.ALLREDUCE_MIN_FRACTION)
    # no NVLink, or one GPU: no all-reduce minimum; T4 has no BF16: no matmul minimum
    assert perf.minimums("NVIDIA H100 80GB HBM3", gpus=8, nvlink=False).busbw_gbs is None
    assert perf.minimums("NVIDIA H200", gpus=1, nvlink=True).busbw_gbs is None
    assert perf.minimums("Tesla T4").matmul_tflops is None
    assert perf.minimums("unknown board") == perf.Minimums(None, None, None)


def _lines(*records):
    return [json.dumps(r) for r in records]


def test_parse_probe_judges_each_gpu_against_its_model():
    out = _lines(
        {"status": "ok", "torch": "2.9.1", "cuda_devices": 2},
        {"metric": "matmul", "device": "cuda:0", "index": 0, "m": 8192, "n": 8192, "k": 8192,
         "dtype": "bfloat16", "iterations": 20, "seconds": 0.0275},           # ~800 TFLOP/s: fine
        {"metric": "matmul", "device": "cuda:1", "index": 1, "m": 8192, "n": 8192, "k": 8192,
         "dtype": "bfloat16", "iterations": 20, "seconds": 0.1},              # ~220 TFLOP/s: too slow
        {"metric": "memory", "device": "cuda:0", "index": 0, "bytes": 2 ** 30, "iterations": 20, "seconds": 0.0105},
        {"metric": "allreduce", "device": "cuda:0-1", "ranks": 2, "bytes": 2 ** 28, "iterations": 20,
         "seconds": 0.02},
    )
    result = perf.parse_probe_output(out, {0: "NVIDIA H200", 1: "NVIDIA H200"}, nvlink=True)
    assert result.status == "ok" and result.cuda_devices == 2
    by_device = {(m.metric, m.device): m for m in result.measurements}
    assert by_device[("matmul", "cuda:0")].value == pytest.approx(799.6, abs=0.1)
    assert by_device[("matmul", "cuda:0")].ok
    assert not by_device[("matmul", "cuda:1")].ok
    assert by_device[("memory", "cuda:0")].value == pytest.approx(2 * 2 ** 30 * 20 / 0.0105 / 1e9)   # 4090 GB/s: fine
    allreduce = by_device[("allreduce busbw", "cuda:0-1")]
    assert allreduce.value == pytest.approx(2 ** 28 * 20 / 0.02 / 1e9 * 1.0)
    assert allreduce.minimum == pytest.approx(225.0)
    assert [m.device for m in result.failures] == ["cuda:1"]
    assert "< minimum 707.9" in result.failures[0].describe()


def test_parse_probe_skips():
    assert perf.parse_probe_output(_lines({"status": "skipped", "reason": "PyTorch not installed"})).reason == \
        "PyTorch not installed"
    result = perf.parse_probe_output(_lines({"status": "ok", "cuda_devices": 0},
                                            {"metric": "matmul", "status": "skipped", "reason": "no CUDA device"}))
    assert result.measurements == () and result.skipped == ("matmul: no CUDA device",)
    assert perf.parse_probe_output([]).status == "error"
    with pytest.raises(ValueError):
        perf.parse_probe_output(["{not json"])


def _probe(python: str, *args: str) -> list[str]:
    proc = subprocess.run([python, PROBE, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def _torch_python() -> str | None:
    for candidate in (os.environ.get("GPUFLEET_PROBE_PYTHON"), sys.executable, shutil.which("python3")):
        if candidate and subprocess.run([candidate, "-c", "import torch"], capture_output=True).returncode == 0:
            return candidate
    return None


def test_probe_script_says_skipped_without_pytorch(tmp_path):
    # An interpreter that cannot import torch: -S -I keeps site-packages out.
    proc = subprocess.run([sys.executable, "-S", "-I", PROBE], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = perf.parse_probe_output(proc.stdout.splitlines())
    assert (result.status, result.reason) == ("skipped", "PyTorch not installed")


def test_probe_script_measures_with_pytorch():
    python = _torch_python()
    if python is None:
        pytest.skip("PyTorch not installed here (pip install torch==2.13.0 installs the CPU build; "
                    "or set GPUFLEET_PROBE_PYTHON)")
    # The GPU run reports why it measured nothing...
    cuda = perf.parse_probe_output(_probe(python, "--device", "cuda"))
    if cuda.cuda_devices == 0:
        assert cuda.measurements == () and "matmul: no CUDA device" in cuda.skipped
    # ...and a small CPU run proves the measurement, parsing and arithmetic end to end.
    cpu = perf.parse_probe_output(_probe(python, "--device", "cpu", "--size", "256", "--iters", "3",
                                         "--copy-mib", "16"))
    assert cpu.status == "ok"
    kinds = {m.metric: m for m in cpu.measurements}
    assert set(kinds) == {"matmul", "memory"} and all(m.value > 0 for m in kinds.values())
    assert kinds["matmul"].minimum is None  # no GPU model: measured, never judged
    assert "allreduce: needs 2+ CUDA devices" in cpu.skipped
