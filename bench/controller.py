#!/usr/bin/env python3
"""What one controller spends on deploys/all.py's no-op for N hosts, without N machines.

    bench/controller.py --hosts N [--no-profile] [--json PATH] [--keep-work]
    sudo bench/controller.py --record      # re-record from a real converged test host (see below)

pyinfra's own command line runs deploys/all.py in one process (bench/controller_run.py) over
N `@replay/NAME` hosts: pyinfra's real planner and executor, gpufleet's real deploys and fact
cache (memo, prefetch, fact plans), no SSH. Each host is answered by testing/replay.py, a TEST
DOUBLE for the network, from the recorded output of one converged real test host
(tests/fixtures/controller/noop-recording.json), with its own name and address. Every host
starts with the fact plan the real host had after its no-op (the steady state of a fleet that
has been deployed before).

Prints `controller N hosts: W s wall, C s CPU, M MiB peak, K commands/host` (the pyinfra
process: wall from start to exit, its user+system CPU, its peak RSS) and then the top 10
entries of a second, profiled run (cProfile, by own time; the profiler slows that run, so its
times are not the figure). It checks every host against the recording of the real run: the
same operations, in the same order, the same number of commands, every prefetch section
answered from the recording; a mismatch is printed and the exit status is 1.

The replayed hosts' side (framing and gzip of the prefetch answers, done on a real host by the
host) runs here in the controller's process; its CPU is printed apart (`test double`), and is
included in W and C: the figure is an upper bound of the controller's own cost. What SSH would
add (a handshake and encrypted channel per host) is not in it: docs/scale.md puts numbers on it.

Re-recording (after a change to what a no-op asks): bring up one converged host and keep it,
record, take it down:

    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/fleet.py --hosts 1 --keep
    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/controller.py --record
    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/fleet.py --down

--record runs a real no-op on that host (counting its commands from pyinfra's --debug output,
its operations from pyinfra's state, the prefetch script it sent from that output), then the
fact cache's prefetch script for the host's fact plan, which must be the one the no-op sent,
over SSH, and keeps each section's lines and exit status.
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import pstats
import re
import runpy
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from testing import replay  # noqa: E402

RUN = REPO / "bench" / "controller_run.py"
COMMAND_RE = re.compile(r"Running command on (\S+?):")


def run_once(inventory: Path, out_json: Path, env: dict[str, str], log: Path, replayed: bool = True,
             debug: bool = False) -> dict:
    """One pyinfra run through controller_run.py: its wall, CPU, peak RSS and record."""
    cmd = [sys.executable, str(RUN), str(out_json), *(["--replay"] if replayed else []), "-y",
           *(["--debug"] if debug else []), str(inventory), "deploys/all.py"]
    import measure

    with log.open("w") as out:
        rc, wall, rusage = measure.run(cmd, out, env={**os.environ, **env})
    record = json.loads(out_json.read_text()) if out_json.exists() else {}
    return {"rc": rc, "wall_s": wall,
            "cpu_s": rusage.ru_utime + rusage.ru_stime, "peak_mib": rusage.ru_maxrss / 1024, "record": record}


def write_plans(plan_dir: Path, names: list[str], plan: list) -> None:
    from gpufleet.controller import controller_files

    text = json.dumps({"format": 2, "facts": plan})
    for name in names:
        controller_files.write(plan_dir / f"{name}.json", text)


def check(record: dict, recording: dict, hosts: int) -> list[str]:
    """What differs between the replayed hosts and the recorded real no-op."""
    problems = []
    real = recording["noop"]
    if len(record.get("hosts", {})) != hosts:
        problems.append(f"{len(record.get('hosts', {}))} hosts in pyinfra's inventory, {hosts} expected")
    for name, host in record.get("hosts", {}).items():
        if host["operations_digest"] != real["operations_digest"]:
            problems.append(f"{name}: {host['operations']} operations, not the real no-op's {len(real['operations'])} "
                            "(or not the same ones in the same order)")
        if host["commands"] != real["commands_per_host"] or host["uploads"]:
            problems.append(f"{name}: {host['commands']} commands and {host['uploads']} uploads; the real no-op "
                            f"sent {real['commands_per_host']} and no upload")
        if host["unrecorded"]:
            problems.append(f"{name}: {host['unrecorded']} commands or prefetch sections not in the recording")
        if real.get("prefetch_digest") and host["prefetch_digest"] != real["prefetch_digest"]:
            problems.append(f"{name}: its prefetch asked other sections than the real no-op's prefetch")
        if host["prefetch_sections"] != len(recording["sections"]):
            problems.append(f"{name}: a prefetch of {host['prefetch_sections']} sections, the real one had "
                            f"{len(recording['sections'])}")
    if record.get("failed_hosts"):
        problems.append(f"failed hosts: {', '.join(record['failed_hosts'][:5])}")
    return problems[:20]


def bench(hosts: int, profile: bool, keep_work: bool = False, recording_path: Path | None = None) -> dict:
    recording_path = Path(recording_path or replay.RECORDING)
    recording = replay.load(recording_path)
    work = Path(tempfile.mkdtemp(prefix="gpufleet-controller-"))
    try:
        inventory = work / "replay_inventory.py"
        inventory.write_text(replay.inventory_source(hosts, recording))
        plans = work / ".gpufleet" / "factplans"
        write_plans(plans, [replay.host_name(i) for i in range(hosts)], recording["plan"])
        env = {"GPUFLEET_REPLAY_PLANS": str(plans), "GPUFLEET_REPLAY_RECORDING": str(recording_path)}
        result = run_once(inventory, work / "run.json", env, work / "run.log")
        if result["rc"] != 0:
            sys.stderr.write((work / "run.log").read_text()[-4000:])
        result["problems"] = check(result["record"], recording, hosts)
        counts = [h["commands"] for h in result["record"].get("hosts", {}).values()]
        result["commands_per_host"] = sum(counts) / len(counts) if counts else float("nan")
        result["hosts"] = hosts
        result["log_lines"] = sum(1 for _ in (work / "run.log").open())
        result["load"] = os.getloadavg()
        if profile:
            stats_path = work / "profile.pstats"
            prof = run_once(inventory, work / "profile.json", {**env, "GPUFLEET_CONTROLLER_PROFILE": str(stats_path)},
                            work / "profile.log")
            result["profile_wall_s"] = prof["wall_s"]
            result["profile"] = top_entries(stats_path, 10) if stats_path.exists() else []
        return result
    finally:
        if keep_work:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def top_entries(stats_path: Path, n: int) -> list[tuple[float, float, int, str]]:
    """(own s, cumulative s, calls, function) of the n functions with the most own time."""
    stats = pstats.Stats(str(stats_path))
    rows = []
    for (filename, line, func), (_cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = re.sub(r".*/site-packages/", "", filename).replace(str(REPO) + "/", "")
        rows.append((tt, ct, nc, f"{short}:{line}({func})"))
    return sorted(rows, reverse=True)[:n]


def record(pool: str, out: Path | None = None) -> int:
    """Record the no-op of the kept 1-host fleet of `pool` (bench/fleet.py --hosts 1 --keep)."""
    from gpufleet.controller import factcache
    from testing import testhosts

    kept = Path("/var/lib/gpufleet-bench") / ("" if pool == "bench-fleet" else pool) / "fleet-1.json"
    inventory = Path(json.loads(kept.read_text())["inventory"])
    testhosts.sudo_password()  # this process's: the kept fleet's inventory reads it, its host gets it below
    (name, data), = runpy.run_path(str(inventory))["test_hosts"]
    host = next(h for h in testhosts.list_hosts(pool) if h.name == name)
    testhosts.set_sudo_password([host])
    data = {k: v for k, v in data.items() if k != "_sudo_password"}  # never into the recording
    with tempfile.TemporaryDirectory() as tmp:
        # the real no-op, twice: the first settles the fact plan (a converge's plan is larger),
        # the second is the one recorded
        for _ in range(2):
            real = run_once(inventory, Path(tmp) / "real.json", {}, Path(tmp) / "real.log", replayed=False, debug=True)
            if real["rc"] != 0:
                sys.stderr.write((Path(tmp) / "real.log").read_text()[-4000:])
                return 1
        log = (Path(tmp) / "real.log").read_text()
        commands = [m[1] for m in COMMAND_RE.finditer(log)]
        real_texts = replay.prefetch_texts_in_log(log, name)
    ops_record = real["record"]
    (digest, operations), = ops_record["operation_lists"].items()
    plan = factcache.read_plan(factcache.PLAN_DIR / f"{name}.json", name)
    # the prefetch as a deploy run sends it (factcache._plan_entries, with deploy_run)
    entries = []
    for path, kwargs_json in plan:
        cls = factcache._load_class(path)
        if cls is None or getattr(cls, "shell_executable", None) or getattr(cls, "gpufleet_no_prefetch", False) \
                or getattr(cls, "gpufleet_end_of_run", False):
            continue
        fact = cls()
        text = factcache._command_text(fact, json.loads(kwargs_json))
        if text:
            entries.append((cls, kwargs_json, "{}", fact, text))
    script = factcache.prefetch_script(entries)
    lines = testhosts.ssh(host, "sh -c " + shlex.quote(script.text())).stdout.splitlines()
    if lines and lines[0] == factcache._PACKED:
        lines = factcache.gunzip_capped(base64.b64decode("".join(lines[1:]))).decode().splitlines()
    if real_texts != script._texts():
        sys.exit("the real no-op's prefetch (its --debug output) is not the one built from the host's fact plan: "
                 f"{'none found' if real_texts is None else f'{len(real_texts)} sections'} against {len(script._texts())}")
    sections = script.sections(lines)
    if sections is None:
        sys.exit(f"the host's prefetch output was refused: {script.refused}")
    doc = {
        "format": replay.RECORDING_FORMAT,
        "how": "bench/controller.py --record, from a bench/fleet.py --hosts 1 --keep host (see its docstring)",
        "host": {"name": name, "address": data["ssh_hostname"]},
        "data": data,
        "plan": [list(e) for e in plan],
        "sections": [{"text": t, "lines": out, "status": rc} for t, (out, rc) in zip(script._texts(), sections)],
        "commands": [],
        "noop": {"commands_per_host": len(commands), "operations": operations, "operations_digest": digest,
                 "prefetch_digest": replay.sections_digest(real_texts)},
    }
    out = Path(out or replay.RECORDING)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"recorded {name}: {len(doc['sections'])} prefetch sections, {len(plan)} plan entries, "
          f"{len(operations)} operations, {len(commands)} command(s) in the real no-op -> {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int)
    ap.add_argument("--no-profile", action="store_true", help="skip the profiled second run")
    ap.add_argument("--json", help="write the figures and checks here")
    ap.add_argument("--keep-work", action="store_true", help="keep the inventory, plans and pyinfra's output")
    ap.add_argument("--record", action="store_true", help="re-record from a kept real host (needs root)")
    ap.add_argument("--recording", type=Path, help=f"replay (with --record: write) this recording "
                    f"(default {replay.RECORDING.relative_to(REPO)})")
    args = ap.parse_args()
    if args.record:
        return record(os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet"), args.recording)
    if not args.hosts:
        ap.error("--hosts N (or --record)")
    r = bench(args.hosts, not args.no_profile, args.keep_work, args.recording)
    load = "/".join(f"{x:.2f}" for x in r["load"])
    print(f"pyinfra exit status {r['rc']}; {r['log_lines']} lines of output; load average {load} (1/5/15 min)")
    print(f"test double (the hosts' side of the prefetch, in this process): "
          f"{r['record'].get('replay_cpu_s', 0):.2f} s CPU, included below")
    for problem in r["problems"]:
        print(f"MISMATCH with the real no-op: {problem}")
    if r.get("profile"):
        print(f"profile (second run, {r['profile_wall_s']:.1f} s under cProfile), top 10 by own time:")
        print(f"{'own s':>8}{'cum s':>9}{'calls':>10}  function")
        for tt, ct, nc, name in r["profile"]:
            print(f"{tt:>8.2f}{ct:>9.2f}{nc:>10}  {name}")
    print(f"controller {args.hosts} hosts: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
          f"{r['peak_mib']:.0f} MiB peak, {r['commands_per_host']:g} commands/host")
    if args.json:
        Path(args.json).write_text(json.dumps({k: v for k, v in r.items()}, indent=1, default=str))
    return 0 if r["rc"] == 0 and not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
