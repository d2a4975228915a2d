"""One run at a time changes a host: a lock on the host, held by deploys/all.py and tools/rollout
while they change it.

The lock is `flock` on /run/lock/gpufleet/host.lock, held by a small shell process on the host
whose stdin is an SSH channel of the run's own connection. It lives exactly as long as the run:
the run ends (or is killed, or the network drops) -> sshd closes the channel -> the holder
reads end-of-file and exits -> the kernel drops the flock. A reboot clears /run. No lease to
renew, no command per operation.

Who holds it is written next to it (/run/lock/gpufleet/owner: controller, pid, command, since).
A holder told to release removes that record; one that ended without being told (its run was
killed, its controller crashed) leaves it behind, so the next run reports the stale lock it
took over.

deploys/all.py takes the lock at the host's first changing command (a no-op run sends nothing
more); tools/rollout takes it for all its hosts before it changes any and keeps it to the end
(its steps, each a pyinfra run of its own, see it as theirs). A second run waits up to
`rollout_lock_wait` seconds, then stops naming the holder.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand

from gpufleet.failures import stop_line
from gpufleet.hostcontext import host_context

LOCK_DIR = "/run/lock/gpufleet"
EXIT_HELD = 75

# $1: seconds to wait for another holder, $2: this run's owner record (one JSON line).
HOLD_SCRIPT = r"""
d=/run/lock/gpufleet
command -v flock >/dev/null 2>&1 || { echo "flock (util-linux) is not installed"; exit 70; }
umask 077
mkdir -p "$d" || exit 70
exec 9>>"$d/host.lock" || exit 70
if ! flock -w "$1" 9; then
  echo HELD
  cat "$d/owner" 2>/dev/null
  exit 75
