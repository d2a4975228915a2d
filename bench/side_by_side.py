#!/usr/bin/env python3
"""all.py's no-op against plain pyinfra's, on the same kept real test hosts, alternated in one run.

    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/fleet.py --hosts 20 --keep   # boot + converge
    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/side_by_side.py --hosts 20 [--pairs 3]
    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/fleet.py --down

Plain pyinfra's side is bench/plain_noop.py: five tasks (a package, a directory, a file, a line
in it, a running service), pyinfra's own fact path, no gpufleet. It is applied once first (its
converge), then the pairs run: plain, all.py, plain, all.py... each `pyinfra -y INVENTORY
DEPLOY`, timed from start to exit, so that both sides meet the same moments of a shared
machine; the hosts' CPU (their cgroups) is read around each run. One more run of each with
--debug counts its remote commands per host (not timed).
Prints each run, the medians and `ratio N hosts: all.py / plain = R (A s / P s), C commands/host`.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYINFRA = REPO / ".venv" / "bin" / "pyinfra"
PLAIN = "bench/plain_noop.py"
ALL = "deploys/all.py"
COMMAND_RE = re.compile(r"Running command on (\S+?):")


def hosts_cpu_s() -> float | None:
    """CPU seconds the pool's test hosts have used so far (bench/fleet.py's reading of their cgroups)."""
    sys.path.insert(0, str(REPO / "bench"))
    import fleet
    from testing import testhosts

    return fleet.hosts_cpu_s(testhosts.list_hosts(fleet.POOL))


def run(inventory: str, deploy: str, debug: bool = False) -> dict:
    cpu_before = hosts_cpu_s()
    import measure

    cmd = [str(PYINFRA), "-y", *(["--debug"] if debug else []), inventory, deploy]
    text, rc, wall, rusage = measure.run_captured(cmd)
    if rc:
        sys.stderr.write(text[-3000:])
    m = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)", text, re.M)
    cpu_after = hosts_cpu_s()
    return {"rc": rc, "wall_s": wall, "cpu_s": rusage.ru_utime + rusage.ru_stime,
            "hosts_cpu_s": None if cpu_before is None or cpu_after is None else cpu_after - cpu_before,
            "changed": 0 if not m or m[2] == "-" else int(m[2]),
            "commands": collections.Counter(x[1] for x in COMMAND_RE.finditer(text))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, required=True, help="the kept fleet's size (bench/fleet.py --keep)")
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    pool = os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet")
    kept = Path("/var/lib/gpufleet-bench") / ("" if pool == "bench-fleet" else pool) / f"fleet-{args.hosts}.json"
    inventory = json.loads(kept.read_text())["inventory"]
    first = run(inventory, PLAIN)
    print(f"plain pyinfra's converge: {first['wall_s']:.2f} s, {first['changed']} changed, rc {first['rc']}")
    rows = []
    for i in range(args.pairs):
        for label, deploy in (("plain", PLAIN), ("all.py", ALL)):
            load = os.getloadavg()[0]
            r = run(inventory, deploy)
            rows.append((label, r))
            hosts = "" if r["hosts_cpu_s"] is None else f"{r['hosts_cpu_s'] * 1000 / args.hosts:5.0f} ms CPU per host  "
            print(f"  {i + 1} {label:<7} {r['wall_s']:6.2f} s wall  {r['cpu_s']:5.2f} s controller CPU  {hosts}"
                  f"{r['changed']} changed  rc {r['rc']}  load {load:.2f}", flush=True)
    counts = {}
    for label, deploy in (("plain", PLAIN), ("all.py", ALL)):
        r = run(inventory, deploy, debug=True)
        counts[label] = sum(r["commands"].values()) / max(1, args.hosts)
    med = {label: statistics.median(r["wall_s"] for lab, r in rows if lab == label) for label in ("plain", "all.py")}
    cpu = {label: statistics.median(r["cpu_s"] for lab, r in rows if lab == label) for label in ("plain", "all.py")}
    print(f"commands per host: plain {counts['plain']:g}, all.py {counts['all.py']:g}; "
          f"controller CPU (median): plain {cpu['plain']:.2f} s, all.py {cpu['all.py']:.2f} s")
    print(f"ratio {args.hosts} hosts: all.py / plain = {med['all.py'] / med['plain']:.2f} "
          f"({med['all.py']:.2f} s / {med['plain']:.2f} s), {counts['all.py']:g} commands/host")
    return 0 if all(r["rc"] == 0 for _, r in rows) else 1


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/side_by_side.py needs root (test hosts)")
    sys.exit(main())
