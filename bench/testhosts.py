#!/usr/bin/env python3
"""Benchmark the test-host harness: wall time to bring N hosts up (booted, systemd running,
sshd answering) and to tear them down, for N = 1, 10, 20 by default.

    bench/testhosts.py [--counts 1,10,20] [--release bookworm] [--csv bench/results/testhosts.csv]

Uses its own pool (bench), so it does not disturb other hosts. Needs root.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from testing import testhosts  # noqa: E402

POOL = "bench"


def rss_mib_of_pool() -> float:
    """Resident memory of everything running in the pool's cgroups (the hosts' cost)."""
    total = 0
    for cg in (testhosts.CGROUP_HIERARCHIES[0] / "gpufleet-testhosts" / POOL).rglob("cgroup.procs"):
        for pid in cg.read_text().split():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
    return total / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="1,10,20")
    ap.add_argument("--release", default="bookworm", choices=testhosts.RELEASES)
    ap.add_argument("--gpu", default=None)
    ap.add_argument("--csv", default="bench/results/testhosts.csv")
    args = ap.parse_args()
    testhosts.ensure_base(args.release)  # not part of the measurement: built once per recipe
    testhosts.down(POOL)
    rows = []
    for n in (int(c) for c in args.counts.split(",")):
        t0 = time.monotonic()
        testhosts.up(n, release=args.release, gpu=args.gpu, pool=POOL)
        t_up = time.monotonic() - t0
        rss = rss_mib_of_pool()
        t0 = time.monotonic()
        testhosts.down(POOL)
        t_down = time.monotonic() - t0
        left = testhosts.leftovers(POOL)
        rows.append({"hosts": n, "release": args.release, "gpu": args.gpu or "-",
                     "up_s": round(t_up, 2), "down_s": round(t_down, 2),
                     "rss_mib": round(rss, 1), "leftovers": len(left)})
        print(f"{n:>4} hosts  up {t_up:6.2f} s  down {t_down:6.2f} s  RSS {rss:7.1f} MiB  leftovers {len(left)}",
              flush=True)
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/testhosts.py needs root")
    sys.exit(main())