fi
if [ -s "$d/owner" ]; then printf 'STALE '; head -c 4096 "$d/owner"; echo; fi
printf '%s\n' "$2" > "$d/owner.new" && mv -f "$d/owner.new" "$d/owner" || exit 70
echo LOCKED
IFS= read -r line
if [ "$line" = release ]; then rm -f "$d/owner"; fi
"""


class HostLocked(OSError):
    """Another run holds the host (an OSError: pyinfra fails the operation and the host with it).
    Its text is the reason, then the fix (also kept apart for gpufleet.failures' wording)."""

    def __init__(self, reason: str, fix: str = "re-run once the host answers over SSH"):
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


def owner_record(command: str | None = None) -> str:
    return json.dumps({"controller": socket.gethostname(), "pid": os.getpid(),
                       "command": command or " ".join(os.path.basename(a) if i == 0 else a
                                                      for i, a in enumerate(sys.argv)),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, sort_keys=True)


def describe(record: str) -> str:
    """'pid 123 on ctl (tools/rollout fleet.py) since 2026-...' from an owner record."""
    try:
        data = json.loads(record)
        return (f"pid {data.get('pid')} on {data.get('controller')} ({data.get('command')}) "
                f"since {data.get('since')}")
    except (ValueError, AttributeError):
        return record.strip() or "an unknown run"


def hold_command(wait: int, owner: str) -> str:
    return StringCommand("sh", "-c", QuoteString(HOLD_SCRIPT), "gpufleet-lock", QuoteString(str(int(wait))),
                         QuoteString(owner)).get_raw_value()


def lock_wait(host: Any) -> int:
    """Seconds a run waits for another run's lock on `host`: its rollout_lock_wait (0 when its
    settings cannot be read: planning has refused the host already)."""
    from gpufleet.settings import host_settings

    try:
        return int(host_settings(host).rollout_lock_wait)
    except Exception:
        return 0


@dataclass
class Lock:
    host: str
    channel: Any
    stale: str | None = None   # owner record of a run that ended without releasing
    shared: bool = True        # taken on the run's own pyinfra connection (else on a dedicated one)

    def alive(self) -> bool:
        try:
            transport = self.channel.get_transport()
            return (not self.channel.closed and not self.channel.exit_status_ready()
                    and transport is not None and transport.is_active())
        except Exception:
            return False

    def on(self, host: Any) -> bool:
        """Held, and (when taken on a run's connection) on the connection `host` uses now:
        after a reboot pyinfra reconnects, and the old channel's holder died with the boot."""
        if not self.alive():
            return False
        if not self.shared:
            return True
        client = getattr(host.connector, "client", None)
        return client is not None and client.get_transport() is self.channel.get_transport()

    def release(self) -> None:
        try:
            if self.alive():
                self.channel.sendall(b"release\n")
                self.channel.shutdown_write()
                deadline = time.monotonic() + 10
                while not self.channel.exit_status_ready() and time.monotonic() < deadline:
                    time.sleep(0.02)
            self.channel.close()
        except Exception:  # the connection is gone: so is the holder, and with it the lock
            pass


#: host name -> the lock this process holds on it
HELD: dict[str, Lock] = {}


def held(name: str) -> bool:
    lock = HELD.get(name)
    return lock is not None and lock.alive()


def acquire(host: Any, wait: int = 0, owner: str | None = None, shared: bool = True) -> Lock:
    """Take the host's lock on `host`'s SSH connection (pyinfra's paramiko client); raise
    HostLocked naming the holder when another run keeps it longer than `wait` seconds."""
    client = getattr(host.connector, "client", None)
    if client is None or client.get_transport() is None:
        raise HostLocked(f"{host.name}: no SSH connection to take the gpufleet lock on",
                         "run over SSH (pyinfra's ssh connector): the lock is taken over it")
    channel = client.get_transport().open_session()
    channel.exec_command(hold_command(wait, owner or owner_record()))
    out = channel.makefile("r")
    lines: list[str] = []
    for line in out:
        line = line.rstrip("\n")
        if line == "LOCKED":
            break
        lines.append(line)
    else:
        code = channel.recv_exit_status()
        channel.close()
        if code == EXIT_HELD and lines[:1] == ["HELD"]:
            raise HostLocked(f"{host.name} is locked by another gpufleet run: {describe(chr(10).join(lines[1:]))}",
                             "wait for it to finish (or set rollout_lock_wait), then re-run")
        raise HostLocked(f"{host.name}: could not take the gpufleet lock {LOCK_DIR}/host.lock "
                         f"(exit {code}): {' '.join(lines)[:300]}",
                         f"check {LOCK_DIR} on the host (a full /run, a foreign file there), then re-run")
    stale = next((ln[len("STALE "):] for ln in lines if ln.startswith("STALE ")), None)
    lock = Lock(host.name, channel, stale, shared)
    HELD[host.name] = lock
    return lock


def release(name: str) -> None:
    lock = HELD.pop(name, None)
    if lock is not None:
        lock.release()


def release_all() -> None:
    for name in list(HELD):
        release(name)


class FleetLocks:
    """tools/rollout: the locks of its hosts on connections of its own, for the whole rollout
    (its steps are separate pyinfra runs with connections that come and go)."""

    def __init__(self, inventory_path: str, owner: str):
        self.inventory_path = inventory_path
        self.owner = owner
        self.states: list[Any] = []

    def take(self, names: list[str], wait: int | None = None) -> tuple[dict[str, Lock], dict[str, str]]:
        """Lock `names` (those not held already), waiting `wait` seconds or each host's
        rollout_lock_wait for another run: (taken, refused {name: why})."""
        from pyinfra.api import State
        from pyinfra.api.connect import connect_all

        from gpufleet.inventory_source import load_inventory

        want = [n for n in names if not (HELD.get(n) and HELD[n].alive())]
        taken: dict[str, Lock] = {}
        refused: dict[str, str] = {}
        if not want:
            return taken, refused
        from gpufleet.inventory_source import config_of

        inventory = load_inventory(self.inventory_path)
        limit = [h for h in inventory if h.name in want]
        state = State(inventory, config_of(self.inventory_path), initial_limit=limit)
        connect_all(state)
        self.states.append(state)
        for h in limit:
            if h not in state.activated_hosts or getattr(h.connector, "client", None) is None:
                refused[h.name] = "could not connect to take the gpufleet lock"
                continue
            seconds = lock_wait(h) if wait is None else wait
            try:
                taken[h.name] = acquire(h, seconds, self.owner, shared=False)
            except HostLocked as exc:
                refused[h.name] = str(exc)
        return taken, refused

    def retake(self, names: list[str]) -> dict[str, str]:
        """After a reboot: the holders died with the boot; lock again (refused {name: why})."""
        for name in names:
            release(name)
        return self.take(names)[1]

    def close(self) -> None:
        from pyinfra.api.connect import disconnect_all

        release_all()
        for state in self.states:
            try:
                disconnect_all(state)
            except Exception:
                pass
        self.states = []


def stale_message(name: str, record: str) -> str:
    return (f"{name}: took over a stale gpufleet lock left by {describe(record)}: that run ended without "
            "releasing it (killed, or its controller lost the connection); check the host before trusting it")


# --- deploys/all.py: the lock at a host's first changing command ----------------------------------

_installed = False


def install() -> None:
    """Take a host's lock just before the first command of this run that changes it (facts
    never do): a no-op run sends nothing more. Called by deploys/all.py."""
    global _installed
    if _installed:
        return
    _installed = True
    from pyinfra import logger
    from pyinfra.api.host import Host

    from gpufleet import pyinfra_private

    original_run = Host.run_shell_command
    original_put = Host.put_file
    original_get_fact = pyinfra_private.fact_loader()
    original_disconnect = Host.disconnect

    def ensure(host: Host) -> None:
        context = host_context(host)
        if context.lock_in_fact or context.in_fact:
            return
        if host.executing_op_hash is None:
            return
        mine = HELD.get(host.name)
        if mine is not None and mine.on(host):
            return
        try:
            lock = acquire(host, lock_wait(host))
        except HostLocked as exc:
            # fails the command, so the operation and the host (an OSError to pyinfra), in
            # gpufleet.failures' words
            logger.error(stop_line(host.name, "failed", "rollout_lock_wait", exc.reason, exc.fix))
            raise
        if lock.stale:
            logger.warning(f"{host.print_prefix}gpufleet: {stale_message(host.name, lock.stale)}")

    def run_shell_command(self: Host, *args: Any, **kwargs: Any) -> Any:
        ensure(self)
        return original_run(self, *args, **kwargs)

    def put_file(self: Host, *args: Any, **kwargs: Any) -> Any:
        ensure(self)
        return original_put(self, *args, **kwargs)

    def _get_fact(state: Any, host: Host, *args: Any, **kwargs: Any) -> Any:
        context = host_context(host)
        context.lock_in_fact += 1
        try:
            return original_get_fact(state, host, *args, **kwargs)
        finally:
            context.lock_in_fact -= 1

    def disconnect(self: Host, *args: Any, **kwargs: Any) -> Any:
        # told to release while the connection is still there: the owner record goes with it
        lock = HELD.get(self.name)
        if lock is not None and lock.shared:
            release(self.name)
        return original_disconnect(self, *args, **kwargs)

    pyinfra_private.patch_for_locking(_get_fact, run_shell_command, put_file, disconnect)
