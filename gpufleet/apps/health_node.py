"""gpufleet-health-watch: the health watch on the node itself, as root, without the controller
(deploys/health_watch.py installs it with the modules it needs; the rules are
gpufleet/plans/health_watch.py's, the classes tools/health's).

    gpufleet-health-watch            Slurm's HealthCheckProgram: check, record, act, one line out
    gpufleet-health-watch --timer    the systemd timer's run: the same
    gpufleet-health-watch --prolog   Slurm's Prolog: check and record only; exit 1 at class drain or worse
    gpufleet-health-watch --history  print the journal

Exit 0 when nothing needs action, 1 when something does (or, --prolog, at drain or worse), 2 when
the watch cannot run (its folder or config is not what the deploy made).
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from typing import Any

from gpufleet.facts._common import FactParseError
from gpufleet.facts.health import GpuHealth, GpuHealthData, bus_key
from gpufleet.facts.network import IbCounters, IbPortCounters
from gpufleet.facts.slurm import SlurmNode, SlurmNodeData
from gpufleet.plans import health_watch as w
from gpufleet.plans.health import assess, health_rules, summary_line

#: the reset script the deploy puts in the zip (plans/health_watch.py reset_script), read through
#: the import system: the modules run from the zip, not from files
RESET_SCRIPT = "data/health-reset.sh"


class WatchError(Exception):
    pass


def _private_dir(path: str) -> None:
    """The watch's folder: made root's 0700 when missing; anything else there (a link, another
    owner, another mode) is refused, never used."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or stat.S_IMODE(st.st_mode) != 0o700:
        raise WatchError(f"{path} is not a folder of root's with mode 0700: refused")


def _open(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _read(path: str) -> list[str]:
    try:
        fd = _open(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def _append(path: str, lines: list[str]) -> None:
    """Append-only: O_APPEND, never rewritten; 0600, not through a link."""
    if not lines:
        return
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))


