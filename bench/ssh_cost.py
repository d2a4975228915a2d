#!/usr/bin/env python3
"""What each SSH connection costs the controller, for the arithmetic of docs/scale.md: what
bench/controller.py (no SSH) leaves out.

    sudo GPUFLEET_BENCH_POOL=h31 .venv/bin/python bench/ssh_cost.py [--connections 40]

Opens --connections SSH connections one after another to the one host of a kept fleet
(bench/fleet.py --hosts 1 --keep), as pyinfra's ssh connector does (paramiko, the host's key),
keeps them all open, and runs the fact cache's prefetch script for the host's fact plan on each
(the one command of a no-op). Prints per connection: the controller's CPU for the handshake
and login, for the prefetch command, its resident memory and file descriptors while open.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main() -> int:
    import paramiko

    from gpufleet.controller import factcache
    from pyinfra.api.command import StringCommand  # noqa: F401  (pyinfra's own import cost, as in a run)
    from testing import replay

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=40)
    args = ap.parse_args()
    pool = os.environ.get("GPUFLEET_BENCH_POOL", "bench-fleet")
    kept = Path("/var/lib/gpufleet-bench") / ("" if pool == "bench-fleet" else pool) / "fleet-1.json"
    (name, data), = runpy.run_path(json.loads(kept.read_text())["inventory"])["test_hosts"]
    recording = replay.load()
    entries = []
    for path, kwargs_json in (tuple(e) for e in recording["plan"]):
        template = factcache._entry_template(path, kwargs_json)
        if template and not getattr(template[0], "gpufleet_end_of_run", False):
            entries.append((template[0], kwargs_json, "{}", template[1], template[2]))
    script = factcache.prefetch_script(entries).text()

    clients, handshake_cpu, command_cpu, command_wall, out_bytes = [], [], [], [], []
    rss0, fds0 = rss_kib(), fds()
    t0 = time.monotonic()
    for _ in range(args.connections):
        c0 = time.process_time()
        client = paramiko.SSHClient()
        client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
        client.connect(data["ssh_hostname"], username=data["ssh_user"], key_filename=data["ssh_key"],
                       allow_agent=False, look_for_keys=False, timeout=10)
        handshake_cpu.append(time.process_time() - c0)
        clients.append(client)
    t_connect = time.monotonic() - t0
    rss1, fds1 = rss_kib(), fds()
    for client in clients:
        c0, w0 = time.process_time(), time.monotonic()
        _, stdout, _ = client.exec_command("sh -c " + __import__("shlex").quote(script))
        out = stdout.read()
        command_wall.append(time.monotonic() - w0)
        command_cpu.append(time.process_time() - c0)
        out_bytes.append(len(out))
    rss2 = rss_kib()
    for client in clients:
        client.close()
    n = args.connections
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"{n} connections to {name} (load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}):")
    print(f"  handshake + key login: {med(handshake_cpu) * 1000:.1f} ms controller CPU (median), "
          f"{t_connect / n * 1000:.1f} ms wall each, one after another")
    print(f"  prefetch command ({len(script)} bytes sent, {med(out_bytes)} bytes back): "
          f"{med(command_cpu) * 1000:.1f} ms controller CPU, {med(command_wall) * 1000:.0f} ms wall (median)")
    print(f"  while open: {(rss1 - rss0) / n:.0f} KiB RSS and {(fds1 - fds0) / n:.1f} file descriptors per connection; "
          f"after the command {(rss2 - rss0) / n:.0f} KiB")
    print(f"  RLIMIT_NOFILE here: {resource.getrlimit(resource.RLIMIT_NOFILE)}")
    return 0


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench/ssh_cost.py needs root (test hosts)")
    sys.exit(main())
