"""Per-host rollout state on the controller (JSON), so a re-run resumes where the last one stopped.

One file per rollout (`--state`, default `.gpufleet/rollouts/<inventory>.json`), written
atomically after every step of every host. A host is:

    pending         not started (or nothing changed yet)
    busy            refused: GPU processes were running, at the drain or found right before the
                    package change, the reboot or the MIG change (not a failure; tried again next run)
    skipped         named with --skip on the last run
    in-progress     a step started and has not finished (the run was killed)
    failed          a step failed (message says which and why)
    reboot-pending  upgraded, but driver_reboot is `never`: reboot it by hand and re-run
    done            at the target version, validated and back in service

Resume rule: a finished host is never redone. Any other host starts again at `drain` (cheap and
idempotent: it also re-checks for GPU processes), skips `snapshot` when a snapshot of the same
rollout was already taken (a second one would record the half-upgraded state as "before"), and
re-runs every later step: each decides from the host's real state whether there is work left.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufleet.controller import controller_files
from gpufleet.printable import printable

STEPS = ("drain", "snapshot", "upgrade", "reboot", "mig", "tune", "validate", "accept", "undrain")
#: after these steps started, packages (or MIG partitions) may have changed: a failed host stays
#: out of service
CHANGING_STEPS = ("upgrade", "reboot", "mig", "tune", "validate", "accept")
FORMAT = 1


class StateError(RuntimeError):
    pass


class StateLocked(StateError):
    """Another tools/rollout holds this state file."""


class StateLock:
    """An exclusive fcntl lock on `<state>.lock` for the life of one tools/rollout (the kernel
    drops it when the process ends, however it ends). The holder is recorded in the file so that
    a second run can name it."""

    def __init__(self, state_path: Path):
        self.path = Path(state_path).with_name(Path(state_path).name + ".lock")
        self.fd: int | None = None

    def acquire(self, command: str = "") -> None:
        try:
            controller_files.ensure_dir(self.path.parent)
        except controller_files.UnsafePath as exc:
            raise StateError(str(exc)) from None
        try:   # never through a symbolic link, and only a file of ours (checked on the descriptor)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(f"{self.path}: a symbolic link, not tools/rollout's lock file: move it away "
                                 "and re-run") from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
            os.close(fd)
            raise StateError(f"{self.path}: not tools/rollout's lock file (another user's, writable by others, or "
                             "not a regular file): move it away and re-run")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = printable(os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown process")
            os.close(fd)
            raise StateLocked(f"{self.path.with_suffix('')} is in use by another tools/rollout ({holder}): "
                              "wait for it to finish, or stop it") from None
        owner = json.dumps({"controller": socket.gethostname(), "pid": os.getpid(), "command": command,
                            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner.encode() + b"\n", 0)
        self.fd = fd
        # a writer killed between its temporary file and the rename left it behind: only the
        # holder of this lock writes the state, so any such file is from a dead run
        state = self.path.with_suffix("")
        for leftover in state.parent.glob(f".{state.name}.*.tmp"):
            try:
                leftover.unlink()
            except OSError:
                pass

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            os.close(self.fd)   # closing drops the lock
            self.fd = None


@dataclass
class HostRecord:
    name: str
    status: str = "pending"
    batch: int | None = None
    message: str = ""
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)
    manifest: str | None = None       # controller copy of the manifest taken for this rollout
    from_version: str | None = None
    target: str | None = None         # the driver this host is rolled out to (resolved per host)
    stack: dict[str, str] | None = None  # the CUDA toolkit / cuDNN releases it is rolled out to

    def step_ok(self, step: str) -> bool:
        return bool(self.steps.get(step, {}).get("ok"))

    @property
    def changed(self) -> bool:
        """Did any package-changing step start on this host?"""
        return any(step in self.steps for step in CHANGING_STEPS)

    @property
    def unavailable(self) -> bool:
        """Out of service: drained and not given back (counts against max_unavailable)."""
        if self.status in ("reboot-pending", "in-progress"):
            return True
        if self.status == "busy" and self.step_ok("upgrade") and self.last_step() != "mig":
            return True   # upgraded, its reboot refused by a GPU job: drained until it reboots
        # busy at the mig step: the host was given back (its MIG change waits for the next run)
        return self.status == "failed" and self.changed

    def last_step(self) -> str | None:
        """The step that finished last (None: none has)."""
        done = [s for s in self.steps if self.steps[s].get("finished")]
        return max(done, key=lambda s: float(self.steps[s]["finished"]), default=None)

    def steps_to_run(self) -> list[str]:
        if self.status == "done":
            return []
        return [s for s in STEPS if not (s == "snapshot" and self.step_ok("snapshot"))]


def _releases(stack: dict[str, str] | None) -> str:
    return ", ".join(f"{p} {v}" for p, v in sorted((stack or {}).items())) or "none"


class RolloutState:
    def __init__(self, path: Path, target: str, inventory: str, hosts: dict[str, HostRecord] | None = None,
                 runs: list[dict[str, Any]] | None = None):
        self.path = Path(path)
        self.target = target
        self.inventory = inventory
        self.hosts = hosts or {}
        self.runs = runs or []

    # --- file --------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path, target: str, inventory: str) -> RolloutState:
        path = Path(path)
        if not os.path.lexists(path):
            return cls(path, target, inventory)
        try:
            data = json.loads(controller_files.read(path))   # ours, checked on the descriptor it is read from
        except controller_files.UnsafePath as exc:
            raise StateError(str(exc)) from None
        if data.get("format") != FORMAT:
            raise StateError(f"{path}: unknown state format {data.get('format')!r}")
        hosts = {name: HostRecord(name=name, **{k: v for k, v in rec.items() if k != "name"})
                 for name, rec in data.get("hosts", {}).items()}
        if data.get("target") != target:
            unfinished = sorted(n for n, rec in hosts.items() if rec.changed and rec.status != "done")
            if unfinished:
                raise StateError(
                    f"{path} records a rollout to {data.get('target')}, not {target}, that is not finished on "
                    f"{', '.join(unfinished)}: finish that one (or roll those hosts back), or give another --state file")
            hosts = {}   # that rollout is over: a new one starts (its runs stay in the history)
        return cls(path, target, data.get("inventory", inventory), hosts, data.get("runs", []))

    def save(self) -> None:
        data = {
            "format": FORMAT, "target": self.target, "inventory": self.inventory, "runs": self.runs,
            "hosts": {name: {k: v for k, v in vars(rec).items() if k != "name"} for name, rec in self.hosts.items()},
        }
        controller_files.write(self.path, json.dumps(data, indent=1, sort_keys=True) + "\n", durable=True)

    # --- hosts -------------------------------------------------------------------------------

    def host(self, name: str) -> HostRecord:
        if name not in self.hosts:
            self.hosts[name] = HostRecord(name)
        return self.hosts[name]

    def start(self, name: str, step: str) -> None:
        rec = self.host(name)
        rec.steps[step] = {"started": time.time(), "ok": None}
        rec.status, rec.message = "in-progress", f"{step} started"
        self.save()

    def finish(self, name: str, step: str, ok: bool, message: str = "", status: str | None = None) -> None:
        rec = self.host(name)
        entry = rec.steps.setdefault(step, {"started": time.time()})
        entry.update(finished=time.time(), ok=ok, message=message)
        entry["seconds"] = round(entry["finished"] - entry["started"], 2)
        if status:
            rec.status = status
        elif not ok:
            rec.status = "failed"
        rec.message = message or (f"{step} done" if ok else f"{step} failed")
        self.save()

    def mark(self, name: str, status: str, message: str = "") -> None:
        rec = self.host(name)
        rec.status, rec.message = status, message
        self.save()

    def retarget(self, name: str, target: str, stack: dict[str, str] | None = None) -> str | None:
        """Record `target` (and the CUDA toolkit / cuDNN releases `stack`) for the host; a host
        finished at another target starts afresh. Returns why not, when the host is half-way to
        another target (finish or roll back first)."""
        rec = self.host(name)
        if rec.target in (None, target) and (stack is None or rec.stack in (None, stack)):
            rec.target = target
            rec.stack = stack if stack is not None else rec.stack
            return None
        if rec.changed and rec.status != "done":
            if rec.target != target:
                return (f"{name} is half-way through a rollout to {rec.target} ({rec.status}: {rec.message}), "
                        f"the inventory now says {target}: finish that one (tools/rollout --driver-version "
                        f"{rec.target}) or roll the host back (tools/rollback) first")
            return (f"{name} is half-way through a rollout to CUDA/cuDNN {_releases(rec.stack)} ({rec.status}: "
                    f"{rec.message}), the inventory now says {_releases(stack)}: put the inventory back and "
                    "finish that one, or roll the host back (tools/rollback) first")
        self.hosts[name] = HostRecord(name, target=target, stack=stack)
        return None

    def done(self, name: str) -> bool:
        return name in self.hosts and self.hosts[name].status == "done"

    def unavailable(self) -> list[str]:
        return [n for n, rec in self.hosts.items() if rec.unavailable]

    def failed(self) -> list[str]:
        return [n for n, rec in self.hosts.items() if rec.status == "failed"]

    def summary(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for rec in self.hosts.values():
            counts[rec.status] = counts.get(rec.status, 0) + 1
        return counts
