#!/usr/bin/env python3
"""A fresh host's first converge by phase beside a plain `apt-get install`, then the no-op at latency.

    sudo .venv/bin/python bench/bootstrap.py [--delays 0,2,25] [--rounds 3] [--no-latency]
    # GPUFLEET_BENCH_POOL=NAME: a pool of one's own (default bench-bootstrap)

One run, two identical fresh test hosts (simulated 4 x A100, the signed stand-in repository):

1. Host A: deploys/all.py's first converge, timed per operation (bench/timed_pyinfra.py) and
   split into phases by the deploy each operation belongs to; the package operations are split
   again by the host's own /var/log/dpkg.log (the same clock: test hosts share the machine's)
   into download (apt's index and fetch: the operation's time outside dpkg) and unpack /
   configure (dpkg's), the DKMS packages' configure apart (simulated here: the stand-in packages
   build no module; on a real host this is minutes per kernel).
2. Host B: the same package set (the packages all.py installed on A, at A's versions, from A's
   apt sources, keys and pins, copied over) through plain `apt-get update`, `apt-get install
   --download-only` and `apt-get install`, timed from this machine over SSH.
3. Latency (unless --no-latency): host A behind a link with real delay (bench/delay_link.py: the
   kernel here has no netem), at each of --delays ms of round trip: all.py's no-op, plain
   pyinfra's 5-task no-op (bench/plain_noop.py) and the same 5 tasks in Ansible
   (bench/plain_noop.yml, where `ansible-playbook` is found: .venv-ansible/bin or PATH),
   --rounds times each, alternated; and one rollout batch (tools/rollout to the driver the
   host already has, batch of 1) at each delay.

Prints every figure with the load average (1 min) before and after it, and ends with one line
per delay: `no-op at D ms: all.py A s, plain pyinfra P s, ansible N s`. Needs root.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import measure  # noqa: E402  (bench/measure.py)
from delay_link import DelayLink  # noqa: E402
from testing import aptrepo, testhosts  # noqa: E402
from testing.inventory import TEST_DRIVER, environment_data, write_inventory  # noqa: E402

POOL = os.environ.get("GPUFLEET_BENCH_POOL", "bench-bootstrap")
TIMED = REPO / "bench" / "timed_pyinfra.py"
PYINFRA = REPO / ".venv" / "bin" / "pyinfra"
COMMAND_RE = re.compile(r"Running command on (\S+?):")
# The deploy an operation belongs to (pyinfra prefixes its name with the @deploy's) -> phase;
# holds first: an operation that only holds packages is a phase of its own wherever it is
PHASES = [("holds", r"\| Hold "), ("first install (every package, one transaction)", r"^First install"),
          ("preflight", r"^Preflight|^GPU host preflight"), ("package cache", r"^Package cache"),
          ("base", r"^Base system"), ("driver (DKMS inside)", r"^NVIDIA driver|^Driver stack"), ("docker", r"^Docker"),
          ("tuning", r"^GPU persistence|^Tuning"), ("pytorch", r"PyTorch"), ("storage", r"^Local NVMe|^Storage"),
          ("monitoring", r"^Prometheus|^Monitoring"), ("health watch", r"^Health watch"),
          ("hardening", r"^SSH hardening|^Hardening"), ("the gate (validate)", r"^Validate")]
APT_UPDATE = re.compile(r"apt-get update")


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def ssh(host: testhosts.Host, command: str, timeout: float = 1800) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    r = testhosts.ssh(host, command, check=False, timeout=timeout)
    if r.returncode:
        sys.stderr.write(f"{host.name}: {command[:120]} -> {r.returncode}\n{r.stdout[-1500:]}{r.stderr[-1500:]}\n")
    return time.monotonic() - t0, r


def pyinfra(inventory: Path, deploy: str, timings: Path | None = None, debug: bool = False) -> dict:
    cmd = ([sys.executable, str(TIMED), str(timings)] if timings else [str(PYINFRA)])
    cmd += ["-y", *(["--debug"] if debug else []), str(inventory), deploy]
    before = load()
    text, rc, wall, rusage = measure.run_captured(cmd)
    if rc:
        sys.stderr.write(text[-4000:])
    return {"rc": rc, "wall_s": wall, "cpu_s": rusage.ru_utime + rusage.ru_stime, "load": f"{before}->{load()}",
            "commands": len(COMMAND_RE.findall(text)), "text": text}


def dpkg_times(host: testhosts.Host, since: float) -> list[tuple[float, str]]:
    """(epoch seconds, line) of the host's dpkg.log from `since` on."""
    out = []
    for line in (host.root / "var/log/dpkg.log").read_text().splitlines():
        try:
            t = datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").timestamp()
        except ValueError:
            continue
        if t >= since - 1:
            out.append((t, line[20:]))
    return out


