#!/usr/bin/env python3
"""What each fact of a no-op run costs on the host: run the facts a host asked for in its last
run (its plan in .gpufleet/factplans/, the same commands the prefetch sends) one by one over
ssh, with their host-side wall and CPU time, slowest first.

    bench/fact_cost.py HOST_NAME [--pool POOL] [--repeat N] [--sections]

--sections: the host CPU (not wall) of each section of the script as the prefetch sends it
(batches included, one section per batch family), each run --repeat times in a row on the host,
from the shell's children's CPU ticks in /proc (10 ms a tick: repeat 10 or more).

Needs root (test hosts) and a host of a kept fleet (bench/fleet.py --keep).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)
from gpufleet import factcache  # noqa: E402
from testing import testhosts  # noqa: E402

# Per section: wall microseconds on the host (the two `date` forks add about 1 ms each).
_WRAP = "s=$(date +%s%N); ( {text} ) >/dev/null 2>&1; e=$(date +%s%N); echo \"{i} $(( (e - s) / 1000 ))\"\n"
# The whole script as the prefetch sends it, timed on the host: wall ms, then the CPU seconds
# of its children (user and system), from the shell's `times`.
_WHOLE = "s=$(date +%s%N); sh -c {script} >/dev/null 2>&1; e=$(date +%s%N); echo $(( (e - s) / 1000000 )); times\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("host")
    ap.add_argument("--pool", default=os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sections", action="store_true", help="host CPU of each section of the prefetch script")
    args = ap.parse_args()
    host = next(h for h in testhosts.list_hosts(args.pool) if h.name == args.host)
    plan = factcache.read_plan(factcache.PLAN_DIR / f"{args.host}.json", args.host)
    entries = []  # in the prefetch's own shape: (class, arguments JSON, executor JSON, fact, text)
    executor_json = "{}"  # bench hosts: root over ssh, pyinfra's defaults
    for path, kwargs_json in plan:
        cls = factcache._load_class(path)
        if cls is None:
            continue
        fact = cls()
        text = factcache._command_text(fact, json.loads(kwargs_json))
        if text:
            entries.append((cls, kwargs_json, executor_json, fact, text))
    if args.sections:
        return sections(host, entries, args.repeat)
    script = "".join(_WRAP.format(text=entry[-1], i=i) for i, entry in enumerate(entries))
    best: dict[int, float] = {}
    for _ in range(args.repeat):
        for line in testhosts.ssh(host, script).stdout.splitlines():
            i, us = map(int, line.split())
            best[i] = min(best.get(i, us / 1000), us / 1000)
    whole = factcache.prefetch_script(entries).text()  # batched and packed, as the prefetch sends it
    runs = []
    for _ in range(args.repeat):
        out = testhosts.ssh(host, _WHOLE.format(script=shlex.quote(whole))).stdout.split()
        runs.append((int(out[0]), sum(_secs(x) for x in out[3:5])))  # children's user, system
    wall, cpu = min(runs)
    print(f"{len(entries)} facts in one script (as the prefetch sends it): {wall} ms wall, "
          f"{cpu * 1000:.0f} ms CPU on the host (best of {args.repeat})")
    print(f"each fact on its own, slowest first (sum {sum(best.values()):.0f} ms):")
    for i, wall_ms in sorted(best.items(), key=lambda kv: -kv[1]):
        cls, kwargs_json = entries[i][:2]
        print(f"{wall_ms:>8.1f} ms  {cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}({kwargs_json[:40]})")
    return 0


# The children's CPU ticks of this shell (bash), fields 16 and 17 of /proc/PID/stat
_TICKS = "ct() { read -r -a a < /proc/$$/stat; echo $(( a[15] + a[16] )); }\n"
_SECTION = "b=$(ct); for r in $(seq {repeat}); do ( {text} ) >/dev/null 2>&1; done; echo \"{i} $(( $(ct) - b ))\"\n"


def sections(host, entries: list, repeat: int) -> int:
    """Print each section's host CPU per run, highest first (the script's own framing aside)."""
    script = factcache.prefetch_script(entries)
    names = [f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}({kwargs_json[:40]})"
             for cls, kwargs_json, *_ in script.single]
    names += [f"batch {name} ({len(keys)} keys)" for name, keys in script.batch_keys.items()]
    body = _TICKS + "".join(_SECTION.format(repeat=repeat, text=text, i=i) for i, text in enumerate(script._texts()))
    whole = shlex.quote(script.text())
    body += f"b=$(ct); for r in $(seq {repeat}); do sh -c {whole} >/dev/null 2>&1; done; echo \"whole $(( $(ct) - b ))\"\n"
    out = testhosts.ssh(host, "exec bash -s", input=body, timeout=900).stdout.split("\n")
    per_run = {key: int(ticks) * 10 / repeat for key, ticks in (line.split() for line in out if line.strip())}
    whole_ms = per_run.pop("whole")
    print(f"the prefetch script: {whole_ms:.1f} ms of host CPU a run ({repeat} runs); its {len(names)} sections "
          f"one by one, {sum(per_run.values()):.1f} ms in all:")
    for key, ms in sorted(per_run.items(), key=lambda kv: -kv[1]):
        print(f"{ms:>8.1f} ms  {names[int(key)]}")
    return 0


def _secs(text: str) -> float:
    """`times` prints e.g. 0m0.120s."""
    minutes, _, seconds = text.rstrip("s").partition("m")
    return int(minutes) * 60 + float(seconds)


if __name__ == "__main__":
    sys.exit(main())
