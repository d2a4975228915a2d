"""One run at a time changes a host: a lock on the host, held by deploys/all.py and tools/rollout
while they change it.

The lock is `flock` on /run/gpufleet-lock/host.lock, held by a small shell process on the host
whose stdin is an SSH channel of the run's own connection. It lives exactly as long as the run:
the run ends (or is killed, or the network drops) -> sshd closes the channel -> the holder
reads end-of-file and exits -> the kernel drops the flock. A reboot clears /run. No lease to
renew, no command per operation.

The holder runs as root (through sudo, as pyinfra runs commands, when the run logs in as a
sudo user: `_sudo`, `_sudo_password`), in a folder only root can enter: /run/gpufleet-lock, 0700,
made by root with mkdir in root's /run. A folder found there that is not exactly that (a
symlink, another owner, another mode) is refused by name, never used: the lock folder used to
be /run/lock/gpufleet, in world-writable /run/lock, where any local user could create it first
and have the run write its owner record through a planted symlink (issue 27). That old path
is neither used nor touched. Not /run/gpufleet: the clock records and the nftables revert
file live there, made 0755 by `mkdir -p` (at boot too), which the lock would have to refuse.

Who holds it is written next to it (/run/gpufleet-lock/owner: controller, pid, program, inventory,
since; written to a mktemp file in the folder, then renamed), never the command line's other
arguments (a `--data _sudo_password=...` would be one). A holder told to release removes that
record; one that ended without being told (its run was killed, its controller crashed) leaves
it behind, so the next run reports the stale lock it took over.

deploys/all.py takes the lock at the host's first changing command (a no-op run sends nothing
more), and only if no other run has held it since this run read the host's facts (the lock's
generation, read with the facts before planning: `planned_on`); otherwise it stops the host
before any change, so a second run started with the first never applies a plan made on
facts the first changed. There, before that command, it makes systemd reloads safe for running
GPU containers (gpufleet/controller/reload_guard.py; after a reboot too). tools/rollout takes it for all
its hosts before it changes any and keeps it to the end (its steps, each a pyinfra run of its
own, see it as theirs). A second run waits up to
`rollout_lock_wait` seconds, then stops naming the holder.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand

from gpufleet.controller import reload_guard
from gpufleet.config.failures import stop_line
from gpufleet.controller import askpass
from gpufleet.config.hostcontext import host_context
from gpufleet.controller.inventory_source import InventorySource
from gpufleet.printable import printable

LOCK_DIR = "/run/gpufleet-lock"
EXIT_HELD = 75
EXIT_UNSAFE = 73     # the lock folder is not root's own 0700 folder
EXIT_NOT_ROOT = 77   # the holder does not run as root
EXIT_MOVED = 76      # another run held the lock since this run read the host's facts

# $1: seconds to wait for another holder, $3: this run's owner record (one JSON line), $2: the
# generation this run planned on ("<boot id> <n>", facts/hostlock.py's LockGeneration), or empty
# (no plan to protect: tools/rollout locks before it reads anything). The generation counts
# takings and endings of the lock since boot: another run held it since the plan was made (it
# may have changed the host) -> refused before anything of this run is applied.
# Run as root. /run is root's and not writable by others (checked): nobody else can create,
# replace or rename /run/gpufleet-lock, and nobody else can enter it once it is 0700 and root's.
HOLD_SCRIPT = r"""
d=/run/gpufleet-lock
[ "$(id -u)" = 0 ] || { echo NOT-ROOT; exit 77; }
command -v flock >/dev/null 2>&1 || { echo "flock (util-linux) is not installed"; exit 70; }
umask 077
if [ "$(stat -c '%u' /run)" != 0 ] || [ -n "$(find /run -maxdepth 0 -perm /022)" ]; then
  echo "UNSAFE /run is not root's own folder: $(stat -c 'owner %U, mode %a' /run)"; exit 73
fi
[ -e "$d" ] || [ -L "$d" ] || mkdir -m 700 "$d" 2>/dev/null
if [ -L "$d" ] || [ ! -d "$d" ] || [ "$(stat -c '%u %a' "$d")" != "0 700" ]; then
  echo "UNSAFE $(stat -c '%F, owner %U, mode %a' "$d" 2>&1 | head -c 200)"; exit 73
fi
exec 9>>"$d/host.lock" || exit 70
if ! flock -w "$1" 9; then
  echo HELD
  head -c 4096 "$d/owner" 2>/dev/null | tr -d '\n'; echo
  exit 75
