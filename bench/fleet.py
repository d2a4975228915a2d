#!/usr/bin/env python3
"""Benchmark deploys/all.py over a fleet of local test hosts: first converge, then no-op re-run.

    bench/fleet.py --hosts N [--release bookworm|trixie] [--gpu SPEC] [--tier TIER] [--csv PATH]

For each run it reports wall time, the controller's peak memory (max RSS of the pyinfra
process) and CPU time, the CPU the hosts used (their cgroups), the remote commands executed per
host, counted from pyinfra's own --debug output ("Running command on HOST" lines; file uploads
are not in it, and a no-op run has none), and where the wall time went: package operations,
other operations, and everything outside operations (start-up, facts, planning), from a state
callback (bench/timed_pyinfra.py). Ends with one summary line:
`no-op N hosts: X s, C commands/host`. Needs root (test hosts). Uses its own pool.

    --keep     leave hosts and repository up; --reuse re-runs only the no-op runs on them;
    --down     stops what --keep left.
"""
from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import measure  # noqa: E402  (bench/measure.py)
from testing import aptrepo, testhosts  # noqa: E402
from testing.inventory import TEST_DRIVER, environment_data, write_inventory  # noqa: E402

# GPUFLEET_BENCH_POOL: another pool (and its own kept state), so that two people can bench at once
POOL = os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet")
TIMED = REPO / "bench" / "timed_pyinfra.py"
KEPT = Path("/var/lib/gpufleet-bench") / ("" if POOL == "bench-fleet" else POOL)
# Operations that install, upgrade or index packages: the "package installation" share of a run
PACKAGE_OP = re.compile(r"\bInstall (driver|the NVIDIA container|the Docker engine|the tier's diagnostics|gpg|the headers|nftables|the NVIDIA persistence)|apt package index|package (index|sources)", re.I)
COMMAND_RE = re.compile(r"Running command on (\S+?):")


def hosts_cpu_s(hosts: list) -> float | None:
    """CPU seconds the test hosts have used so far (their cgroups' cpu.stat), or None."""
    total, seen = 0, False
    for host in hosts:
        for d in testhosts._cgroup_dirs(host):
            stat = d / "cpu.stat"
            if stat.exists():
                total += int(dict(line.split() for line in stat.read_text().splitlines())["usage_usec"])
                seen = True
    return total / 1e6 if seen else None


def run_pyinfra(inventory: Path, debug: bool, hosts: list, log: Path | None = None) -> dict:
    cpu_before = hosts_cpu_s(hosts)
    with tempfile.TemporaryDirectory() as tmp:
        timings_path = Path(tmp) / "timings.json"
        cmd = [sys.executable, str(TIMED), str(timings_path), "-y", *(["--debug"] if debug else []),
               str(inventory), "deploys/all.py"]
        text, rc, wall, rusage = measure.run_captured(cmd)
        if log:
            log.write_text(text)
        timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    per_host = collections.Counter(m[1] for m in COMMAND_RE.finditer(text))
    m = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)", text, re.M)
    changed = 0 if not m or m[2] == "-" else int(m[2])
    if rc != 0:
        sys.stderr.write(text[-4000:])
    cpu_after = hosts_cpu_s(hosts)
    return {"rc": rc, "wall_s": wall, "peak_rss_mib": rusage.ru_maxrss / 1024,
            "controller_cpu_s": rusage.ru_utime + rusage.ru_stime,
            "hosts_cpu_s": None if cpu_before is None else cpu_after - cpu_before,
            "commands": per_host, "changed_ops": changed, "split": split(timings, wall)}


def split(timings: dict, wall: float) -> dict:
    """Where a run's wall time went: package operations, other operations, the rest.

    The rest is interpreter start-up, inventory and fact gathering, planning (pyinfra's
    prepare stage) and disconnecting: everything outside operation execution."""
    ops = [o for o in timings.get("ops", {}).values() if "end" in o]
    package = sum(o["end"] - o["start"] for o in ops if PACKAGE_OP.search(" ".join(o["names"])))
    other = sum(o["end"] - o["start"] for o in ops) - package
    stages = dict(timings.get("stages", []))
    top = sorted(ops, key=lambda o: o["start"] - o["end"])[:8]
    return {"package_s": package, "other_ops_s": other, "outside_ops_s": wall - package - other,
            "prepare_s": stages.get("Execute", 0) - stages.get("Prepare", 0),
            "top": [(round(o["end"] - o["start"], 2), " / ".join(o["names"])) for o in top]}


