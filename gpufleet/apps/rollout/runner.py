"""The rolling driver upgrade: survey, plan batches, then per batch and wave run the steps of
deploys/upgrade.py, recording every host's progress in the state file and stopping as the
operator's limits say (canary failure, max_fail, max_unavailable)."""
from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, TextIO

from gpufleet.catalog.compat import compat_data
from gpufleet.operations.drain import BUSY_MARK

from gpufleet.config.failures import stop_line

from gpufleet.rollout import manifest as mf, plan, progress as prog, targets
from gpufleet.controller.inventory_source import InventorySource, SourceError
from gpufleet.printable import printable

from gpufleet.rollout.context import RolloutContext
from gpufleet.rollout.manifest import load_manifest
from gpufleet.rollout.state import CHANGING_STEPS, STEPS, RolloutState, StateLock, StateError

if TYPE_CHECKING:  # session imports pyinfra's CLI (gevent): only when a step runs
    from .session import StepResult

EXIT_DONE, EXIT_STOPPED, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3


@dataclass
class Options:
    inventory: str | InventorySource
    target: str | None = None      # --driver-version: an override; None = what the inventory resolves
    canary: int = 1
    batch_size: int | None = None
    batch_percent: float | None = None
    max_unavailable: int | None = None
    max_fail: str = "0"
    state_path: Path | None = None
    skip: list[str] = field(default_factory=list)
    force: bool = False
    dry_run: bool = False
    wait_idle: int = 0
    stop_containers: bool = False
    manifests_dir: Path = Path(".gpufleet/manifests")
    reboot_timeout: int = 600
    retune: bool = False
    assume_yes: bool = False       # -y: no question before draining
    heartbeat: float = 30          # seconds between a wave's progress lines (0: none)
    command: str = "tools/rollout"   # program and inventory, named to a second run by the locks (no
                                     # other argument: a --data value may be a secret)


def survey_and_resolve(ctx: RolloutContext, override: str | None) -> None:
    """The survey of deploys/upgrade.py, for the host's own target (its inventory's, or the
    override as the inventory would resolve it on this host)."""
    from pyinfra import host

    from gpufleet.deploys import upgrade as steps

    from gpufleet.config.hostfacts import os_name

    found = targets.resolve_host(host, override)
    ctx.target = found.get("target") or override or ""
    steps.survey_host(ctx)
    ctx.survey[host.name]["os"] = os_name(host)
    ctx.stack[host.name] = found.get("stack") or {}
    ctx.survey[host.name].update(target=found.get("target"), target_error=found.get("error"),
                                 resolution=found.get("resolution"), stack=ctx.stack[host.name],
                                 stack_moves=mf.stack_changes(ctx.survey[host.name]["packages"], ctx.stack[host.name]))


def tune_and_cdi(ctx: RolloutContext) -> None:
    """deploys/upgrade.py's tune (or, with --retune, the tier's tuning as all.py applies it),
    then the CDI spec the new driver made stale (what all.py would otherwise change on its
    next run)."""
    from gpufleet.deploys import upgrade as steps
    from gpufleet.deploys.docker import cdi_after_driver_change
    from gpufleet.deploys.tuning import tuning

    if ctx.retune:
        tuning()
    else:
        steps.tune(ctx=ctx)   # by keyword: pyinfra types a deploy's positional places as its global arguments
    cdi_after_driver_change()


def mig_change(ctx: RolloutContext) -> None:
    """The MIG partitions gpu_mig sets (deploys/tuning.py's MIG part), on the drained host,
    through the same per-GPU gate as all.py; GPU work found right before the change makes the
    host busy (its idle GPUs are changed, the busy ones are not), and a mode change whose GPU
    reset was refused makes it reboot-pending, instead of all.py's "pending" report."""
    from gpufleet.deploys.tuning import mig_partitions
    from gpufleet.config.hostcontext import real_object

    def busy(h: Any, running: str) -> bool:
        h = real_object(h)
        ctx.outcomes[h.name] = "busy"
        ctx.reasons[h.name] = (f"busy, pending (MIG partitions not changed where GPU work started after the drain: "
                               f"{running}). Fix: re-run once it has ended")
        return False

    def reboot(h: Any, gpus: str) -> bool:
        h = real_object(h)
        ctx.outcomes[h.name] = "reboot-pending"
        ctx.reasons[h.name] = (f"MIG mode change pending until a GPU reset, which was refused ({gpus}). "
                               "Fix: reboot the host by hand (the boot unit makes the partitions), then re-run")
        return False

    mig_partitions(if_busy=busy, if_reboot=reboot)


def hostlock_stale(name: str, record: str) -> str:
    from gpufleet.controller.hostlock import stale_message
    return stale_message(name, record)


