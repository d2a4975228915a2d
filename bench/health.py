#!/usr/bin/env python3
"""Benchmark tools/health over a kept fleet (bench/fleet.py --hosts N --keep): wall time, the
controller's peak memory and the remote commands per host, counted where pyinfra runs them
(Host.run_shell_command, wrapped in this process).

    sudo .venv/bin/python bench/health.py [--repeat R] [--pool POOL]

Ends with `health N hosts: X s (best of R), C commands/host`. Read-only on the hosts.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

POOL = os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet")
KEPT = Path("/var/lib/gpufleet-bench") / ("" if POOL == "bench-fleet" else POOL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    kept = sorted(KEPT.glob("fleet-*.json"))
    if not kept:
        print(f"bench/health.py: no kept fleet in {KEPT}: run bench/fleet.py --hosts N --keep first", file=sys.stderr)
        return 2
    inventory = json.loads(kept[-1].read_text())["inventory"]

    from pyinfra.api.host import Host

    from gpufleet.apps import health

    counts: collections.Counter[str] = collections.Counter()
    original = Host.run_shell_command

    def counted(self: Host, *a: object, **k: object) -> object:
        counts[self.name] += 1
        return original(self, *a, **k)

    Host.run_shell_command = counted  # type: ignore[method-assign]
    times, rcs, per_host = [], [], []
    for _ in range(args.repeat):
        counts.clear()
        out = io.StringIO()
        start = time.monotonic()
        with contextlib.redirect_stdout(out):
            rc = health.main([inventory, "--quiet", "--json"], prog="health")
        times.append(time.monotonic() - start)
        rcs.append(rc)
        hosts = json.loads(out.getvalue())["hosts"]
        per_host.append(sum(counts.values()) / max(1, len(hosts)))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"runs: {', '.join(f'{t:.2f} s' for t in times)}; exit {rcs}; peak {peak:.1f} MiB; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"health {len(hosts)} hosts: {min(times):.2f} s (best of {args.repeat}), "
          f"{max(per_host):.1f} commands/host")
    return 0


if __name__ == "__main__":
    sys.exit(main())
