"""A local user reading every process's command line and environment while gpufleet runs.

`watching(host)` runs, as `student` (an ordinary local account of the test host), a loop that
reads /proc/*/cmdline and tries /proc/*/environ of every process as fast as it can, and prints
every distinct text it gets at once; a host that reboots under it (a rollout) is logged into
again as soon as its sshd answers. When the block ends the loop stops; `Seen` holds what that
user could read. The watcher is never told what to look for: the test looks for the password in
what it saw.
"""
from __future__ import annotations

import contextlib
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass, field

from testing import testhosts

POLL = r"""
import os, sys, threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seen, rounds, out = set(), 0, sys.stdout.buffer
while not stop.is_set():
    rounds += 1
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for name in (b"cmdline", b"environ"):
                try:
                    with open(b"/proc/" + pid.encode() + b"/" + name, "rb") as f:
                        text = name + b" " + f.read().replace(b"\0", b" ").replace(b"\n", b"\\n")
                except OSError:
                    continue
                if text not in seen:
                    seen.add(text)
                    out.write(text + b"\n")
                    out.flush()
out.write(b"ROUNDS %d\n" % rounds)
"""


@dataclass
class Seen:
    rounds: int = 0
    sessions: int = 0
    cmdlines: list[str] = field(default_factory=list)
    environs: list[str] = field(default_factory=list)

    def holding(self, needle: str) -> list[str]:
        return [text for text in self.cmdlines + self.environs if needle in text]

    def add(self, line: str) -> None:
        name, _, text = line.partition(" ")
        if name == "ROUNDS":
            self.rounds += int(text)
        else:
            (self.cmdlines if name == "cmdline" else self.environs).append(text)


@contextlib.contextmanager
def watching(host: testhosts.Host, user: str = testhosts.LOCAL_USER):
    seen = Seen()
    stop = threading.Event()
    ssh = [*host.command_prefix(), "ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=2",
           "-i", host.ssh_key, f"{user}@{host.address}", "python3 -c " + shlex.quote(POLL)]
    current: list[subprocess.Popen] = []
    started = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            proc = subprocess.Popen(ssh, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            current[:] = [proc]
            assert proc.stdout is not None
            for raw in proc.stdout:
                started.set()
                seen.add(raw.decode(errors="replace").rstrip("\n"))
            proc.wait()
            seen.sessions += 1
            if not stop.is_set():
                time.sleep(0.5)   # the host went away (a reboot): log in again once it is back

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert started.wait(60), f"{user} could not start watching {host.name}"
    try:
        yield seen
    finally:
        stop.set()
        with contextlib.suppress(OSError):
            current[0].stdin.close()   # the loop stops, reports its rounds, the session ends
        thread.join(120)
