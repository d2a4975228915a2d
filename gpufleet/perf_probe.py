"""gpufleet performance probe: runs ON THE HOST with the tier's PyTorch runtime (stdlib + PyTorch).

Sent by facts/gpu_checks.py as `<python> -c <this file's text> ARGS`, <python> the interpreter of
the tier's pytorch_runtime (gpufleet/plans/pytorch_runtime.py), which the first line names. Prints one JSON object per
line: first {"status": "ok", ...} (or "skipped" with the reason, when PyTorch is missing), then
one record per measurement with raw counts only (sizes, iterations, seconds); the controller
turns them into TFLOP/s and GB/s (gpufleet/plans/perf.py), so no arithmetic lives here.

    --device cuda|cpu   cuda (default): every GPU; cpu: a small run for tests, no GPU needed
    --size N            matmul size (N x N @ N x N)
    --iters I           timed iterations per measurement
    --copy-mib M        bytes per device-memory copy
    --allreduce-mib M   bytes per rank for the all-reduce (2+ CUDA devices)
"""
from __future__ import annotations  # the host's python3 may be older than the controller's

import argparse
import json
import sys
import time
from typing import Any


def emit(**record: object) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpufleet-perf-probe")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--allreduce-mib", type=int, default=2048)  # GiB-scale: where NCCL reaches its bus bandwidth
    args = parser.parse_args(argv)

    try:
        import torch
    except Exception:  # ImportError, or a broken install
        emit(status="skipped", reason="PyTorch not installed", python=sys.executable)
        return 0

    cuda = bool(torch.cuda.is_available())
    count = torch.cuda.device_count() if cuda else 0
    emit(status="ok", torch=torch.__version__, cuda_devices=count, device=args.device, python=sys.executable)

    if args.device == "cuda" and not cuda:
        for metric in ("matmul", "memory", "allreduce"):
            emit(metric=metric, status="skipped", reason="no CUDA device")
        return 0

    devices: list[tuple[str, int | None]]
    if args.device == "cpu":
        devices = [("cpu", None)]
        dtype = torch.bfloat16
    else:
        devices = [(f"cuda:{i}", i) for i in range(count)]
        dtype = torch.bfloat16

    for dev, index in devices:
        _matmul(torch, dev, index, args.size, args.iters, dtype)
        _memory(torch, dev, index, args.copy_mib, args.iters)
    if args.device == "cpu" or count < 2:
        emit(metric="allreduce", status="skipped", reason="needs 2+ CUDA devices")
        return 0
    _allreduce(torch, count, args.allreduce_mib, args.iters)
    return 0


def _sync(torch: Any, dev: str) -> None:
    if dev != "cpu":
        torch.cuda.synchronize(dev)


def _matmul(torch: Any, dev: str, index: int | None, n: int, iters: int, dtype: Any) -> None:
    try:
        a = torch.randn(n, n, dtype=dtype, device=dev)
        b = torch.randn(n, n, dtype=dtype, device=dev)
        for _ in range(2):
            torch.matmul(a, b)
        _sync(torch, dev)
        start = time.perf_counter()
        for _ in range(iters):
            torch.matmul(a, b)
        _sync(torch, dev)
        emit(metric="matmul", device=dev, index=index, m=n, n=n, k=n, dtype=str(dtype).replace("torch.", ""),
             iterations=iters, seconds=time.perf_counter() - start)
        del a, b
    except Exception as error:  # report, keep measuring the rest
        emit(metric="matmul", device=dev, index=index, status="error", reason=str(error)[:300])


def _memory(torch: Any, dev: str, index: int | None, copy_mib: int, iters: int) -> None:
    try:
        nbytes = copy_mib * 1024 * 1024
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)
        _sync(torch, dev)
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        _sync(torch, dev)
        emit(metric="memory", device=dev, index=index, bytes=nbytes, iterations=iters,
             seconds=time.perf_counter() - start)
        del src, dst
    except Exception as error:
        emit(metric="memory", device=dev, index=index, status="error", reason=str(error)[:300])


def _allreduce(torch: Any, count: int, allreduce_mib: int, iters: int) -> None:
    try:
        from torch.cuda import nccl

        elements = allreduce_mib * 1024 * 1024 // 2
        tensors = [torch.ones(elements, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(count)]
        nccl.all_reduce(tensors)
        for i in range(count):
            torch.cuda.synchronize(i)
        start = time.perf_counter()
        for _ in range(iters):
            nccl.all_reduce(tensors)
        for i in range(count):
            torch.cuda.synchronize(i)
        emit(metric="allreduce", device=f"cuda:0-{count - 1}", ranks=count, bytes=elements * 2,
             iterations=iters, seconds=time.perf_counter() - start)
    except Exception as error:
        emit(metric="allreduce", status="error", reason=str(error)[:300])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
