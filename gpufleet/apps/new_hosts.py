"""A new host earns its way into service: the acceptance after its first converge.

`gpufleet-deploy INVENTORY` runs deploys/all.py, then `accept_new_hosts` on the hosts all.py left
converged: each host's record (facts/acceptance.py) says whether it is accepted for the driver
and CUDA toolkit it has now; those that are not run `accept()` (gpufleet/apps/acceptance.py) with
an accepted host of the inventory as their known-good peer, or, where there is none yet, with
each other (the first of them the reference: said, a WARN). A pass writes the record; a failure
drains the host (its Slurm node, as the rollout's failed acceptance leaves it), names it with the
measurement and the fix, and the command's exit code says so. An accepted host is not accepted
again: a re-run of all.py costs it one fact.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

from pyinfra import host

from gpufleet.controller.inventory_source import InventorySource
from gpufleet.facts.acceptance import AcceptanceRecord
from gpufleet.plans import acceptance as plan

#: The Slurm drain reason of a host that failed its acceptance (starts with SLURM_REASON_TAG)
DRAIN_REASON = "gpufleet acceptance failed"


@dataclasses.dataclass
class HostStanding:
    name: str
    standing: plan.Standing | None = None
    enabled: bool = True        # acceptance_new_host
    error: str = ""             # not read


@dataclasses.dataclass
class Outcome:
    accepted: list[str] = dataclasses.field(default_factory=list)
    failed: dict[str, str] = dataclasses.field(default_factory=dict)   # host -> summary with its fix
    already: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  # host -> why not accepted


def read_standings(source: InventorySource, names: list[str]) -> dict[str, HostStanding]:
    """{host: its standing}: one fact per host (the record and the driver and CUDA it has now)."""
    from gpufleet import deploys
    from gpufleet.config.settings import host_settings
    from gpufleet.controller.fleet_read import connected_fleet, read_each

    out = {name: HostStanding(name) for name in names}
    if not names:
        return out
    src = dataclasses.replace(source, limit=list(names), exclude=[])
    with connected_fleet(src, len(names), Path(deploys.FOLDER).parent, prefetch=False) as fleet:
        def read(h: Any) -> dict[str, Any]:
            out[h.name].enabled = host_settings(h).acceptance_new_host
            out[h.name].standing = plan.standing(h.get_fact(AcceptanceRecord))
            return {"status": "ok"}

        rows = read_each(fleet, read, len(names))
    for name, row in rows.items():
        if row.get("status") != "ok":
            out[name].error = str(row.get("error") or row.get("status") or "not read")
    return out


def record(verdicts: dict[str, plan.Verdict], peers: dict[str, str]) -> None:
    from gpufleet.explain import explained
    from gpufleet.operations.acceptance import acceptance_recorded

    acceptance_recorded(name=explained("Record the acceptance", "Record the passed acceptance on the host"),
                        verdict=verdicts[host.name], peer=peers.get(host.name, ""))


def drain() -> None:
    from gpufleet.config.settings import host_settings
    from gpufleet.explain import explained
    from gpufleet.operations.drain import slurm_node

    slurm_node(name=explained("Drain the Slurm node", "Drain the Slurm node: its acceptance failed"),
               drained=True, reason=DRAIN_REASON, node=host_settings(host).rollout_slurm_node_name)


def peers_of(names: list[str], peer: str | None) -> dict[str, str]:
    """{host: the host its all-reduce ran with} as accept() pairs them: the known-good `peer`, or
    without one the first of `names` (which itself ran with none: "")."""
    return {n: peer or ("" if n == names[0] else names[0]) for n in names} if names else {}


def record_passed(source: InventorySource | str, verdicts: dict[str, plan.Verdict], peers: dict[str, str]
                  ) -> dict[str, str]:
    """Write the record on each host whose acceptance passed; {host: why} of those not written."""
    from gpufleet.apps.rollout.session import run_step

    passed = [n for n, v in verdicts.items() if v.passed]
    return run_step(source, passed, record, verdicts, peers).failed if passed else {}


def reference_judged(verdicts: dict[str, plan.Verdict], names: list[str], peer: str | None
                     ) -> dict[str, plan.Verdict]:
    """Without a known-good peer the group pairs with its first host, whose own all-reduce is
    not judged: it is proven only by a partner whose all-reduce with it passed. When every
    partner failed, the fault may well be the reference's own (its firewall, its route): it
    fails too, rather than be the one host accepted."""
    if peer or len(names) < 2 or names[0] not in verdicts:
        return verdicts
    ref = names[0]
    proven = [n for n in names[1:] if n in verdicts and any(
        f.name == plan.ALLREDUCE and f.status == plan.PASS for f in verdicts[n].findings)]
    if proven or not verdicts[ref].passed:
        return verdicts
    unproven = plan.Finding(plan.ALLREDUCE, plan.FAIL, f"the reference of its group: no partner's all-reduce with it "
                                                       f"passed ({', '.join(names[1:])})", plan.FIX_PEERS)
    return {**verdicts, ref: plan.verdict(ref, verdicts[ref].findings, [unproven])}


def accept_new_hosts(source: InventorySource, names: list[str], say: Callable[[str], None]) -> Outcome:
    """The acceptance of those of `names` (converged hosts) that are not accepted (see the module)."""
    from gpufleet.apps.acceptance import accept
    from gpufleet.apps.rollout.session import run_step
    from gpufleet.controller.inventory_source import limited_names

    from gpufleet.controller import hostlock, staging

    hostlock.install()  # the record and the drain take the host's lock, as all.py's changes do
    staging.install()
    outcome = Outcome()
    standings = read_standings(source, names)
    todo = []
    for name in names:
        found = standings[name]
        if found.error:
            outcome.skipped[name] = f"not read ({found.error})"
        elif not found.enabled:
            outcome.skipped[name] = "acceptance_new_host: false (left in service unaccepted)"
        elif found.standing is not None and found.standing.accepted:
            outcome.already.append(name)
        else:
            todo.append(name)
            say(f"{name}: not accepted: {found.standing.why if found.standing else 'unknown'}")
    for name, why in outcome.skipped.items():
        say(f"{name}: acceptance skipped: {why}")
    if outcome.already:
        say(f"accepted already, not accepted again: {', '.join(outcome.already)}")
    if not todo:
        return outcome
    peer = outcome.already[0] if outcome.already else None
    if peer is None:
        whole = dataclasses.replace(source, limit=[], exclude=[])
        others = [n for n in limited_names(whole) if n not in names]
        elsewhere = read_standings(source, others) if others else {}
        peer = next((n for n in others if (elsewhere[n].standing or plan.Standing(False)).accepted), None)
    if peer:
        say(f"acceptance of {', '.join(todo)} with known-good peer {peer}")
    else:
        say(f"[WARN] acceptance of {', '.join(todo)}: no known-good peer (no host of the inventory is accepted): "
            f"the new hosts pair with {todo[0]}, the first of them")
    verdicts = reference_judged(accept(source, todo, peer, say=say), todo, peer)
    for name, verdict in verdicts.items():
        for finding in verdict.findings:
            if finding.status != plan.PASS:
                say(f"{name}: {finding.line()}")
    unrecorded = record_passed(source, verdicts, peers_of(todo, peer))
    for name, verdict in verdicts.items():
        if not verdict.passed:
            outcome.failed[name] = verdict.summary()
        elif name in unrecorded:
            outcome.failed[name] = f"accepted, but its record was not written: {unrecorded[name]}"
        else:
            outcome.accepted.append(name)
            say(f"{name}: {verdict.summary()}; recorded")
    if outcome.failed:
        drained = run_step(source, sorted(outcome.failed), drain)
        for name, why in sorted(outcome.failed.items()):
            if name in drained.failed:
                state = f"its Slurm node NOT drained ({drained.failed[name]})"
            elif drained.changed.get(name):
                state = f"its Slurm node drained ({DRAIN_REASON})"
            else:
                state = "no Slurm node to drain; not accepted (no record: the gate WARNs)"
            say(f"{name}: FAILED acceptance, {state}: {why}")
    return outcome
