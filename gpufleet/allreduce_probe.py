"""gpufleet multi-node all-reduce: runs ON EACH HOST of a pair (or group) at once, one rank each.

Sent by facts/gpu_checks.py AllReduceRank as `<python> -c <this file's text> ARGS`, <python> the
tier's PyTorch runtime. torch.distributed with a TCP rendezvous on the first rank's address:
NCCL on CUDA devices, gloo on the CPU (where the GPUs are simulated, or there are none). Every
rank adds a known vector, so a sum that is not the expected one fails as surely as a timeout.
Prints one JSON line (raw counts only: the controller computes bandwidths, gpufleet/perf.py);
NCCL's own NCCL_DEBUG=INFO lines come before it, and say which transport ran. Always exits 0.

    --master ADDR --port P --rank R --world W [--backend auto|nccl|gloo] [--mib M] [--iters I]
    [--timeout S]
"""
from __future__ import annotations  # the host's python3 may be older than the controller's

import argparse
import json
import os
import socket
import sys
import time


def emit(**record: object) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)


def interface_to(address: str) -> str:
    """The name of the interface this host reaches `address` through ("" if not found): gloo and
    NCCL bind to an interface, and a host's name may resolve to none of its data addresses."""
    import fcntl
    import struct

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))
        mine = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == mine:
                return name
    except OSError:
        return ""
    finally:
        probe.close()
    return ""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpufleet-allreduce")
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=int, default=60)
    args = parser.parse_args(argv)
    try:
        import datetime

        import torch
        import torch.distributed as dist
    except Exception as error:  # ImportError, or a broken install
        emit(status="error", reason=f"PyTorch not importable: {str(error)[:200]}")
        return 0
    cuda = bool(torch.cuda.is_available())
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    ifname = interface_to(args.master)
    if ifname:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", ifname)
    os.environ.setdefault("NCCL_DEBUG", "INFO")
    os.environ.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    start = time.perf_counter()
    try:
        dist.init_process_group(backend, init_method=f"tcp://{args.master}:{args.port}", rank=args.rank,
                                world_size=args.world, timeout=datetime.timedelta(seconds=args.timeout))
    except Exception as error:
        emit(status="error", stage="rendezvous", backend=backend, reason=str(error).splitlines()[0][:300]
             if str(error) else type(error).__name__, seconds=time.perf_counter() - start)
        return 0
    try:
        device = "cuda:0" if backend == "nccl" else "cpu"
        elements = args.mib * 1024 * 1024 // 4
        check = torch.full((2,), float(args.rank + 1), device=device)
        dist.all_reduce(check)
        want = args.world * (args.world + 1) / 2
        total = [float(x) for x in check.tolist()]
        data = torch.ones(elements, dtype=torch.float32, device=device)
        dist.all_reduce(data)
        if cuda and backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
        begin = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(data)
        if cuda and backend == "nccl":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - begin
        emit(status="ok", backend=backend, ranks=args.world, bytes=elements * 4, iterations=args.iters,
             seconds=seconds, sum=total, expected=want, cuda=cuda, interface=ifname)
    except Exception as error:
        emit(status="error", stage="all-reduce", backend=backend, reason=str(error).splitlines()[0][:300]
             if str(error) else type(error).__name__)
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # the group may be half made after an error
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