def phases(timings: dict, t0_epoch: float, dpkg: list[tuple[float, str]]) -> tuple[list, dict]:
    """Per phase: wall seconds, of which dpkg (unpack/configure, from the host's dpkg.log) and
    the rest of package operations (apt's index, resolution and download); DKMS apart."""
    ops = sorted((o for o in timings.get("ops", {}).values() if "end" in o), key=lambda o: o["start"])
    rows: dict[str, dict[str, float]] = {}
    split = {"dkms_s": 0.0, "package_ops": 0}
    for o in ops:
        name = " / ".join(o["names"])
        phase = next((p for p, rx in PHASES if re.search(rx, name)), "other")
        dur = o["end"] - o["start"]
        row = rows.setdefault(phase, {"wall": 0.0, "dpkg": 0.0, "apt": 0.0, "ops": 0})
        row["wall"] += dur
        row["ops"] += 1
        lo, hi = t0_epoch + o["start"], t0_epoch + o["end"]
        inside = [(t, line) for t, line in dpkg if lo - 1 <= t <= hi + 1]
        if inside:
            split["package_ops"] += 1
            span = min(dur, inside[-1][0] - inside[0][0] + 1)  # dpkg.log counts whole seconds
            split["dkms_s"] += _dkms_configure(inside)
            row["dpkg"] += span
            row["apt"] += dur - span
    outside = timings.get("exit", 0) - sum(o["end"] - o["start"] for o in ops)
    order = [p for p, _ in PHASES] + ["other"]
    table = [(p, rows[p]) for p in order if p in rows]
    table.append(("outside operations (start-up, facts, planning)", {"wall": outside, "dpkg": 0, "apt": 0, "ops": 0}))
    return table, split


def _dkms_configure(lines: list[tuple[float, str]]) -> float:
    total, start = 0.0, None
    for t, line in lines:
        if re.search(r"status half-configured \S*-dkms:", line):
            start = t
        elif start is not None and re.search(r"status installed \S*-dkms:", line):
            total, start = total + t - start, None
    return total


def installed_by(host: testhosts.Host, fresh: testhosts.Host) -> list[str]:
    """pkg=version of every package the converge installed on `host` (dependencies included) that
    the identical fresh host has not: the same set, installed without recommends as all.py does."""
    cmd = "dpkg-query -W -f '${db:Status-Abbrev} ${Package}=${Version}\\n' | awk '$1 == \"ii\" {print $2}' | sort"
    a = set(ssh(host, cmd)[1].stdout.split())
    b = set(ssh(fresh, cmd)[1].stdout.split())
    return sorted(a - b)


def copy_apt_sources(src: testhosts.Host, dst: testhosts.Host) -> None:
    """A's apt sources, keys and pins (what all.py wrote there) onto B, from this machine."""
    for rel in ("etc/apt/sources.list.d", "etc/apt/preferences.d", "etc/apt/keyrings", "usr/share/keyrings",
                "etc/apt/trusted.gpg.d", "etc/apt/apt.conf.d"):
        s, d = src.root / rel, dst.root / rel
        if s.is_dir():
            shutil.copytree(s, d, dirs_exist_ok=True, symlinks=True)


