"""A local user reading every process's command line and environment while gpufleet runs.

`watching(host)` starts, as `student` (an ordinary local account of the test host), a loop that
reads /proc/*/cmdline and tries /proc/*/environ of every process as fast as it can, and keeps
every distinct text it got; when the block ends the loop stops and `Seen` holds what that user
could read. The watcher is never told what to look for: the test looks for the password in it.
"""
from __future__ import annotations

import contextlib
import shlex
import subprocess
from dataclasses import dataclass, field

from testing import testhosts

POLL = r"""
import os, sys, threading
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
seen, rounds = {"cmdline": set(), "environ": set()}, 0
while not stop.is_set():
    rounds += 1
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            for name in ("cmdline", "environ"):
                try:
                    with open(f"/proc/{pid}/{name}", "rb") as f:
                        seen[name].add(f.read())
                except OSError:
                    pass
out = sys.stdout.buffer
out.write(b"ROUNDS %d\n" % rounds)
for name, texts in seen.items():
    for text in texts:
        out.write(name.encode() + b" " + text.replace(b"\0", b" ").replace(b"\n", b"\\n") + b"\n")
"""


@dataclass
class Seen:
    rounds: int = 0
    cmdlines: list[str] = field(default_factory=list)
    environs: list[str] = field(default_factory=list)

    def holding(self, needle: str) -> list[str]:
        return [text for text in self.cmdlines + self.environs if needle in text]


@contextlib.contextmanager
def watching(host: testhosts.Host, user: str = testhosts.LOCAL_USER):
    seen = Seen()
    ssh = [*host.command_prefix(), "ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "-i", host.ssh_key, f"{user}@{host.address}",
           "python3 -c " + shlex.quote(POLL)]
    proc = subprocess.Popen(ssh, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield seen
    finally:
        out, err = proc.communicate(b"", timeout=120)   # stdin ends: the loop stops and reports
    lines = out.decode(errors="replace").splitlines()
    assert lines and lines[0].startswith("ROUNDS "), err.decode(errors="replace")
    seen.rounds = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, text = line.partition(" ")
        (seen.cmdlines if name == "cmdline" else seen.environs).append(text)
