"""`gpufleet-rollout --json`: the run as one JSON document on stdout (the progress lines go to
stderr): its batches, every host's outcome and step timings, the hosts left out and why, and
what is left to do. Built from the runner's state after the run, not from its printed lines."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufleet.rollout.state import STEPS

if TYPE_CHECKING:
    from .runner import Runner

FORMAT = 1
#: a host in one of these is finished for this rollout; any other status is left to do
SETTLED = ("done", "skipped")


def result_doc(runner: Runner, code: int) -> dict[str, Any]:
    opts = runner.opts
    state = getattr(runner, "state", None)   # None: the run stopped before it read its state file
    survey = runner.ctx.survey
    hosts: dict[str, Any] = {}
    for batch in runner.batches:
        for name in batch.hosts:
            rec = state.host(name) if state is not None else None
            seen = survey.get(name, {})
            hosts[name] = {
                "batch": batch.name,
                "status": "skip (--skip)" if runner.dry and name in opts.skip else (rec.status if rec else "pending"),
                "message": rec.message if rec else "",
                "target": runner.target_of(name),
                "stack": (rec.stack if rec else None) or {},
                "from": {"installed": seen.get("installed"), "loaded": seen.get("loaded")},
                "manifest": rec.manifest if rec else None,
                # measurements: each step's outcome and seconds, in the order the steps run
                "steps": {s: {k: rec.steps[s].get(k) for k in ("ok", "seconds", "message")}
                          for s in STEPS if rec and s in rec.steps},
                # the acceptance step's findings (gpufleet/plans/acceptance.py), when it ran this run
                "acceptance": getattr(runner, "acceptance", {}).get(name),
            }
    left = [n for n, h in hosts.items() if h["status"] not in SETTLED]
    return {
        "format": FORMAT,
        "command": opts.command,
        "target": opts.target or "inventory",
        "dry_run": runner.dry,
        "exit": code,
        "stopped": runner.stopped,
        "batches": [{"index": b.index, "name": b.name, "hosts": list(b.hosts)} for b in runner.batches],
        "hosts": hosts,
        "not_in_rollout": dict(runner.notes),
        "unreachable": dict(runner.unreachable),
        "left": left + [n for n in runner.unreachable if n not in left],
        "summary": state.summary() if state is not None else {},
    }
