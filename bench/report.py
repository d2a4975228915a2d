#!/usr/bin/env python3
"""Benchmark the fleet report (tools/fleet-report) over N sshd-only test hosts.

    bench/report.py --hosts N [--release R] [--gpu SPEC] [--no-drift] [--keep | --reuse | --down]

Brings up N test hosts (by default without GPUs: plain Debian with sshd and systemd, which is
enough for every fact the report reads), runs `tools/fleet-report` on them as an operator
would, and prints its wall time, the controller's peak memory and the per-state row count,
ending with `fleet report N hosts: X s`. Needs root (test hosts). Uses its own pool.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testing import testhosts  # noqa: E402
from testing.inventory import environment_data, write_inventory  # noqa: E402

POOL = "bench-report"
KEPT = Path("/var/lib/gpufleet-bench")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, required="--down" not in sys.argv)
    ap.add_argument("--release", default="bookworm", choices=testhosts.RELEASES)
    # root by default: the figures in docs/performance.md were measured so; the operator's shape
    # (testhosts.SSH_USER, through sudo) adds sudo's cost to every command
    ap.add_argument("--ssh-user", default="root", help=f"who logs in (root, or {testhosts.SSH_USER}: through sudo)")
    ap.add_argument("--gpu", default=None, help="simulated GPUs per host (test double); default none")
    ap.add_argument("--tier", default="research")
    ap.add_argument("--no-drift", action="store_true", help="pass --no-drift to the report")
    ap.add_argument("--runs", type=int, default=2, help="report runs on the same hosts (default 2)")
    ap.add_argument("--keep", action="store_true", help="leave the hosts up afterwards, for --reuse")
    ap.add_argument("--reuse", action="store_true", help="use the hosts a --keep run left up")
    ap.add_argument("--down", action="store_true", help="stop what a --keep run left up, and exit")
    args = ap.parse_args()

    if args.down:
        testhosts.down(POOL)
        return 0
    KEPT.mkdir(parents=True, exist_ok=True)
    inv = KEPT / f"report-{args.hosts}-inventory.py"
    t_up = 0.0
    if not (args.reuse and inv.exists()):
        testhosts.down(POOL)
        t0 = time.monotonic()
        hosts = testhosts.up(args.hosts, release=args.release, gpu=args.gpu, pool=POOL, ssh_user=args.ssh_user)
        t_up = time.monotonic() - t0
        write_inventory(inv, hosts, data={h.name: environment_data(h, args.tier) for h in hosts})
    results = []
    try:
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as out:
                cmd = [sys.executable, str(REPO / "tools" / "fleet-report"), str(inv), "--out", out,
                       "--quiet", *(["--no-drift"] if args.no_drift else [])]
                t0 = time.monotonic()
                proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
                _, status, rusage = os.wait4(proc.pid, 0)
                wall = time.monotonic() - t0
                err = proc.stderr.read()
                doc = json.loads((Path(out) / "fleet-report.json").read_text())
            states = collections.Counter(h["state"] for h in doc["hosts"])
            results.append((wall, rusage.ru_maxrss / 1024, dict(states), os.waitstatus_to_exitcode(status)))
            if len(doc["hosts"]) != args.hosts:
                sys.stderr.write(err[-3000:])
                return 1
    finally:
        if not (args.keep or args.reuse):
            testhosts.down(POOL)
            inv.unlink(missing_ok=True)
    if t_up:
        print(f"hosts up in {t_up:.1f} s (harness, not part of the runs)")
    for i, (wall, rss, states, rc) in enumerate(results, 1):
        print(f"run {i}: {wall:.2f} s, peak RSS {rss:.0f} MiB, rc {rc}, states {states}")
    best = min(r[0] for r in results)
    print(f"fleet report {args.hosts} hosts{' (no drift)' if args.no_drift else ''}: {best:.2f} s")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/report.py needs root (test hosts)")
    sys.exit(main())