def first_converge(a: testhosts.Host, b: testhosts.Host, inv: Path, work: Path) -> dict:
    print(f"== first converge of deploys/all.py on {a.name} (load {load()})", flush=True)
    t0_epoch = time.time()
    r = pyinfra(inv, "deploys/all.py", timings=work / "timings.json", debug=True)
    if r["rc"]:
        raise SystemExit("first converge failed")
    timings = json.loads((work / "timings.json").read_text())
    table, split = phases(timings, t0_epoch, dpkg_times(a, t0_epoch))
    ops = sorted((o for o in timings["ops"].values() if "end" in o), key=lambda o: o["start"] - o["end"])
    updates = len(re.findall(r"Running command on \S+?:.*apt-get update", r["text"]))
    installs = len(re.findall(r"Running command on \S+?:.*apt-get .*install ", r["text"]))
    print(f"all.py first converge: {r['wall_s']:.1f} s wall, {r['commands']} commands, {updates} running "
          f"`apt-get update`, {installs} `apt-get install`; load {r['load']}")
    print(f"  {'phase':<48}{'wall s':>8}{'ops':>5}{'dpkg s':>8}{'apt s':>8}   (dpkg: unpack/configure; apt: index, resolve, download)")
    for phase, row in table:
        print(f"  {phase:<48}{row['wall']:>8.1f}{row['ops']:>5}{row['dpkg']:>8.1f}{row['apt']:>8.1f}")
    tot = {k: sum(row[k] for _, row in table) for k in ("dpkg", "apt")}
    print(f"  package operations with dpkg activity: {split['package_ops']}; dpkg {tot['dpkg']:.1f} s, apt "
          f"{tot['apt']:.1f} s; DKMS configure {split['dkms_s']:.1f} s (simulated: the stand-in builds no module)")
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "bootstrap-converge.json").write_text(json.dumps(
        {"t0_epoch": t0_epoch, "timings": timings, "dpkg": dpkg_times(a, t0_epoch), "wall_s": r["wall_s"]}))
    (REPO / "bench" / "results" / "bootstrap-converge.log").write_text(r["text"])
    print("  slowest operations:")
    for o in ops[:12]:
        print(f"    {o['end'] - o['start']:>7.1f} s  {' / '.join(o['names'])}")

    packages = installed_by(a, b)
    copy_apt_sources(a, b)
    print(f"== the same {len(packages)} packages through plain apt-get on {b.name} (load {load()})", flush=True)
    env = "DEBIAN_FRONTEND=noninteractive "
    pk = " ".join(shlex.quote(p) for p in packages)
    plain = {}
    for step, cmd in (("apt-get update", env + "apt-get update -q"),
                      ("download (--download-only)", env + "apt-get install -y -q --no-install-recommends --download-only " + pk),
                      ("unpack/configure (install)", env + "apt-get install -y -q --no-install-recommends " + pk)):
        before = load()
        secs, res = ssh(b, cmd)
        plain[step] = secs
        print(f"  {step:<32}{secs:>8.1f} s  rc {res.returncode}  load {before}->{load()}", flush=True)
    total = sum(plain.values())
    print(f"first converge: all.py {r['wall_s']:.1f} s, plain apt-get {total:.1f} s "
          f"({r['wall_s'] / total:.2f}x), {len(packages)} packages")
    return {"all_s": r["wall_s"], "plain_s": total, "phases": table, "split": split, "plain": plain,
            "packages": packages}


ANSIBLE = [REPO / ".venv-ansible" / "bin" / "ansible-playbook", shutil.which("ansible-playbook")]


