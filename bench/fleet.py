#!/usr/bin/env python3
"""Benchmark deploys/all.py over a fleet of local test hosts: first converge, then no-op re-run.

    bench/fleet.py --hosts N [--release bookworm|trixie] [--gpu SPEC] [--tier TIER] [--csv PATH]

For each run it reports wall time, the controller's peak memory (max RSS of the pyinfra
process) and the remote commands executed per host, counted from pyinfra's own --debug output
("Running command on HOST" lines, plus file uploads). Ends with one summary line:
`no-op N hosts: X s, C commands/host`. Needs root (test hosts). Uses its own pool.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testing import aptrepo, testhosts  # noqa: E402
from testing.inventory import TEST_DRIVER, environment_data, write_inventory  # noqa: E402

POOL = "bench-fleet"
PYINFRA = Path(sys.executable).with_name("pyinfra")
COMMAND_RE = re.compile(r"Running command on (\S+?):")
UPLOAD_RE = re.compile(r"\[(\S+?)\].*Attempting upload|Attempting upload of .* to .*")


def run_pyinfra(inventory: Path, debug: bool) -> dict:
    cmd = [str(PYINFRA), "-y", *(["--debug"] if debug else []), str(inventory), "deploys/all.py"]
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, rusage = os.wait4(proc.pid, 0)
        wall = time.monotonic() - t0
        out.seek(0)
        text = out.read()
    rc = os.waitstatus_to_exitcode(status)
    per_host = collections.Counter(m[1] for m in COMMAND_RE.finditer(text))
    m = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    changed = 0 if not m or m[2] == "-" else int(m[2])
    if rc != 0:
        sys.stderr.write(text[-4000:])
    return {"rc": rc, "wall_s": wall, "peak_rss_mib": rusage.ru_maxrss / 1024,
            "commands": per_host, "changed_ops": changed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, required=True)
    ap.add_argument("--release", default="bookworm", choices=testhosts.RELEASES)
    ap.add_argument("--gpu", default=f"a100x4@{TEST_DRIVER}", help="simulated GPUs per host (test double)")
    ap.add_argument("--tier", default="research")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--keep", action="store_true", help="leave the hosts up afterwards")
    args = ap.parse_args()

    testhosts.down(POOL)
    t0 = time.monotonic()
    hosts = testhosts.up(args.hosts, release=args.release, gpu=args.gpu, pool=POOL)
    t_up = time.monotonic() - t0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # NVIDIA's repositories are replaced by the signed stand-in (testing/aptrepo.py)
        repo = aptrepo.serve(Path(tmp) / "aptrepo")
        try:
            inv = write_inventory(Path(tmp) / "bench_inventory.py", hosts,
                                  data={h.name: {**environment_data(h, args.tier, repo), "tier_mismatch": "warn"}
                                        for h in hosts})
            for label, debug in (("first converge", True), ("no-op (counted)", True), ("no-op", False)):
                r = run_pyinfra(inv, debug)
                counts = [r["commands"].get(h.name, 0) for h in hosts] if debug else []
                rows.append({
                    "run": label, "hosts": args.hosts, "release": args.release, "gpu": args.gpu or "-",
                    "wall_s": round(r["wall_s"], 2), "peak_rss_mib": round(r["peak_rss_mib"], 1),
                    "commands_per_host": round(sum(counts) / len(counts), 1) if counts else "",
                    "max_commands_host": max(counts) if counts else "",
                    "changed_ops": r["changed_ops"], "rc": r["rc"],
                })
        finally:
            repo.stop()
            if not args.keep:
                testhosts.down(POOL)

    print(f"hosts up in {t_up:.1f} s (harness, not part of the runs)")
    print(f"{'run':<18}{'hosts':>6}{'wall s':>9}{'peak MiB':>10}{'cmds/host':>11}{'changed':>9}{'rc':>4}")
    for r in rows:
        print(f"{r['run']:<18}{r['hosts']:>6}{r['wall_s']:>9}{r['peak_rss_mib']:>10}"
              f"{r['commands_per_host']!s:>11}{r['changed_ops']:>9}{r['rc']:>4}")
    out = Path(args.csv or f"bench/results/fleet-{args.hosts}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    noop, counted = rows[2], rows[1]
    print(f"no-op {args.hosts} hosts: {noop['wall_s']} s, {counted['commands_per_host']} commands/host")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/fleet.py needs root (test hosts)")
    sys.exit(main())