def state_file(hosts: int) -> Path:
    return KEPT / f"fleet-{hosts}.json"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, required="--down" not in sys.argv)
    ap.add_argument("--release", default="bookworm", choices=testhosts.RELEASES)
    # root by default: the figures in docs/performance.md were measured so; the operator's shape
    # (testhosts.SSH_USER, through sudo) adds sudo's cost to every command
    ap.add_argument("--ssh-user", default="root", help=f"who logs in (root, or {testhosts.SSH_USER}: through sudo)")
    ap.add_argument("--gpu", default=f"a100x4@{TEST_DRIVER}", help="simulated GPUs per host (test double)")
    ap.add_argument("--tier", default="research")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--keep", action="store_true",
                    help="leave the hosts and the repository up afterwards, for --reuse")
    ap.add_argument("--reuse", action="store_true",
                    help="re-run only the no-op runs on the hosts a --keep run left up")
    ap.add_argument("--down", action="store_true", help="stop what a --keep run left up, and exit")
    ap.add_argument("--logs", metavar="DIR", help="write each run's pyinfra output to DIR (the counted runs' "
                    "--debug output says which commands each host ran)")
    args = ap.parse_args()

    if args.down:
        for kept in ([args.hosts] if args.hosts else
                     [int(f.stem.split("-")[1]) for f in KEPT.glob("fleet-*.json")] or [0]):
            teardown(kept)
        return 0
    rows, t_up = [], 0.0
    kept = json.loads(state_file(args.hosts).read_text()) if args.reuse else None
    runs = (("first converge", True), ("no-op (counted)", True), ("no-op", False))
    try:
        if kept:
            inv = Path(kept["inventory"])
            hosts = testhosts.list_hosts(POOL)
            testhosts.set_sudo_password(hosts)  # this process's (the kept inventory reads it)
            runs = runs[1:]
        else:
            teardown(args.hosts)
            work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-"))
            t0 = time.monotonic()
            hosts = testhosts.up(args.hosts, release=args.release, gpu=args.gpu, pool=POOL, ssh_user=args.ssh_user)
            t_up = time.monotonic() - t0
            # NVIDIA's repositories are replaced by the signed stand-in (testing/aptrepo.py)
            repo = aptrepo.serve(work / "aptrepo")
            inv = write_inventory(work / "bench_inventory.py", hosts,
                                  data={h.name: {**environment_data(h, args.tier, repo), "tier_mismatch": "warn"}
                                        for h in hosts})
            KEPT.mkdir(parents=True, exist_ok=True)
            aptrepo.save(repo, KEPT / f"repo-{args.hosts}.json")
            state_file(args.hosts).write_text(json.dumps({"inventory": str(inv), "work": str(work)}))
        logs = Path(args.logs) if args.logs else None
        if logs:
            logs.mkdir(parents=True, exist_ok=True)
        for label, debug in runs:
            log = logs / (re.sub(r"\W+", "-", label).strip("-") + ".log") if logs else None
            r = run_pyinfra(inv, debug, hosts, log)
            counts = list(r["commands"].values()) if debug else []
            rows.append({
                "run": label, "hosts": args.hosts, "release": args.release, "gpu": args.gpu or "-",
                "wall_s": round(r["wall_s"], 2), "peak_rss_mib": round(r["peak_rss_mib"], 1),
                "commands_per_host": round(sum(counts) / args.hosts, 1) if counts else "",
                "max_commands_host": max(counts) if counts else "",
                "changed_ops": r["changed_ops"], "rc": r["rc"],
                "package_ops_s": round(r["split"]["package_s"], 1),
                "other_ops_s": round(r["split"]["other_ops_s"], 1),
                "outside_ops_s": round(r["split"]["outside_ops_s"], 1),
                "prepare_s": round(r["split"]["prepare_s"], 1),
                "controller_cpu_s": round(r["controller_cpu_s"], 2),
                "host_cpu_ms_per_host": "" if r["hosts_cpu_s"] is None else round(r["hosts_cpu_s"] * 1000 / args.hosts),
            })
            if r["rc"] != 0:
                break
            if label == "first converge":
                print("slowest operations of the first converge (wall s, all hosts in parallel):")
                for secs, name in r["split"]["top"]:
                    print(f"  {secs:>7}  {name}")
    finally:
        if not (args.keep or args.reuse):
            teardown(args.hosts)

    if t_up:
        print(f"hosts up in {t_up:.1f} s (harness, not part of the runs)")
    print(f"{'run':<18}{'hosts':>6}{'wall s':>9}{'peak MiB':>10}{'cmds/host':>11}{'changed':>9}{'rc':>4}"
          f"{'pkg ops s':>11}{'other ops s':>13}{'outside s':>11}{'ctl CPU s':>11}{'host CPU ms/host':>18}")
    for r in rows:
        print(f"{r['run']:<18}{r['hosts']:>6}{r['wall_s']:>9}{r['peak_rss_mib']:>10}"
              f"{r['commands_per_host']!s:>11}{r['changed_ops']:>9}{r['rc']:>4}"
              f"{r['package_ops_s']:>11}{r['other_ops_s']:>13}{r['outside_ops_s']:>11}"
              f"{r['controller_cpu_s']:>11}{r['host_cpu_ms_per_host']!s:>18}")
    out = Path(args.csv or f"bench/results/fleet-{args.hosts}{'-reuse' if kept else ''}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    noop, counted = rows[-1], rows[-2]
    print(f"no-op {args.hosts} hosts: {noop['wall_s']} s, {counted['commands_per_host']} commands/host")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def teardown(hosts: int) -> None:
    """Stop the pool, the repository server and remove the work folder of a kept run."""
    testhosts.down(POOL)
    aptrepo.stop_saved(KEPT / f"repo-{hosts}.json")
    path = state_file(hosts)
    if path.exists():
        shutil.rmtree(json.loads(path.read_text())["work"], ignore_errors=True)
        path.unlink()


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/fleet.py needs root (test hosts)")
    sys.exit(main())