def latency(a: testhosts.Host, data: dict, work: Path, delays: list[float], rounds: int) -> list[str]:
    ansible = next((str(p) for p in ANSIBLE if p and Path(p).exists()), None)
    listen = a.address.rsplit(".", 1)[0] + ".250"
    summary = []
    with DelayLink(listen, (a.address, 22), 0) as link:
        via = {"ssh_hostname": listen, "ssh_port": link.port}
        inv_all = write_inventory(work / "lat_all.py", [a], data={a.name: {**data, **via}})
        inv_plain = write_inventory(work / "lat_plain.py", [a], data={a.name: via})
        inv_ans = work / "lat_ansible.ini"
        inv_ans.write_text(f"{a.name} ansible_host={listen} ansible_port={link.port} ansible_user=root "
                           f"ansible_ssh_private_key_file={a.ssh_key} ansible_python_interpreter=/usr/bin/python3 "
                           "ansible_ssh_common_args='-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null'\n")
        # each side's own first converge, not timed
        if pyinfra(inv_plain, "bench/plain_noop.py")["rc"]:
            raise SystemExit("plain pyinfra's converge failed")
        if ansible and ssh(a, "test -x /usr/bin/python3 || (apt-get install -y -q python3-minimal)")[1].returncode:
            ansible = None
        sides = {"all.py": lambda: pyinfra(inv_all, "deploys/all.py"),
                 "plain pyinfra": lambda: pyinfra(inv_plain, "bench/plain_noop.py")}
        if ansible:
            def run_ansible() -> dict:
                before = load()
                text, rc, wall, ru = measure.run_captured([ansible, "-i", str(inv_ans), "bench/plain_noop.yml"])
                if rc:
                    sys.stderr.write(text[-3000:])
                return {"rc": rc, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "load": f"{before}->{load()}",
                        "changed": re.findall(r"changed=(\d+)", text)}
            sides["ansible"] = run_ansible
            run_ansible()  # its converge
        else:
            print("ansible-playbook not found: the Ansible side is not run")
        rollout_inv = write_inventory(work / "lat_rollout.py", [a], data={a.name: {**data, **via}})
        for delay in delays:
            link.set_rtt(delay)
            walls: dict[str, list[float]] = {k: [] for k in sides}
            print(f"== no-op at {delay:g} ms round trip (load {load()})", flush=True)
            probe = []
            for _ in range(3):  # what the link costs one SSH login and one command: the delay is real
                t0 = time.monotonic()
                subprocess.run(["ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
                                "UserKnownHostsFile=/dev/null", "-i", a.ssh_key, "-p", str(link.port),
                                f"root@{listen}", "true"], check=False, timeout=60)
                probe.append(time.monotonic() - t0)
            print(f"  ssh login + `true` through the link: median {statistics.median(probe) * 1000:.0f} ms of 3")
            for i in range(rounds):
                for side, fn in sides.items():
                    r = fn()
                    walls[side].append(r["wall_s"])
                    print(f"  {side:<14} round {i + 1}: {r['wall_s']:6.2f} s  CPU {r['cpu_s']:5.2f} s  rc {r['rc']}  "
                          f"load {r['load']}", flush=True)
            before = load()
            t0 = time.monotonic()
            ro = subprocess.run([str(REPO / "tools/rollout"), str(rollout_inv), "-y", "--driver-version", TEST_DRIVER,
                                 "--batch-size", "1"], cwd=work, capture_output=True, text=True)
            ro_s = time.monotonic() - t0
            if ro.returncode:
                sys.stderr.write((ro.stdout + ro.stderr)[-2000:])
            print(f"  rollout batch (1 host, driver unchanged): {ro_s:.2f} s rc {ro.returncode} load {before}->{load()}")
            med = {k: statistics.median(v) for k, v in walls.items()}
            line = (f"no-op at {delay:g} ms: all.py {med['all.py']:.2f} s, plain pyinfra {med['plain pyinfra']:.2f} s "
                    f"(all.py / plain {med['all.py'] / med['plain pyinfra']:.2f})")
            if "ansible" in med:
                line += f", ansible {med['ansible']:.2f} s (all.py / ansible {med['all.py'] / med['ansible']:.2f})"
            summary.append(line + f"; rollout batch {ro_s:.1f} s")
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", default="0,2,25", help="round trips in ms")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-latency", action="store_true")
    ap.add_argument("--tier", default="research")
    args = ap.parse_args()
    print(f"load average at start: {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1/5/15 min; "
          "other work shares this machine)")
    testhosts.down(POOL)
    work = Path(tempfile.mkdtemp(prefix="gpufleet-bench-bootstrap-"))
    repo = None
    try:
        a, b = testhosts.up(2, gpu=f"a100x4@{TEST_DRIVER}", pool=POOL, ssh_user="root")
        repo = aptrepo.serve(work / "aptrepo")
        data = {**environment_data(a, args.tier, repo), "tier_mismatch": "warn"}
        inv = write_inventory(work / "inventory.py", [a], data={a.name: data})
        first = first_converge(a, b, inv, work)
        summary = [] if args.no_latency else latency(a, data, work, [float(d) for d in args.delays.split(",")],
                                                     args.rounds)
    finally:
        testhosts.down(POOL)
        if repo:
            repo.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"first converge: all.py {first['all_s']:.1f} s, plain apt-get {first['plain_s']:.1f} s "
          f"({first['all_s'] / first['plain_s']:.2f}x)")
    for line in summary:
        print(line)
    print(f"load average at end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/bootstrap.py needs root (test hosts)")
    sys.exit(main())