fi
boot=$(cat /proc/sys/kernel/random/boot_id)
bump() {
  g=$(cat "$d/generation" 2>/dev/null); case $g in ""|*[!0-9]*) g=0;; esac
  t=$(mktemp "$d/.generation.XXXXXX") || return 1
  echo $((g + 1)) > "$t" && mv -f "$t" "$d/generation" || { rm -f "$t"; return 1; }
}
g=$(cat "$d/generation" 2>/dev/null); case $g in ""|*[!0-9]*) g=0;; esac
if [ -n "$2" ] && [ "$2" != "$boot $g" ]; then echo "MOVED $boot $g"; exit 76; fi
bump || exit 70
if [ -s "$d/owner" ]; then printf 'STALE '; head -c 4096 "$d/owner" | tr -d '\n'; echo; fi
t=$(mktemp "$d/.owner.XXXXXX") || exit 70
printf '%s\n' "$3" > "$t" && mv -f "$t" "$d/owner" || { rm -f "$t"; exit 70; }
echo LOCKED
IFS= read -r line
if [ "$line" = release ]; then rm -f "$d/owner"; fi
bump
"""


class HostLocked(OSError):
    """Another run holds the host (an OSError: pyinfra fails the operation and the host with it).
    Its text is the reason, then the fix (also kept apart for gpufleet.config.failures' wording)."""

    def __init__(self, reason: str, fix: str = "re-run once the host answers over SSH"):
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


def owner_record(program: str | None = None, inventory: str | None = None) -> str:
    """Who holds the lock: controller, pid, program, inventory and since. Never the rest of the
    command line: its `--data` values may be secrets (a sudo password)."""
    if program is None:
        program, inventory = this_run()
    return json.dumps({"controller": socket.gethostname(), "pid": os.getpid(), "program": program,
                       "inventory": inventory or "",
                       "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, sort_keys=True)


_NAME = re.compile(r"[A-Za-z0-9_.,@:/+=-]{1,200}")


def this_run(argv: list[str] | None = None) -> tuple[str, str]:
    """(program, inventory) of this process's command line: `pyinfra` and its deploy files
    (only .py paths: an operation given on the command line carries its arguments), and the
    inventory when it looks like one (a path or host names). Nothing else is read from it."""
    argv = list(sys.argv if argv is None else argv)
    program = os.path.basename(argv[0]) if argv else "python"
    inventory = ""
    if program == "pyinfra":
        try:
            from gpufleet import pyinfra_private

            params = pyinfra_private.cli_params(argv[1:])
        except Exception:
            params = {}
        deploys = [op for op in params.get("operations") or () if isinstance(op, str) and op.endswith(".py")
                   and _NAME.fullmatch(op)]
        program = " ".join(["pyinfra", *deploys])
        found = params.get("inventory")
        inventory = found if isinstance(found, str) and _NAME.fullmatch(found) else ""
    return program if _NAME.fullmatch(program.replace(" ", "_")) else "python", inventory


def describe(record: str) -> str:
    """'pid 123 on ctl (tools/rollout fleet.py) since 2026-...' from an owner record, printable
    (it comes from a host)."""
    try:
        data = json.loads(record)
        what = data.get("command") or " ".join(str(data.get(k) or "") for k in ("program", "inventory")).strip()
        text = f"pid {data.get('pid')} on {data.get('controller')} ({what}) since {data.get('since')}"
    except (ValueError, AttributeError):
        text = record.strip() or "an unknown run"
    return printable(text)


def hold_command(wait: int, owner: str, planned_on: str = "") -> StringCommand:
    return StringCommand("sh", "-c", QuoteString(HOLD_SCRIPT), "gpufleet-lock", QuoteString(str(int(wait))),
                         QuoteString(planned_on), QuoteString(owner))


def lock_wait(host: Any) -> int:
    """Seconds a run waits for another run's lock on `host`: its rollout_lock_wait (0 when its
    settings cannot be read: planning has refused the host already)."""
    from gpufleet.config.settings import host_settings

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


def acquire(host: Any, wait: int = 0, owner: str | None = None, shared: bool = True, planned_on: str = "") -> Lock:
    """Take the host's lock on `host`'s SSH connection (pyinfra's paramiko client), as root
    (through sudo when the host's data says so); raise HostLocked naming the holder when another
    run keeps it longer than `wait` seconds, the folder when it is not root's own, or, given the
    generation this run planned on (`planned_on`), when another run held the lock since."""
    from gpufleet import pyinfra_private

    client = getattr(host.connector, "client", None)
    if client is None or client.get_transport() is None:
        raise HostLocked(f"{host.name}: no SSH connection to take the gpufleet lock on",
                         "run over SSH (pyinfra's ssh connector): the lock is taken over it")
    context = host_context(host)
    context.lock_in_fact += 1   # pyinfra may run a command to set sudo's askpass up: not a change
    try:
        text = pyinfra_private.root_command(host, hold_command(wait, owner or owner_record(), planned_on))
    finally:
        context.lock_in_fact -= 1
    channel = client.get_transport().open_session()
    channel.exec_command(text)
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
        if code == EXIT_MOVED and lines[:1] and lines[0].startswith("MOVED "):
            raise HostLocked(f"{host.name}: another gpufleet run held its lock after this run read the host's facts "
                             "(it may have changed what this run planned on); nothing of this run's plan was applied",
                             "re-run: it plans on the host as it is now")
        if code == EXIT_UNSAFE and lines[:1] and lines[0].startswith("UNSAFE "):
            raise HostLocked(f"{host.name}: refused the gpufleet lock folder {LOCK_DIR}: not root's own 0700 folder "
                             f"({printable(lines[0][len('UNSAFE '):])[:300]}); another user may have made it",
                             f"find out who made {LOCK_DIR}, remove it as root (a reboot clears /run too), then "
                             "re-run: gpufleet creates it root-only")
        if code == EXIT_NOT_ROOT and lines[:1] == ["NOT-ROOT"]:
            raise HostLocked(f"{host.name}: the gpufleet lock is taken as root, and this run logs in as "
                             f"{host.data.get('ssh_user') or 'a user'} without sudo",
                             "log in as root, or set _sudo: True (and _sudo_password if sudo asks for one)")
        raise HostLocked(f"{host.name}: could not take the gpufleet lock {LOCK_DIR}/host.lock "
                         f"(exit {code}): {printable(' '.join(lines))[:300]}",
                         f"check {LOCK_DIR} and sudo on the host (a full /run, sudo asking for a password), then re-run")
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

    def __init__(self, inventory_path: str | InventorySource, owner: str):
        self.inventory_path = inventory_path
        self.owner = owner
        self.states: list[Any] = []

    def take(self, names: list[str], wait: int | None = None) -> tuple[dict[str, Lock], dict[str, str]]:
        """Lock `names` (those not held already), waiting `wait` seconds or each host's
        rollout_lock_wait for another run: (taken, refused {name: why})."""
        from pyinfra.api import State
        from pyinfra.api.connect import connect_all

        from gpufleet.controller.inventory_source import load_inventory

        want = [n for n in names if not (HELD.get(n) and HELD[n].alive())]
        taken: dict[str, Lock] = {}
        refused: dict[str, str] = {}
        if not want:
            return taken, refused
        from gpufleet.controller.inventory_source import config_of

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

def plan_on(host: Any) -> None:
    """Read the lock's generation with the facts this run plans on (before any deploy asks
    one): the lock, taken at the first change, is refused if another run held it since."""
    from gpufleet.facts.hostlock import LockGeneration

    host_context(host).lock_generation = host.get_fact(LockGeneration)


_installed = False


def install() -> None:
    """Take a host's lock just before the first command of this run that changes it (facts
    never do): a no-op run sends nothing more. Called by deploys/all.py."""
    global _installed
    if _installed:
        return
    _installed = True
    askpass.install()  # sudo's password through a private file on the host, never a command line
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
        if mine is None or not mine.on(host):
            # a lock this process held on the host before (it died with a reboot, or
            # tools/rollout's own): the count moved with this run's takings, not another run's
            planned_on = context.lock_generation if mine is None else ""
            try:
                lock = acquire(host, lock_wait(host), planned_on=planned_on)
            except HostLocked as exc:
                # fails the command, so the operation and the host (an OSError to pyinfra), in
                # gpufleet.config.failures' words
                logger.error(stop_line(host.name, "failed", "rollout_lock_wait", exc.reason, exc.fix))
                raise
            # from now on the generation moves with this run's own takings (after a reboot the
            # holder died with the boot and is taken again): not another run's
            context.lock_generation = ""
            if lock.stale:
                logger.warning(f"{host.print_prefix}gpufleet: {stale_message(host.name, lock.stale)}")
        # Before the first change (and after a reboot): any command of the run may reload
        # systemd (a package's postinst, `systemctl enable`), which must not cut a running
        # GPU container off its devices. Once per connection; nothing on later commands.
        try:
            reload_guard.hold(host)
        except reload_guard.ReloadUnsafe as exc:
            logger.error(stop_line(host.name, "failed", "GPU containers", exc.reason, exc.fix))
            raise

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
