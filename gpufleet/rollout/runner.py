"""The rolling driver upgrade: survey, plan batches, then per batch and wave run the steps of
deploys/upgrade.py, recording every host's progress in the state file and stopping as the
operator's limits say (canary failure, max_fail, max_unavailable)."""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TextIO

from gpufleet.compat import compat_data

from . import plan
from .context import RolloutContext
from .state import CHANGING_STEPS, STEPS, RolloutState

EXIT_DONE, EXIT_STOPPED, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3


@dataclass
class Options:
    inventory: str
    target: str
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


def default_state_path(inventory: str) -> Path:
    return Path(".gpufleet/rollouts") / f"{Path(inventory).stem}.json"


class Runner:
    def __init__(self, opts: Options, out: TextIO = sys.stdout):
        self.opts = opts
        self.out = out
        self.t0 = time.monotonic()
        self.ctx = RolloutContext(target=opts.target, manifests_dir=Path(opts.manifests_dir),
                                  wait_idle=opts.wait_idle, force=opts.force,
                                  stop_containers=opts.stop_containers, reboot_timeout=opts.reboot_timeout,
                                  retune=opts.retune)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", file=self.out, flush=True)

    # --- entry point -------------------------------------------------------------------------

    def run(self) -> int:
        from deploys import upgrade as steps
        from .session import inventory_hosts, run_step

        opts = self.opts
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", opts.target):
            self.say(f"error: --driver-version {opts.target!r} is not a driver version such as 580.126.09")
            return EXIT_USAGE
        branch = opts.target.split(".")[0]
        known = compat_data().driver_branches.get(branch)
        if known is None:
            self.say(f"error: driver branch R{branch} is not in the compatibility data")
            return EXIT_USAGE
        if opts.target not in known.versions:
            self.say(f"warning: {opts.target} is not listed in gpufleet/data/compat.yaml for R{branch} "
                     f"(listed: {', '.join(known.versions)}); the repositories decide whether it exists")
        hosts = inventory_hosts(opts.inventory)
        unknown = sorted(set(opts.skip) - set(hosts))
        if unknown:
            self.say(f"error: --skip names hosts not in the inventory: {', '.join(unknown)}")
            return EXIT_USAGE
        state_path = opts.state_path or default_state_path(opts.inventory)
        try:
            self.state = RolloutState.load(state_path, opts.target, opts.inventory)
        except Exception as exc:
            self.say(f"error: {exc}")
            return EXIT_USAGE
        state = self.state

        self.say(f"surveying {len(hosts)} host(s) of {opts.inventory}")
        survey = run_step(opts.inventory, hosts, steps.survey_host, self.ctx, reasons=self.ctx.reasons)
        info = self.ctx.survey
        unreachable = dict(survey.failed)

        # who takes part
        eligible: list[str] = []
        notes: dict[str, str] = {}
        for name in hosts:
            if name in unreachable:
                notes[name] = f"not surveyed: {unreachable[name]}"
                continue
            if info[name]["driver_source"] != "nvidia":
                notes[name] = f"driver_source is {info[name]['driver_source']}: not upgraded by tools/rollout"
                continue
            eligible.append(name)
        for name in eligible:
            rec = state.host(name)
            if rec.status == "skipped" and name not in opts.skip:
                rec.status = "pending" if not rec.steps else "failed"
        # batches: kept from the first run of this rollout, so a re-run resumes the same plan
        try:
            size = plan.batch_size_for(len(eligible), opts.batch_size, opts.batch_percent,
                                       min([info[n]["batch_size"] for n in eligible] or [1]))
            max_fail = plan.parse_max_fail(opts.max_fail, len(eligible))
        except plan.PlanError as exc:
            self.say(f"error: {exc}")
            return EXIT_USAGE
        max_unavailable = opts.max_unavailable or max(size, opts.canary, 1)
        assigned = {n: state.hosts[n].batch for n in eligible if n in state.hosts and state.hosts[n].batch is not None}
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
        if not opts.dry_run:
            state.runs.append({"started": time.time(), "options": {
                "canary": opts.canary, "batch_size": size, "max_unavailable": max_unavailable,
                "max_fail": max_fail, "skip": opts.skip, "force": opts.force}})
            state.save()

        self.print_plan(batches, notes, size, max_unavailable, max_fail)
        if opts.dry_run:
            return EXIT_DONE

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
                failed_here = [n for n in batch.hosts if state.host(n).status == "failed"]
                stopped = plan.stop_reason(batch, failed_here, len(state.failed()), max_fail)
        if stopped:
            self.say(f"STOPPED: {stopped}")
        code = self.print_summary(eligible, notes, stopped)
        state.runs[-1].update(finished=time.time(), exit=code, stopped=stopped,
                              wall_seconds=round(time.monotonic() - self.t0, 1))
        state.save()
        return code

    # --- one wave ----------------------------------------------------------------------------

    def run_wave(self, batch: plan.Batch, wave: list[str]) -> None:
        from deploys import upgrade as steps
        from .session import run_step

        state, ctx = self.state, self.ctx
        self.say(f"[{batch.name}] starting {', '.join(wave)}")
        for name in wave:
            rec = state.host(name)
            if rec.manifest and Path(rec.manifest).exists():
                ctx.manifests[name] = steps.load_manifest(rec.manifest)
        todo = {name: state.host(name).steps_to_run() for name in wave}
        active = list(wave)
        funcs: dict[str, Callable] = {"drain": steps.drain, "snapshot": steps.snapshot, "upgrade": steps.upgrade,
                                      "reboot": steps.reboot, "tune": steps.tune, "validate": steps.validate,
                                      "undrain": steps.undrain}
        give_back: list[str] = []
        for step in STEPS:
            names = [n for n in active if step in todo[n]]
            if not names:
                continue
            for n in names:
                state.start(n, step)
            t = time.monotonic()
            result = run_step(self.opts.inventory, names, funcs[step], ctx, reasons=ctx.reasons)
            took = time.monotonic() - t
            for n in result.ok:
                msg = ""
                if step == "snapshot":
                    state.host(n).manifest = ctx.manifest_paths.get(n)
                    msg = f"manifest {ctx.manifest_paths.get(n)}"
                    disk = (ctx.manifests.get(n) or {}).get("disk_snapshot")
                    if disk:
                        msg += f", {disk.get('provider')} snapshot {disk.get('name')}"
                status = "done" if step == "undrain" else None
                state.finish(n, step, True, msg or f"{step} ok", status=status)
                self.say(f"[{batch.name}] {n}: {step} ok ({took:.1f}s){' ' + msg if msg else ''}")
            for n, why in result.failed.items():
                outcome = ctx.outcomes.pop(n, None)
                ctx.reasons.pop(n, None)
                if outcome == "busy" or (step == "drain" and ("Wait for running GPU processes" in why
                                                             or "Wait for the Slurm jobs" in why)):
                    state.finish(n, step, False, why, status="busy")
                    give_back.append(n)
                elif outcome == "reboot-pending":
                    state.finish(n, step, False, why, status="reboot-pending")
                else:
                    state.finish(n, step, False, f"{step} failed: {why}")
                    if step not in CHANGING_STEPS:
                        give_back.append(n)
                self.say(f"[{batch.name}] {n}: {step} {'FAILED' if state.host(n).status == 'failed' else state.host(n).status.upper()} "
                         f"({took:.1f}s): {why}")
                active.remove(n)
        if give_back:
            # nothing changed on these: give them back to the scheduler
            result = run_step(self.opts.inventory, give_back, steps.undrain, ctx, reasons=ctx.reasons)
            for n in result.ok:
                self.say(f"[{batch.name}] {n}: nothing changed, back in service")

    # --- output ------------------------------------------------------------------------------

    def print_plan(self, batches: list[plan.Batch], notes: dict[str, str], size: int, max_unavailable: int,
                   max_fail: int) -> None:
        info, target = self.ctx.survey, self.opts.target
        lines = [f"{'DRY RUN: ' if self.opts.dry_run else ''}rollout of driver {target}: "
                 f"{sum(len(b.hosts) for b in batches)} host(s), canary {len(batches[0].hosts) if batches and batches[0].index == 0 else 0}, "
                 f"batch size {size}, max_unavailable {max_unavailable}, max_fail {max_fail}"]
        header = f"  {'batch':<8} {'host':<22} {'from (loaded/installed)':<26} {'to':<11} {'reboot':<28} {'GPU jobs':<22} {'snapshot':<9} state"
        lines.append(header)
        for b in batches:
            for n in b.hosts:
                s = info[n]
                rec = self.state.host(n)
                frm = f"{s['loaded'] or '-'}/{s['installed'] or '-'}"
                if s["loaded"] == target and s["installed"] == target:
                    reboot = "no (at target)"
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
                moving = s["moving"]
                if moving:
                    missing = [p for p in moving if not s["available"].get(p)]
                    lines.append(f"  {'':<8}   packages: {' '.join(moving)}"
                                 + (f" (no {target} candidate yet for: {' '.join(missing)}; the drain step refreshes the index)"
                                    if missing else ""))
                if s["inventory_driver_version"] not in ("auto", target):
                    lines.append(f"  {'':<8}   note: the inventory pins driver_version {s['inventory_driver_version']}: "
                                 f"change it to {target}, or deploys/all.py will put it back")
        for n, why in notes.items():
            lines.append(f"  {'-':<8} {n:<22} not in the rollout: {why}")
        for line in lines:
            print(line, file=self.out, flush=True)

    def print_summary(self, eligible: list[str], notes: dict[str, str], stopped: str | None) -> int:
        state = self.state
        print(f"rollout of {self.opts.target}: {time.monotonic() - self.t0:.1f}s wall", file=self.out)
        for n in eligible:
            rec = state.host(n)
            times = " ".join(f"{s}={rec.steps[s].get('seconds', '?')}s" for s in STEPS if s in rec.steps)
            print(f"  {n:<22} {rec.status:<15} {rec.message[:160]}", file=self.out)
            if times:
                print(f"  {'':<22}   {times}", file=self.out)
        print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(state.summary().items())), file=self.out, flush=True)
        if stopped:
            return EXIT_STOPPED
        if all(state.host(n).status in ("done", "skipped") for n in eligible):
            return EXIT_DONE
        return EXIT_INCOMPLETE