def _replace(folder: str, name: str, text: str, mode: int = 0o600) -> None:
    """Write name in folder through a new file renamed over it (never half-written, never a link)."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, os.path.join(folder, name))


def _sh(command: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", "-c", command, "gpufleet-health", *args], capture_output=True, text=True,
                          check=False, timeout=600)


def _boot() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "none"


@contextmanager
def _host_lock() -> Iterator[bool]:
    """True while this run holds the host lock of all.py / tools/rollout (taken without waiting:
    False when a gpufleet run holds it, then nothing acts). No lock folder: no run since boot."""
    folder = os.path.dirname(w.HOST_LOCK)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        yield True
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        yield False   # not the folder hostlock.py makes: act on nothing rather than guess
        return
    try:
        fd = os.open(w.HOST_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def read_health() -> GpuHealthData:
    return GpuHealth().process(_sh(GpuHealth().command()).stdout.splitlines())


def read_dcgm_health() -> list[tuple[str, str, str, str, str]]:
    """DCGM's health watches, where DCGM is installed: set on every system (`dcgmi health -s a`:
    the same again each run, so a restarted host engine gets them back), then their incidents
    since (`dcgmi health -c -j`). No dcgmi, no host engine: none."""
    if not shutil.which("dcgmi"):
        return []
    if _sh("dcgmi health -s a >/dev/null 2>&1").returncode != 0:
        return []
    done = _sh("dcgmi health -c -j 2>/dev/null")
    return w.parse_dcgm_health(done.stdout) if done.returncode == 0 else []


#: a test double's sysfs-shaped tree instead of /sys (set only in the root process's own
#: environment: the timer's unit and slurmd set none)
TEST_SYSFS_ROOT = "GPUFLEET_TEST_SYSFS_ROOT"


def read_ib() -> list[IbPortCounters] | None:
    """The InfiniBand/RoCE ports (none on a host without RDMA devices); None when unreadable."""
    fact = IbCounters()
    done = _sh(fact.command(sys_root=os.environ.get(TEST_SYSFS_ROOT) or "/sys"))
    try:
        return fact.process(done.stdout.splitlines()) if done.returncode == 0 else None
    except FactParseError:
        return None


def read_slurm(node: str) -> SlurmNodeData:
    return SlurmNode().process(_sh(SlurmNode().command(node=node)).stdout.splitlines())


def _scontrol(node: SlurmNodeData, *words: str) -> tuple[bool, str]:
    assert node.scontrol
    done = subprocess.run([node.scontrol, *words], capture_output=True, text=True, check=False, timeout=120)
    return done.returncode == 0, (done.stderr or done.stdout).strip()[:300]


def run(config: dict[str, Any], mode: str) -> int:
    plan = w.WatchPlan(enabled=True, interval=int(config["interval"]), action=str(config["action"]),
                       escalate_count=int(config["escalate_count"]), escalate_window=int(config["escalate_window"]),
                       escalate_to=str(config["escalate_to"]), slurm_check=False, slurm_interval=0,
                       slurm_node_states=(), slurm_prolog=False, dcgm_watches=bool(config["dcgm_watches"]),
                       textfile_dir=str(config["textfile_dir"]), nvlink=str(config["nvlink"]),
                       slurm_node=str(config["slurm_node"]))
    now, boot = time.time(), _boot()
    data = read_health()
    verdict = assess(data, nvlink=plan.nvlink)
    if plan.dcgm_watches and data.status == "ok":
        verdict = w.with_dcgm(verdict, read_dcgm_health(), health_rules())
    state = json.loads("\n".join(_read(w.STATE)) or "{}")
    verdict, ib_memory = w.with_ib(verdict, read_ib(), state.get("ib") or {}, health_rules())
    journal = w.parse_journal(_read(w.JOURNAL))
    needs = w.escalated(verdict, journal, now, plan)
    events: list[w.Event] = []

    def record(gpu: int | None, bus: str, check: str, cls: str, action: str, reason: str, detail: str = "") -> None:
        events.append(w.Event(now, boot, gpu, bus, check, cls, action, reason, detail))

    # what was seen: findings new since the last run, and those gone (the journal is not a log of every run)
    escalated = {(n.bus_id, n.check): n for n in needs}
    # keyed with the class after escalation: a finding that escalates is news for the journal
    seen = {f"{g.bus_id if g else ''}|{f.check}|{_cls(escalated, g, f)}": (g, f) for g, f in _findings(verdict)}
    before = set(state.get("seen", []))
    for key in sorted(set(seen) - before):
        g, f = seen[key]
        n = escalated.get((g.bus_id if g else "", f.check))
        record(g.index if g else None, g.bus_id if g else "", f.check, n.cls if n else f.cls, "seen",
               "found by the watch", n.detail if n else f.detail)
    still = {key.rpartition("|")[0] for key in seen}
    for key in sorted(before - set(seen)):
        bus, check = key.split("|")[:2]
        if f"{bus}|{check}" not in still:   # gone, not only of another class now
            record(None, bus, check, "ok", "cleared", "no longer found")

    node = read_slurm(plan.slurm_node) if mode != "prolog" else None
    with _host_lock() as free:   # a look only: released at once, so that a run starting now is not stopped
        pass
    steps = [] if mode == "prolog" else w.plan_steps(needs, plan.action, node, held_by_run=not free)
    if any(step.kind != "none" for step in steps):
        with _host_lock() as free:   # held while acting: a rollout starting then waits or stops
            if not free:
                steps = [w.Step("none", why="a gpufleet run (all.py, tools/rollout) holds the host: nothing acts")]
            for step in steps:
                _act_logged(step, needs, node, plan, record, boot)
    else:
        for step in steps:
            _act_logged(step, needs, node, plan, record, boot)
    _append(w.JOURNAL, [e.as_json() for e in events])
    if events:
        last = events[-1]
        _replace(w.WATCH_DIR, "last-event", f"event {last.time:.3f} {last.cls} {last.action}\n")
    _replace(w.WATCH_DIR, "state.json", json.dumps({"seen": sorted(seen), "time": now, "ib": ib_memory}) + "\n")
    _metrics(plan, verdict, needs, journal + events, now, data.status == "ok")
    top = w.worst(needs)
    print(summary_line(verdict) if top == verdict.worst else f"{top}: {needs[0].detail}")
    if mode == "prolog":
        return 1 if w.rank(top) >= w.rank("drain") else 0
    return 1 if needs else 0


def _cls(escalated: dict[tuple[str, str], w.Need], gpu: Any, finding: Any) -> str:
    need = escalated.get((gpu.bus_id if gpu else "", finding.check))
    return need.cls if need else str(finding.cls)


def _findings(verdict: Any) -> Iterator[tuple[Any, Any]]:
    yield from ((None, f) for f in verdict.host_findings if w.rank(f.cls) >= w.rank("monitor"))
    for g in verdict.gpus:
        yield from ((g, f) for f in g.findings)


def _act_logged(step: w.Step, needs: list[w.Need], node: SlurmNodeData | None, plan: w.WatchPlan, record: Any,
                boot: str) -> None:
    """An action that fails in an unforeseen way is recorded as failed; what was seen is kept."""
    try:
        _act(step, needs, node, plan, record, boot)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        record(step.gpu, "", step.kind, "ok", "failed", f"{step.kind} failed: {type(exc).__name__}: {exc}"[:300])


def _act(step: w.Step, needs: list[w.Need], node: SlurmNodeData | None, plan: w.WatchPlan, record: Any,
         boot: str) -> None:
    top = needs[0] if needs else None
    cls, check = (top.cls, top.check) if top else ("ok", "")
    bus = top.bus_id if top else ""
    gpu = top.gpu.index if top and top.gpu else None
    if step.kind == "none":
        record(gpu, bus, check, cls, "held" if "holds the host" in step.why else "kept", step.why)
    elif step.kind == "reset":
        need = next(n for n in needs if n.gpu is not None and n.gpu.index == step.gpu)
        assert need.gpu is not None
        done = _sh(resources.files("gpufleet").joinpath(RESET_SCRIPT).read_text(encoding="utf-8"), str(step.gpu))
        if done.returncode == 0:
            _append(w.RESETS, [f"reset {bus_key(need.gpu.bus_id)} {boot} {time.clock_gettime(time.CLOCK_MONOTONIC):.6f}"])
            record(step.gpu, need.gpu.bus_id, need.check, "reset", "reset", "the GPU was idle: reset (nvidia-smi -r)",
                   need.detail)
            return
        said = (done.stderr or done.stdout).strip().replace("\n", " ")[:300]
        if done.returncode != 75:
            record(step.gpu, need.gpu.bus_id, need.check, "reset", "failed", f"nvidia-smi -r failed: {said}", need.detail)
            return
        record(step.gpu, need.gpu.bus_id, need.check, "reset", "busy", f"not reset, the GPU is in use: {said}",
               need.detail)
        if node is not None and node.scontrol and not node.error and not node.drain_set:
            reason = w.reason_of(needs)[:200] + "; reset waits for the GPU to be idle"
            ok, out = _scontrol(node, "update", f"NodeName={node.node}", "State=DRAIN", f"Reason={reason}")
            record(step.gpu, need.gpu.bus_id, need.check, "reset", "drain" if ok else "failed",
                   f"drained until the reset: {reason}" if ok else f"could not drain: {out}")
    elif step.kind in ("drain", "resume", "reboot") and node is not None:
        reason = w.reason_of(needs) if needs else ""
        words = {"drain": ["update", f"NodeName={node.node}", "State=DRAIN", f"Reason={reason}"],
                 "resume": ["update", f"NodeName={node.node}", "State=RESUME"],
                 "reboot": ["reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", node.node]}[step.kind]
        ok, out = _scontrol(node, *words)
        record(gpu, bus, check, cls if step.kind != "resume" else "ok", step.kind if ok else "failed",
               (reason or "healthy again: resumed") if ok else f"scontrol {step.kind} failed: {out}")


def _metrics(plan: w.WatchPlan, verdict: Any, needs: list[w.Need], journal: list[w.Event], now: float,
             ok: bool) -> None:
    """The node exporter's textfile collector reads *.prom in its folder: written only when that
    folder exists (the node exporter installed), renamed in whole, readable by the exporter."""
    folder = plan.textfile_dir
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o002:
        return  # a link or a world-writable folder: not written through
    _replace(folder, w.METRICS_FILE, w.metrics(verdict, needs, journal, now, ok), 0o644)


def history() -> int:
    for event in w.parse_journal(_read(w.JOURNAL)):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.time))
        where = f"GPU {event.gpu} ({event.bus_id})" if event.gpu is not None else (event.bus_id or "node")
        print(f"{when}  {event.cls:<7}  {event.action:<7}  {where}  {event.check}: {event.reason}"
              + (f" [{event.detail}]" if event.detail else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpufleet-health-watch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timer", action="store_true", help="the systemd timer's run")
    parser.add_argument("--prolog", action="store_true", help="Slurm's Prolog: check and record, act on nothing")
    parser.add_argument("--history", action="store_true", help="print the journal")
    args = parser.parse_args(argv)
    try:
        _private_dir(w.WATCH_DIR)
        if args.history:
            return history()
        lines = _read(w.CONFIG)
        if not lines:
            raise WatchError(f"no {w.CONFIG}: run deploys/health_watch.py (or all.py) for this host")
        config = json.loads("\n".join(lines))
        # one run at a time: the timer, Slurm's health check and its prolog may start together
        fd = _open(w.RUN_LOCK, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # slurm.conf's Prolog= takes no arguments: slurmd says it is the prolog in the environment
            prolog = args.prolog or os.environ.get("SLURM_SCRIPT_CONTEXT", "").startswith("prolog")
            return run(config, "prolog" if prolog else "act")
        finally:
            os.close(fd)
    except (WatchError, OSError, ValueError, KeyError) as exc:
        print(f"gpufleet-health-watch: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