def check_settings(source: InventorySource | str, names: list[str]) -> list[str]:
    """The inventory problems of the hosts `names` (gpufleet/config/settings.py), one line each; a
    broken host this run does not touch (outside --limit) is not its business."""
    from gpufleet.errors import InventoryError
    from gpufleet.config.settings import validate_inventory
    from .session import load_inventory

    inventory = load_inventory(source)
    path = Path(str(source))
    try:
        validate_inventory(inventory, source=path if path.suffix == ".py" and path.is_file() else None,
                           hosts=[h for h in inventory if h.name in names])
    except InventoryError as exc:
        return exc.problems
    return []


def default_state_path(inventory: str | InventorySource) -> Path:
    return Path(".gpufleet/rollouts") / f"{Path(inventory).stem}.json"


class Runner:
    def __init__(self, opts: Options, out: TextIO = sys.stdout, stdin: TextIO | None = None):
        self.opts = opts
        self.out = out
        self.stdin = stdin if stdin is not None else sys.stdin
        # no -y and no one to ask: the run goes no further than its dry run (pyinfra's rule)
        self.unattended = not opts.dry_run and not opts.assume_yes and not prog.is_terminal(self.stdin)
        self.dry = opts.dry_run or self.unattended
        self.unreachable: dict[str, str] = {}   # host -> why the survey did not reach it
        self.waves_total = 0
        self.wave_no = 0
        self.wave_seconds: list[float] = []
        self.t0 = time.monotonic()
        self.eligible: list[str] = []       # this run's hosts, for the progress lines
        self.batches: list[plan.Batch] = []
        self.notes: dict[str, str] = {}     # host -> why it is not in the rollout
        self.stopped: str | None = None
        self.waved: set[str] = set()        # hosts a wave of this run started
        self.waves_started: float | None = None
        self.acceptance: dict[str, Any] = {}   # host -> its acceptance verdict (--json)
        self.ctx = RolloutContext(target=opts.target or "", manifests_dir=Path(opts.manifests_dir),
                                  wait_idle=opts.wait_idle, force=opts.force,
                                  stop_containers=opts.stop_containers, reboot_timeout=opts.reboot_timeout,
                                  retune=opts.retune)

    def say(self, text: str) -> None:
        # every line of the rollout's output goes through here, and many quote a host (GPU
        # process names, lock owners): printable, so no host string drives the terminal
        print(f"[{time.monotonic() - self.t0:7.1f}s] {printable(text, newlines=True)}", file=self.out, flush=True)

    # --- entry point -------------------------------------------------------------------------

    def run(self) -> int:
        from gpufleet.controller import hostlock
        from gpufleet.controller import staging

        hostlock.install()  # a step that finds its host not locked by this rollout locks it first
        staging.install()  # sudo transfers stage in the login user's private folder
        self.locks = hostlock.FleetLocks(self.opts.inventory, hostlock.owner_record(*self.opts.command.split(" ", 1)))
        try:
            return self._run()
        finally:
            self.locks.close()
            lock = getattr(self, "state_lock", None)
            if lock is not None:
                lock.release()

    def _run(self) -> int:
        hosts = self._checked_hosts()
        if hosts is None:
            return EXIT_USAGE
        code = self._open_state()
        if code is not None:
            return code
        if not self._survey(hosts):
            return EXIT_USAGE
        taking_part = self._take_part(hosts)
        if taking_part is None:
            return EXIT_USAGE
        eligible, notes = taking_part
        planned = self._batches(eligible)
        if planned is None:
            return EXIT_USAGE
        batches, size, max_unavailable, max_fail = planned
        opts, state = self.opts, self.state
        self.batches, self.notes = batches, notes   # for --json (result.py)
        self.print_plan(batches, notes, size, max_unavailable, max_fail)
        wanted = [n for b in batches for n in b.hosts if state.host(n).status != "done" and n not in opts.skip]
        if self.dry:
            if self.unattended and wanted:
                self.say(prog.unattended_line(opts.command.split(" ", 1)[0], f"drain and upgrade {len(wanted)} host(s)"))
                return self.print_unreachable(EXIT_STOPPED)
            return self.print_unreachable(EXIT_DONE)

        code = self._confirm_and_lock(wanted, batches, size, max_unavailable, max_fail)
        if code is not None:
            return code
        stopped = self._run_batches(batches, eligible, max_unavailable, max_fail)
        self.stopped = stopped
        if stopped:
            self.say(f"STOPPED: {stopped}")
        code = self.print_summary(eligible, notes, stopped)
        state.runs[-1].update(finished=time.time(), exit=code, stopped=stopped,
                              wall_seconds=round(time.monotonic() - self.t0, 1))
        state.save()
        return code

    # --- the phases of a run, in order -----------------------------------------------------

    def _checked_hosts(self) -> list[str] | None:
        """The inventory's hosts, once the options and their settings are sound (None: an
        error was said)."""
        from .session import inventory_hosts

        opts = self.opts
        if opts.target is not None:
            if not re.fullmatch(r"\d+\.\d+(\.\d+)?", opts.target):
                self.say(f"error: --driver-version {opts.target!r} is not a driver version such as 580.126.09")
                return None
            branch = opts.target.split(".")[0]
            known = compat_data().driver_branches.get(branch)
            if known is None:
                self.say(f"error: driver branch R{branch} is not in the compatibility data")
                return None
        try:
            hosts = inventory_hosts(opts.inventory)
        except SourceError as exc:
            self.say(f"error: {exc}")
            return None
        if not hosts:
            # an inventory that loads but names no host is a mistake, not a finished rollout
            self.say(f"error: the inventory {opts.inventory} has no hosts: nothing to roll out")
            return None
        unknown = sorted(set(opts.skip) - set(hosts))
        if unknown:
            self.say(f"error: --skip names hosts not in the inventory{' (--limit)' if getattr(opts.inventory, 'limit', None) else ''}: {', '.join(unknown)}")
            return None
        refusal = check_settings(opts.inventory, hosts)   # the hosts this run touches, and only those
        if refusal:
            for line in refusal:
                self.say(f"error: {line}")
            return None
        return hosts

    def _open_state(self) -> int | None:
        """Lock and load the state file (an exit code when that failed)."""
        opts = self.opts
        state_path = opts.state_path or default_state_path(opts.inventory)
        if not self.dry:
            # one tools/rollout per state file: the lock lives as long as this process
            self.state_lock = StateLock(state_path)
            try:
                self.state_lock.acquire(opts.command)
            except StateError as exc:
                self.say(f"error: {exc}")
                return EXIT_STOPPED
        try:
            self.state = RolloutState.load(state_path, opts.target or "inventory", str(opts.inventory))
        except Exception as exc:
            self.say(f"error: {exc}")
            return EXIT_USAGE
        return None

    def _survey(self, hosts: list[str]) -> bool:
        """Survey every host and resolve its target; False when one cannot take it (said)."""
        from .session import run_step

        opts = self.opts
        self.say(f"surveying {len(hosts)} host(s) of {opts.inventory}")
        survey = run_step(opts.inventory, hosts, survey_and_resolve, self.ctx, opts.target, reasons=self.ctx.reasons)
        info = self.ctx.survey
        unreachable = dict(survey.failed)
        self.unreachable = unreachable

        # every host's target, from the inventory (or the override through the same resolver):
        # one that does not fit stops the rollout here, before any host is touched
        refused = [targets.refusal_line(n, info[n]["target_error"], opts.target) for n in hosts
                   if n not in unreachable and targets.rollable(info[n]) and info[n].get("target_error")]
        refused += [f"{n}: {info[n]['mig_error']}" for n in hosts
                    if n not in unreachable and targets.rollable(info[n]) and info[n].get("mig_error")]
        if refused:
            for line in refused:
                self.say(f"error: {line}")
            self.say(f"REFUSED: {len(refused)} host(s) cannot take "
                     + (f"driver {opts.target}" if opts.target else "what the inventory resolves")
                     + ": nothing changed")
            return False

        return True

    def _take_part(self, hosts: list[str]) -> tuple[list[str], dict[str, str]] | None:
        """(the hosts this rollout changes, why each other host is left out); None on a clash
        with the state file (said)."""
        opts, state, info, unreachable = self.opts, self.state, self.ctx.survey, self.unreachable
        # who takes part
        eligible: list[str] = []
        notes: dict[str, str] = {}
        for name in hosts:
            if name in unreachable:
                notes[name] = f"not surveyed: {unreachable[name]}"
                continue
            if not targets.rollable(info[name]):
                notes[name] = f"driver_source is {info[name]['driver_source']}: not upgraded by tools/rollout"
                continue
            target = info[name]["target"]
            clash = state.retarget(name, target, info[name]["stack"])
            if clash:
                self.say(f"error: {clash}")
                return None
            rec = state.host(name)
            moved = (info[name]["installed"], info[name]["loaded"]) != (target, target) or info[name]["stack_moves"]
            if rec.status == "done" and moved:
                # recorded done at this target, the survey says otherwise (pinned back through another
                # inventory, a hand apt install, tools/rollback, a re-imaged node): the host wins
                now = f"{info[name]['loaded'] or '-'}/{info[name]['installed'] or '-'}"
                self.say(f"{name}: recorded done at {target}, but the host runs {now} (loaded/installed)"
                         + (f", CUDA/cuDNN {', '.join(info[name]['stack_moves'])}" if info[name]["stack_moves"] else "")
                         + ": rolled out afresh")
                state.hosts[name] = rec = type(rec)(name, target=rec.target, stack=rec.stack)
            if rec.status == "done" and info[name]["mig_changes"]:
                # done at this target, but its MIG layout is not what gpu_mig sets now: a new round
                state.hosts[name] = rec = type(rec)(name, target=rec.target, stack=rec.stack)
            fresh = not rec.steps and rec.status in ("pending", "skipped", "busy")
            if (fresh and info[name]["installed"] == info[name]["loaded"] == target and not info[name]["stack_moves"]
                    and not info[name].get("profiling_pending") and not info[name].get("mig_changes")):
                stack = ", ".join(f"{p} {v}" for p, v in sorted(info[name]["stack"].items())
                                  if p in info[name]["packages"])
                notes[name] = f"at {target} already{f' (and {stack})' if stack else ''}: nothing to do"
                state.hosts.pop(name, None)   # not part of this rollout: no record
                continue
            if fresh and not info[name]["installed"]:
                notes[name] = "no NVIDIA driver installed: deploys/all.py installs the first one"
                state.hosts.pop(name, None)
                continue
            eligible.append(name)
        self.eligible = eligible
        for name in eligible:
            rec = state.host(name)
            if rec.status == "skipped" and name not in opts.skip:
                rec.status = "pending" if not rec.steps else "failed"
        return eligible, notes

    def _batches(self, eligible: list[str]) -> tuple[list[plan.Batch], int, int, int] | None:
        """(batches, batch size, max_unavailable, max_fail): kept from the first run of this
        rollout, so a re-run resumes the same plan; None on a bad limit (said)."""
        opts, state, info = self.opts, self.state, self.ctx.survey
        # batches: kept from the first run of this rollout, so a re-run resumes the same plan
        try:
            size = plan.batch_size_for(len(eligible), opts.batch_size, opts.batch_percent,
                                       min([info[n]["batch_size"] for n in eligible] or [1]))
            max_fail = plan.parse_max_fail(opts.max_fail, len(eligible))
        except plan.PlanError as exc:
            self.say(f"error: {exc}")
            return None
        max_unavailable = opts.max_unavailable or max(size, opts.canary, 1)
        assigned: dict[str, int] = {}
        for n in eligible:
            kept = state.hosts[n].batch if n in state.hosts else None
            if kept is not None:
                assigned[n] = kept
        if assigned:
            rest = [n for n in eligible if n not in assigned]
            last = max(assigned.values())
            for i, b in enumerate(plan.make_batches(rest, 0, size)):
                for n in b.hosts:
                    assigned[n] = last + 1 + i
            by_index: dict[int, list[str]] = {}
            for n in eligible:
                by_index.setdefault(assigned[n], []).append(n)
            batches = [plan.Batch(i, tuple(by_index[i])) for i in sorted(by_index)]
        else:
            batches = plan.make_batches(eligible, opts.canary, size)
        for b in batches:
            for n in b.hosts:
                state.host(n).batch = b.index
                state.host(n).from_version = state.host(n).from_version or info[n]["installed"]
        return batches, size, max_unavailable, max_fail

    def _confirm_and_lock(self, wanted: list[str], batches: list[plan.Batch], size: int, max_unavailable: int,
                          max_fail: int) -> int | None:
        """Ask (unless -y), record the run, lock the hosts; an exit code when the run stops here."""
        opts, state = self.opts, self.state
        # asked after the plan, before anything changes (the state file included)
        question = (f"Drain and upgrade {len(wanted)} host(s) as planned above"
                    + (f" ({len(self.unreachable)} unreachable host(s) left out)" if self.unreachable else "")
                    + "? (-y skips this question)")
        if wanted and not prog.confirmed(question, opts.assume_yes, self.stdin, self.out):
            self.say("not confirmed: nothing changed")
            return self.print_unreachable(EXIT_STOPPED)
        state.runs.append({"started": time.time(), "options": {
            "canary": opts.canary, "batch_size": size, "max_unavailable": max_unavailable,
            "max_fail": max_fail, "skip": opts.skip, "force": opts.force}})
        state.save()
        self.waves_total = prog.planned_waves([len([n for n in b.hosts if n in wanted]) for b in batches],
                                              max_unavailable)

        # one run at a time on a host: lock every host this rollout may change, before any is
        taken, locked_elsewhere = self.locks.take(wanted)
        for n, lock in taken.items():
            if lock.stale:
                self.say(f"warning: {hostlock_stale(n, lock.stale)}")
        if locked_elsewhere:
            for n, why in locked_elsewhere.items():
                self.say(f"error: {why}" if n in why else f"error: {n}: {why}")
            not_taken = f"{len(locked_elsewhere)} host(s) locked by another run: nothing changed"
            self.stopped = not_taken
            self.say(f"STOPPED: {not_taken}")
            state.runs[-1].update(finished=time.time(), exit=EXIT_STOPPED, stopped=not_taken)
            state.save()
            return self.print_unreachable(EXIT_STOPPED)

        return None

    def _run_batches(self, batches: list[plan.Batch], eligible: list[str], max_unavailable: int,
                     max_fail: int) -> str | None:
        """Batch after batch, wave after wave, until done or a limit stops the rollout (why)."""
        opts, state, info = self.opts, self.state, self.ctx.survey
        stopped: str | None = None
        for batch in batches:
            if stopped:
                break
            todo = []
            for name in batch.hosts:
                rec = state.host(name)
                if rec.status == "done":
                    self.say(f"[{batch.name}] {name}: done already, not redone")
                    continue
                if name in opts.skip:
                    state.mark(name, "skipped", "marked to skip (--skip)")
                    self.say(f"[{batch.name}] {name}: skipped (--skip)")
                    continue
                procs = info[name]["processes"]
                if (procs and info[name]["require_idle"] and not opts.force and opts.wait_idle <= 0 and not rec.changed
                        and not info[name]["slurm"]):   # on a Slurm node the drain waits for its jobs
                    running = ", ".join(f"{p['pid']} {p['name']}" for p in procs)
                    state.mark(name, "busy", f"{len(procs)} GPU process(es) running ({running}): not upgraded; "
                                             "re-run later, wait with --wait-idle, or --force")
                    self.say(f"[{batch.name}] {name}: BUSY, not upgraded: {running}")
                    continue
                todo.append(name)
            while todo and not stopped:
                out = [n for n in state.unavailable() if n not in todo]
                wave = plan.waves(todo, max_unavailable, len(out))
                if not wave:
                    stopped = (f"max_unavailable {max_unavailable} reached: {len(out)} host(s) out of service "
                               f"({', '.join(sorted(out))})")
                    break
                todo = todo[len(wave):]
                self.run_wave(batch, wave)
                self.say(self.progress(eligible))   # after each wave: the operator sees how far and how long
                failed_here = [n for n in batch.hosts if state.host(n).status == "failed"]
                stopped = plan.stop_reason(batch, failed_here, len(state.failed()), max_fail)
        return stopped


    # --- one wave ----------------------------------------------------------------------------

    def run_wave(self, batch: plan.Batch, wave: list[str]) -> None:
        from gpufleet.deploys import upgrade as steps

        self.waves_started = self.waves_started or time.monotonic()
        self.waved.update(wave)
        self.wave_no += 1
        self.say(f"[{batch.name}] starting {', '.join(wave)}; {self.progress(self.eligible, in_flight=wave)}")
        started = time.monotonic()
        stop = threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(started, stop), daemon=True)
        if self.opts.heartbeat > 0:
            beat.start()
        try:
            self._run_wave(batch, wave, steps)
        finally:
            stop.set()
            if beat.is_alive():
                beat.join(timeout=5)
            self.wave_seconds.append(time.monotonic() - started)

    def heartbeat(self, wave_started: float) -> str:
        now = time.monotonic()
        done = sum(1 for n in self.eligible if n in self.state.hosts and self.state.host(n).status == "done")
        waves = max(self.waves_total, self.wave_no)
        left = prog.estimate_left(self.wave_seconds, self.wave_no, waves, now - wave_started)
        return prog.heartbeat_line(self.wave_no, waves, done, len(self.eligible),
                                   now - (self.waves_started or wave_started), left)

    def _heartbeat(self, wave_started: float, stop: threading.Event) -> None:
        # a thread, or a greenlet once pyinfra's CLI module has patched threading (session.py):
        # either way it runs while the wave's pyinfra run waits on its hosts
        while not stop.wait(self.opts.heartbeat):
            self.say(self.heartbeat(wave_started))

    def _run_wave(self, batch: plan.Batch, wave: list[str], steps: Any) -> None:
        state = self.state
        todo = self._steps_to_run(batch, wave)
        active = list(todo)
        funcs: dict[str, Callable[..., Any]] = {
            "drain": steps.drain, "snapshot": steps.snapshot, "upgrade": steps.upgrade, "reboot": steps.reboot,
            "mig": mig_change, "tune": tune_and_cdi, "validate": steps.validate, "undrain": steps.undrain}
        give_back: list[str] = []
        for step in STEPS:
            names = [n for n in active if step in todo[n]]
            if not names:
                continue
            for n in names:
                state.start(n, step)
            t = time.monotonic()
            result = self.accept(batch, names) if step == "accept" else self.run_per_target(names, funcs[step])
            took = time.monotonic() - t
            if step == "reboot":
                # the locks' holders died with the boot: this rollout locks the hosts again
                for n, why in self.locks.retake([n for n in result.ok if result.changed.get(n)]).items():
                    self.say(f"[{batch.name}] {n}: warning: could not lock it again after its reboot: {why}")
            for n in result.ok:
                self._step_ok(batch, n, step, took)
            for n, why in result.failed.items():
                if self._step_failed(batch, n, step, why, took):
                    give_back.append(n)
                active.remove(n)
        if give_back:
            # nothing changed on these: give them back to the scheduler
            result = self.run_per_target(give_back, steps.undrain)
            for n in result.ok:
                self.say(f"[{batch.name}] {n}: nothing changed, back in service")

    def _steps_to_run(self, batch: plan.Batch, wave: list[str]) -> dict[str, list[str]]:
        """{host: its steps left} of the wave's hosts whose manifest (if any) is this rollout's."""
        state, ctx = self.state, self.ctx
        refused = []
        for name in wave:
            rec = state.host(name)
            if rec.manifest and Path(rec.manifest).exists():
                try:
                    ctx.manifests[name] = load_manifest(rec.manifest, name)
                except mf.ManifestError as exc:   # not the manifest this rollout wrote: nothing runs on it
                    state.mark(name, "failed", str(exc))
                    self.say(f"[{batch.name}] {name}: FAILED: {exc}")
                    refused.append(name)
        wave = [name for name in wave if name not in refused]
        if batch.index == 0:
            ctx.canaries.update(wave)
        todo = {name: state.host(name).steps_to_run() for name in wave}
        for name in wave:
            mig = ctx.survey.get(name, {})
            if not (mig.get("mig_changes") or mig.get("mig_on")):
                # no MIG layout to make or keep: the step has nothing to do (validate still reads
                # the layout); skipped, not run as a pyinfra run of its own
                todo[name] = [s for s in todo[name] if s != "mig"]
        return todo

    def _step_ok(self, batch: plan.Batch, n: str, step: str, took: float) -> None:
        state, ctx = self.state, self.ctx
        msg = ""
        if step in ("validate", "accept"):
            msg = "; ".join(ctx.notes.pop(n, []))
        if step == "snapshot":
            state.host(n).manifest = ctx.manifest_paths.get(n)
            msg = f"manifest {ctx.manifest_paths.get(n)}"
            disk = (ctx.manifests.get(n) or {}).get("disk_snapshot")
            if disk:
                msg += f", {disk.get('provider')} snapshot {disk.get('name')}"
        status = "done" if step == "undrain" else None
        state.finish(n, step, True, msg or f"{step} ok", status=status)
        self.say(f"[{batch.name}] {n}: {step} ok ({took:.1f}s){' ' + msg if msg else ''}")

    def _step_failed(self, batch: plan.Batch, n: str, step: str, why: str, took: float) -> bool:
        """Record a host's failed step as what it means (busy, reboot-pending, failed); True when
        nothing changed on it, so it goes back in service."""
        state, ctx = self.state, self.ctx
        outcome = ctx.outcomes.pop(n, None)
        ctx.reasons.pop(n, None)
        give_back = False
        if BUSY_MARK in why and step in ("upgrade", "reboot"):
            # GPU work found in the very command that would swap the packages or reboot (a
            # job started after the drain): nothing was done; tried again on the next run
            done = "packages not changed" if step == "upgrade" else "upgraded, not rebooted"
            state.finish(n, step, False, f"busy, pending ({done}): GPU work started after planning: "
                                         f"{why}. Re-run once it has ended", status="busy")
            give_back = step == "upgrade"   # nothing changed: back in service
        elif outcome == "busy" and step == "mig":
            # GPU work on a GPU the change touches, on a drained host: the driver steps
            # before it are done; the MIG change waits for the next run, the host goes back
            state.finish(n, step, False, why, status="busy")
            give_back = True
        elif outcome == "busy" or (step == "drain" and BUSY_MARK in why):
            # the drain's waits end with the busy mark when jobs outlast them
            state.finish(n, step, False, why, status="busy")
            give_back = True
        elif outcome == "reboot-pending":
            state.finish(n, step, False, why, status="reboot-pending")
        else:
            # a failed acceptance is a CHANGING_STEP: the host stays drained, named with its fix
            state.finish(n, step, False, f"{step} failed: {why}")
            give_back = step not in CHANGING_STEPS
        self.say(f"[{batch.name}] {n}: {step} {'FAILED' if state.host(n).status == 'failed' else state.host(n).status.upper()} "
                 f"({took:.1f}s): {why}")
        return give_back

    def known_good_peer(self, wave: Sequence[str]) -> str | None:
        """A host already in service at its target: done in this rollout, or left out as at
        its target already; None when there is none yet (the canary)."""
        done = [n for n in self.state.hosts if n not in wave and self.state.host(n).status == "done"]
        at_target = [n for n, why in self.notes.items() if why.startswith("at ") and n not in wave]
        return (done + at_target + [None])[0]

    def accept(self, batch: plan.Batch, names: list[str]) -> StepResult:
        """The acceptance step (gpufleet/apps/acceptance.py): every host of the wave with a
        known-good peer; a host that fails stays drained, named with the measurement and fix."""
        from gpufleet.apps.acceptance import accept

        from .session import StepResult

        peer = self.known_good_peer(names)
        self.say(f"[{batch.name}] acceptance of {', '.join(names)} with "
                 + (f"known-good peer {peer}" if peer else "no known-good peer yet (the first host is the reference)"))
        result = StepResult()
        verdicts = accept(self.opts.inventory, names, peer, say=lambda line: self.say(f"[{batch.name}] {line}"),
                          rollout=True)
        self.acceptance.update({n: v.to_json() for n, v in verdicts.items()})
        self.record_acceptance(verdicts, peer)
        for name, verdict in verdicts.items():
            for finding in verdict.findings:
                if finding.status != "pass":
                    self.say(f"[{batch.name}] {name}: {finding.line()}")
            if verdict.passed:
                result.ok.append(name)
                self.ctx.notes.setdefault(name, []).append(verdict.summary())
            else:
                result.failed[name] = f"acceptance: {verdict.summary()}"
        return result

    def record_acceptance(self, verdicts: dict[str, Any], peer: str | None) -> None:
        """The record of each passed acceptance on its host (facts/acceptance.py), for the driver
        it now has: the host is accepted (gpufleet-deploy accepts it not again). A verdict that
        only says the acceptance was turned off (acceptance_rollout: false) is no acceptance."""
        from gpufleet.apps.new_hosts import peers_of, record_passed

        ran = {n: v for n, v in verdicts.items()
               if v.passed and not all(f.name == "acceptance" and f.status == "skip" for f in v.findings)}
        for name, why in record_passed(self.opts.inventory, ran, peers_of(list(verdicts), peer)).items():
            self.say(f"{name}: warning: its acceptance passed, but its record was not written: {why}")
            self.ctx.notes.setdefault(name, []).append("acceptance record NOT written")

    def progress(self, names: list[str], in_flight: Sequence[str] = ()) -> str:
        """Hosts done / in flight / failed of this rollout, and the time left at this run's pace
        (the wall time of its waves so far per host they settled)."""
        status = {n: self.state.host(n).status for n in names if n in self.state.hosts}
        def count(*wanted: str) -> int:
            return sum(1 for n, v in status.items() if v in wanted and n not in in_flight)

        flying = len(in_flight) + count("in-progress")
        waiting = count("pending")
        line = f"progress: {count('done')}/{len(status)} done, {flying} in flight, {count('failed')} failed"
        settled = sum(1 for n in self.waved if n not in in_flight and status.get(n) not in ("pending", "in-progress"))
        # a settled host was in a wave, and the first wave set waves_started
        if settled and waiting + flying and self.waves_started is not None:
            left = (time.monotonic() - self.waves_started) / settled * (waiting + flying)
            line += f", about {round(left / 60)} min left" if left >= 90 else f", about {round(left)} s left"
        return line

    def run_per_target(self, names: list[str], func: Callable[..., Any]) -> StepResult:
        """One step on `names`, one pyinfra run per target driver (hosts of one inventory may
        resolve to different drivers); the results merged."""
        from .session import StepResult, run_step

        merged = StepResult()
        by_target: dict[str, list[str]] = {}
        for n in names:
            by_target.setdefault(self.state.host(n).target or self.opts.target or "", []).append(n)
        for target, group in by_target.items():
            self.ctx.target = target
            result = run_step(self.opts.inventory, group, func, self.ctx, reasons=self.ctx.reasons)
            merged.ok += result.ok
            merged.failed.update(result.failed)
            merged.changed.update(result.changed)
        return merged

    def target_of(self, name: str) -> str:
        return self.state.host(name).target or self.opts.target or "?"

    # --- output ------------------------------------------------------------------------------

    def print_plan(self, batches: list[plan.Batch], notes: dict[str, str], size: int, max_unavailable: int,
                   max_fail: int) -> None:
        info = self.ctx.survey
        wanted = sorted({self.target_of(n) for b in batches for n in b.hosts})
        what = (f"driver {self.opts.target} (--driver-version override)" if self.opts.target
                else f"the inventory's driver ({', '.join(wanted) or 'no host to change'})")
        lines = [f"{'DRY RUN: ' if self.dry else ''}rollout of {what}: "
                 f"{sum(len(b.hosts) for b in batches)} host(s), canary {len(batches[0].hosts) if batches and batches[0].index == 0 else 0}, "
                 f"batch size {size}, max_unavailable {max_unavailable}, max_fail {max_fail}"]
        header = f"  {'batch':<8} {'host':<22} {'from (loaded/installed)':<26} {'to':<11} {'reboot':<28} {'GPU jobs':<22} {'snapshot':<9} state"
        lines.append(header)
        for b in batches:
            for n in b.hosts:
                s = info[n]
                rec = self.state.host(n)
                target = self.target_of(n)
                frm = f"{s['loaded'] or '-'}/{s['installed'] or '-'}"
                if s["loaded"] == target and s["installed"] == target and not s.get("profiling_pending"):
                    reboot = "no (at target)"
                elif s["loaded"] == target and s["installed"] == target and s["driver_reboot"] != "never":
                    reboot = "yes (tuning_profiling)"
                elif s["driver_reboot"] == "never":
                    reboot = "needed, driver_reboot never"
                else:
                    reboot = f"yes ({s['driver_reboot']})"
                jobs = ", ".join(f"{p['pid']} {p['name']}" for p in s["processes"]) or "none"
                if s["processes"] and s["require_idle"] and not self.opts.force:
                    jobs += (" -> drain waits" if s["slurm"] else " -> refused") if self.opts.wait_idle <= 0 \
                        else f" -> wait {self.opts.wait_idle}s"
                status = "skip (--skip)" if n in self.opts.skip else rec.status
                lines.append(f"  {b.name:<8} {n:<22} {frm:<26} {target:<11} {reboot:<28} {jobs:<22} "
                             f"{'manifest' + ('+' + s['snapshot'] if s['snapshot'] != 'none' else ''):<9} {status}")
                if s["stack_moves"]:
                    lines.append(f"  {'':<8}   CUDA/cuDNN: " + ", ".join(s["stack_moves"]))
                for change in s.get("mig_changes", []):
                    # the same plan all.py, deploys/plan.py and the gate read (gpufleet.plans.tuning.host_mig)
                    lines.append(f"  {'':<8}   MIG: {change} (drained, changed while its GPUs are idle)")
                at_target = s["installed"] == s["loaded"] == target and not s["stack_moves"]
                moving = s["moving"] if (s["installed"] != target or not s["stack_moves"]) and not at_target else []
                if at_target and s.get("profiling_pending"):
                    lines.append(f"  {'':<8}   tuning_profiling: the loaded nvidia module lacks it: a reboot, no package change")
                if moving:
                    missing = [p for p in moving if not s["available"].get(p)]
                    lines.append(f"  {'':<8}   packages: {' '.join(moving)}"
                                 + (f" (no {target} candidate yet for: {' '.join(missing)}; the drain step refreshes the index)"
                                    if missing else ""))
        for n, why in notes.items():
            lines.append(f"  {'-':<8} {n:<22} not in the rollout: {why}")
        for line in lines:
            print(printable(line), file=self.out, flush=True)

    def print_inventory_lines(self, eligible: list[str]) -> None:
        """After an override: the inventory lines that make it say what the hosts now run."""
        if not self.opts.target:
            return
        # a host whose only change was its MIG layout ran this driver before: nothing to say
        moved = [n for n in eligible if self.state.host(n).status == "done"
                 and self.state.host(n).from_version != self.opts.target]
        lines = targets.inventory_lines(self.opts.inventory, moved, self.opts.target) if moved else []
        if not lines:
            return
        print(f"the inventory does not say {self.opts.target} yet for {len(moved)} upgraded host(s): set it, so that "
              f"deploys/all.py agrees (it would report 'driver upgrade pending' back to the inventory's driver):",
              file=self.out)
        for line in lines:
            print(f"  {line}", file=self.out)
        print("  then `pyinfra INVENTORY deploys/all.py` changes nothing on them", file=self.out, flush=True)

    def print_summary(self, eligible: list[str], notes: dict[str, str], stopped: str | None) -> int:
        state = self.state
        print(f"rollout of {self.opts.target or 'the inventory'}: {time.monotonic() - self.t0:.1f}s wall", file=self.out)
        for n in eligible:
            rec = state.host(n)
            times = " ".join(f"{s}={rec.steps[s].get('seconds', '?')}s" for s in STEPS if s in rec.steps)
            print(f"  {n:<22} {rec.status:<15} {printable(rec.message[:160])}", file=self.out)
            if times:
                print(f"  {'':<22}   {times}", file=self.out)
        print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(state.summary().items())), file=self.out, flush=True)
        self.print_inventory_lines(eligible)
        if stopped:
            return self.print_unreachable(EXIT_STOPPED)
        if all(state.host(n).status in ("done", "skipped") for n in eligible):
            return self.print_unreachable(EXIT_DONE)
        return self.print_unreachable(EXIT_INCOMPLETE)

    def print_unreachable(self, code: int) -> int:
        """Name every host the survey did not reach; a run that left one out is not done."""
        if not self.unreachable:
            return code
        for n, why in self.unreachable.items():
            print(stop_line(n, "failed", "rollout", f"not surveyed, left out of this run: {why}",
                            "bring the host back (or correct its ssh_* data in the inventory) and re-run "
                            "tools/rollout, which resumes; or leave it out with --limit"),
                  file=self.out, flush=True)
        print(f"INCOMPLETE: {len(self.unreachable)} host(s) not reached: {', '.join(self.unreachable)}",
              file=self.out, flush=True)
        return EXIT_INCOMPLETE if code == EXIT_DONE else code
