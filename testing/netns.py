"""Private network namespaces for firewall tests: a place where nftables rules can really be loaded.

Test hosts share the controller's network and have no CAP_NET_ADMIN, so they cannot load
rules. Here a test makes two namespaces of its own, a *server* and a *client*, joined by a
veth pair with addresses that exist only inside them, loads a ruleset in the server, runs
listeners there (including a test host's own sshd, entered through the host's mount
namespace), and connects from the client. Nothing touches the controller's network: the
namespaces (and with them the veth pair) are deleted on exit, processes started inside
are killed. Test infrastructure, not production code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from testing.testhosts import Host, in_netns


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, **kw)


@dataclasses.dataclass
class NetnsPair:
    server: str
    client: str
    server_addr: str
    client_addr: str
    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)

    def exec(self, ns: str, cmd: list[str], check: bool = True, timeout: float = 30
             ) -> subprocess.CompletedProcess:
        return run(["ip", "netns", "exec", ns, *cmd], check=check, timeout=timeout)

    def spawn(self, ns: str, cmd: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def listen(self, ports: list[int]) -> subprocess.Popen:
        """TCP listeners on `ports` of the server address, accepting and closing forever."""
        code = (
            "import selectors,socket,sys\n"
            "sel=selectors.DefaultSelector()\n"
            f"for p in {list(ports)!r}:\n"
            "    s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"    s.bind(({self.server_addr!r},p)); s.listen(16); sel.register(s,selectors.EVENT_READ)\n"
            "print('listening',flush=True)\n"
            "while True:\n"
            "    for key,_ in sel.select():\n"
            "        c,_=key.fileobj.accept(); c.close()\n"
        )
        proc = self.spawn(self.server, ["python3", "-c", code])
        assert proc.stdout.readline().strip() == b"listening"
        return proc

    def tcp_open(self, port: int, timeout: float = 2.0) -> bool:
        """Can the client complete a TCP handshake with the server on `port`?"""
        code = (
            "import socket,sys\n"
            f"s=socket.socket(); s.settimeout({timeout})\n"
            f"try:\n    s.connect(({self.server_addr!r},{port})); print('open')\n"
            "except OSError as e:\n    print('closed', e)\n"
        )
        out = self.exec(self.client, ["python3", "-c", code], timeout=timeout + 10).stdout
        return out.startswith("open")

    def sshd_of(self, host: Host, port: int = 22) -> subprocess.Popen:
        """Run the test host's own sshd (its binary, configuration and keys, entered through
        its mount namespace) on the server address of this pair."""
        pid = container_pid(host)
        proc = self.spawn(self.server, [
            "nsenter", "-t", str(pid), "-m", "--", "/usr/sbin/sshd", "-D", "-e",
            "-o", f"ListenAddress={self.server_addr}:{port}", "-o", "PidFile=none",
        ])
        deadline = time.monotonic() + 10
        while not self.tcp_open(port, timeout=0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {host.name} did not start: {proc.stdout.read()!r}")
            time.sleep(0.2)
        return proc

    def ssh(self, host: Host, command: str = "true", timeout: float = 20) -> subprocess.CompletedProcess:
        """The OpenSSH client in the client namespace, logging in to the server address."""
        return self.exec(self.client, [
            "ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5", "-i", host.ssh_key,
            f"{host.ssh_user}@{self.server_addr}", command,
        ], check=False, timeout=timeout)


def _children(pid: int) -> list[int]:
    kids = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            status = (proc / "status").read_text()
            ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            if ppid == pid:
                kids.append(int(proc.name))
    return kids


def container_pid(host: Host) -> int:
    """Controller PID of the test host's PID 1: launcher -> systemd-nspawn -> systemd."""
    for nspawn in _children(host.pid or -1):
        for pid in _children(nspawn):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                    return pid
    raise RuntimeError(f"no systemd process found under the launcher of {host.name} ({host.pid})")


@contextlib.contextmanager
def netns_pair(tag: str, subnet: int = 77):
    """Two namespaces `gf-<tag>-srv` / `gf-<tag>-cli` joined by veth, 10.231.<subnet>.2 / .1."""
    server, client = f"gf-{tag}-srv", f"gf-{tag}-cli"
    veth_s, veth_c = f"gf{subnet}s", f"gf{subnet}c"
    pair = NetnsPair(server, client, f"10.231.{subnet}.2", f"10.231.{subnet}.1")
    for ns in (server, client):
        run(["ip", "netns", "del", ns], check=False)
    try:
        for ns in (server, client):
            run(["ip", "netns", "add", ns])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])
        # Created inside the server namespace, so it never appears in the controller's.
        run(["ip", "-n", server, "link", "add", veth_s, "type", "veth", "peer", "name", veth_c,
             "netns", client])
        run(["ip", "-n", server, "addr", "add", f"{pair.server_addr}/30", "dev", veth_s])
        run(["ip", "-n", client, "addr", "add", f"{pair.client_addr}/30", "dev", veth_c])
        run(["ip", "-n", server, "link", "set", veth_s, "up"])
        run(["ip", "-n", client, "link", "set", veth_c, "up"])
        yield pair
    finally:
        for proc in pair.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for ns in (server, client):
            run(["ip", "netns", "del", ns], check=False)


def netns_leftovers(tag: str) -> list[str]:
    names = run(["ip", "netns", "list"], check=False).stdout.split()
    return [n for n in names if n.startswith(f"gf-{tag}-")]


__all__ = ["NetnsPair", "netns_pair", "container_pid", "netns_leftovers", "host_tcp_open"]


def host_tcp_open(host: Host, port: int, timeout: float = 2.0, source: str | None = None) -> bool:
    """Can a private-network test host's client namespace complete a TCP handshake with the
    host on `port` (from `source`, one of that namespace's addresses, when given)? (False for a
    refused connection and for a dropped one.)"""
    with in_netns(host.netns):
        sock = socket.socket()
    sock.settimeout(timeout)
    try:
        if source is not None:
            sock.bind((source, 0))
        sock.connect((host.address, port))
        return True
    except OSError:
        return False
    finally:
        sock.close()
