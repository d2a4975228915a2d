"""tools/health (gpufleet-health): which GPU to pull, and what to do with it.

    tools/health INVENTORY [--limit PATTERN] [--data KEY=VALUE] [--config FILE] [--json] [--workers N]
                           [--burn-in | --diag LEVEL] [--slurm]
    tools/health --local [--nvlink required|any|absent] [--burn-in | --diag LEVEL] [--slurm]
    tools/health INVENTORY --history HOST [--json]

Fleet: reads every host of the inventory at once, read-only (one remote command per host: the
GpuHealth fact), and prints one line per finding with its class and fix, or `--json`:
{"hosts": [{"name", "status", "worst", "error", "findings", "gpus": [{"index", "bus_id", "name",
"worst", "findings": [{"check", "class", "detail", "fix"}]}]}]}. Exit 0 only when every host was
read and nothing needs action (class reset or worse), 1 otherwise, 2 on usage errors.

`--diag LEVEL` adds DCGM's diagnostic (`dcgmi diag -r LEVEL -j`, facts/dcgm_diag.py) to the
reading, its failures classed by the severity DCGM gives them; `--burn-in` is `--diag 3`, DCGM's
long hardware run (about 15 minutes) for a new host before it takes jobs. Levels 2 and 3 load
the GPUs: on a host where GPU work runs they run nothing and say so. With a diagnostic asked
for, a host whose diagnostic did not pass (failed, busy, no DCGM) also exits 1.

Local (`--local`, on the node itself, as root): the same reading and verdict, one line on stdout,
exit 0 when nothing needs action, 1 when something does: Slurm's HealthCheckProgram. With
`--json`, the fleet form's object with this one host (named by its host name) instead.

`--history HOST` prints the journal of that host's health watch (deploys/health_watch.py): what
the node saw, when, its class and what it did, oldest first.

`--slurm` (either way) is the one change it makes: it drains a host's Slurm node when its worst
class is drain or worse (reason "gpufleet health: <the finding>"), and resumes a node only when
gpufleet health drained it and the check passes again.
"""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from typing import Any

from gpufleet.facts.dcgm_diag import LEVEL_TIMEOUTS, DcgmDiag, DcgmDiagData
from gpufleet.facts.health import GpuHealth, GpuHealthData
from gpufleet.facts.slurm import SlurmNode, SlurmNodeData
from gpufleet.plans.health import HostVerdict, all_findings, assess, rank, summary_line
from gpufleet.version import add_version

#: the reason gpufleet health drains a node with: it resumes only nodes whose reason starts so
SLURM_REASON = "gpufleet health: "
NVLINK = ("required", "any", "absent")


def verdict_json(name: str, verdict: HostVerdict | None, row: dict[str, Any]) -> dict[str, Any]:
    if verdict is None:
        return {"name": name, "status": row["status"], "worst": None, "error": row.get("error"), "findings": [],
                "gpus": []}
    out: dict[str, Any] = {
        "name": name, "status": "ok", "worst": verdict.worst, "error": None,
        "findings": [f.as_json() for f in verdict.host_findings],
        "gpus": [{"index": g.index, "bus_id": g.bus_id, "name": g.name, "worst": g.worst,
                  "findings": [f.as_json() for f in g.findings]} for g in verdict.gpus]}
    if verdict.diag_status:
        out["diagnostic"] = {"level": row.get("diag_level"), "status": verdict.diag_status,
                             "detail": verdict.diag_detail}
    return out


def needs_attention(verdict: HostVerdict | None) -> bool:
    """Exit 1 for this host: not read, a finding that needs action, or a diagnostic asked for
    that did not pass."""
    return verdict is None or verdict.needs_action or verdict.diag_status not in ("", "pass")


def diag_line(verdict: HostVerdict, level: int | None) -> str:
    if not verdict.diag_status:
        return ""
    said = f": {verdict.diag_detail}" if verdict.diag_detail else ""
    return f"DCGM diagnostic level {level}: {verdict.diag_status}{said}"


def table(hosts: list[tuple[str, HostVerdict | None, dict[str, Any]]]) -> str:
    """One line per finding (a healthy host is one line): host, GPU, class, what, fix."""
    lines = [("HOST", "GPU", "CLASS", "FINDING", "FIX")]
    for name, verdict, row in hosts:
        if verdict is None:
            lines.append((name, "-", row["status"], row.get("error") or "", "bring the host back and re-run"))
            continue
        found = [(g, f) for g, f in all_findings(verdict)]
        if verdict.diag_status and verdict.diag_status != "fail":
            lines.append((name, "-", "diag", diag_line(verdict, row.get("diag_level")),
                          "" if verdict.diag_status == "pass" else "run it again once the host is idle and DCGM "
                                                                   "runs (deploys/monitoring.py installs it)"))
        if not found:
            lines.append((name, "-", "ok", f"{len(verdict.gpus)} GPU(s) healthy", ""))
        for gpu, finding in sorted(found, key=lambda pair: -rank(pair[1].cls)):
            lines.append((name, f"{gpu.index} {gpu.bus_id}" if gpu else "-", finding.cls, finding.detail, finding.fix))
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(widths[i]) if i < 4 else cell for i, cell in enumerate(line)).rstrip()
                     for line in lines)


def fleet_main(args: argparse.Namespace) -> int:
    import gpufleet.deploys
    from gpufleet.controller import inventory_source
    from gpufleet.controller.fleet_read import connected_fleet, read_each
    from gpufleet.config.settings import host_settings

    source = inventory_source.InventorySource.from_args(args)
    verdicts: dict[str, HostVerdict] = {}

    def read(host: Any) -> dict[str, Any]:
        settings = host_settings(host)
        health = host.get_fact(GpuHealth)
        diag = host.get_fact(DcgmDiag, level=args.diag) if args.diag else None
        verdict = verdicts[host.name] = assess(health, nvlink=settings.validate_nvlink, diag=diag)
        row: dict[str, Any] = {"status": "ok", "state": verdict.worst, "diag_level": args.diag}
        if args.slurm:
            row["slurm"] = slurm_step(host, verdict, settings.rollout_slurm_node_name)
        return row

    def progress(name: str, status: str, seconds: float) -> None:
        if not args.quiet:
            print(f"{name}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)

    import logging

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)
    # one fact per host: no prefetch of the deploy's plan (and the deploy's plan is left as it is)
    with connected_fleet(source, args.workers, gpufleet.deploys.FOLDER.parent, prefetch=False) as fleet:
        rows = read_each(fleet, read, args.workers, progress)
        names = [h.name for h in fleet.hosts]
    hosts = [(n, verdicts.get(n) if rows[n]["status"] == "ok" else None, rows[n]) for n in names]
    failed_slurm = [n for n, v, r in hosts if (r.get("slurm") or "").startswith("failed")]
    if args.json:
        print(json.dumps({"hosts": [{**verdict_json(n, v, r), **({"slurm": r.get("slurm")} if args.slurm else {})}
                                    for n, v, r in hosts]}, indent=1))
    else:
        print(table(hosts))
        act = [n for n, v, _ in hosts if needs_attention(v)]
        for n, _, r in hosts:
            if r.get("slurm"):
                print(f"{n}: Slurm: {r['slurm']}")
        print(f"\n{len(hosts)} host(s), {len(act)} need action" + (f": {', '.join(act)}" if act else ""))
    return 0 if not any(needs_attention(v) for _, v, _ in hosts) and not failed_slurm else 1


def slurm_step(host: Any, verdict: HostVerdict, node_name: str) -> str:
    """Drain or resume the host's Slurm node as the verdict asks (slurm_action), on the host, with
    the host's own privileges (its sudo); what was done, in words."""
    from pyinfra.api import QuoteString, StringCommand

    node = host.get_fact(SlurmNode, node=node_name)
    if not node.scontrol:
        return ""
    if node.error:
        return f"failed: {node.error}"
    action = slurm_action(verdict, node)
    if not action:
        return f"{node.node}: {node.state or 'unknown'}, nothing to change"
    from gpufleet import pyinfra_private

    # with the privileges pyinfra gives the host's facts (its sudo, its password): scontrol needs root
    executor = pyinfra_private.fact_executor_arguments(host.state, host, SlurmNode)
    # each word quoted: the reason is a finding's text (a GPU name, parentheses)
    ok, output = host.run_shell_command(StringCommand(*(QuoteString(word) for word in action)),
                                        print_output=False, print_input=False, **executor)
    what = "drained" if "State=DRAIN" in action else "resumed"
    if not ok:
        return f"failed: could not set {node.node} {what}: " + " ".join(output.stderr_lines)[:200]
    return f"{node.node} {what}"


def _run(command: str) -> list[str]:
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False).stdout.splitlines()


def read_local() -> GpuHealthData:
    """The GpuHealth fact's own command, run here."""
    return GpuHealth().process(_run(GpuHealth().command()))


def diag_local(level: int) -> DcgmDiagData:
    """The DcgmDiag fact's own command, run here."""
    return DcgmDiag().process(_run(DcgmDiag().command(level=level).get_raw_value()))


def slurm_action(verdict: HostVerdict, node: SlurmNodeData) -> list[str] | None:
    """The scontrol command the verdict asks for on this Slurm node, or None: drain when the
    worst class is drain or worse (unless it is drained already); resume when nothing needs action
    and gpufleet health drained it."""
    if not node.scontrol or node.error:
        return None
    if rank(verdict.worst) >= rank("drain"):
        if node.drain_set:
            return None
        reason = (SLURM_REASON + summary_line(verdict))[:250]
        return [node.scontrol, "update", f"NodeName={node.node}", "State=DRAIN", f"Reason={reason}"]
    if not verdict.needs_action and node.drain_set and node.reason.startswith(SLURM_REASON):
        return [node.scontrol, "update", f"NodeName={node.node}", "State=RESUME"]
    return None


def local_main(args: argparse.Namespace) -> int:
    """The node itself: one line (Slurm's HealthCheckProgram reads it), or with --json the fleet
    form's object for this one host (its name: the node's host name)."""
    verdict = assess(read_local(), nvlink=args.nvlink, diag=diag_local(args.diag) if args.diag else None)
    if not args.json:
        print(summary_line(verdict) + (f"; {diag_line(verdict, args.diag)}" if verdict.diag_status else ""))
    slurm, failed = "", False
    if args.slurm:
        node = SlurmNode().process(_run(SlurmNode().command()))
        action = slurm_action(verdict, node)
        slurm = "nothing to do"
        if action:
            done = subprocess.run(action, capture_output=True, text=True, check=False)
            what = "drained" if "State=DRAIN" in action else "resumed"
            if done.returncode != 0:
                failed = True
                slurm = f"failed: could not set Slurm node {node.node} {what}: {(done.stderr or done.stdout).strip()}"
                print(f"gpufleet health: {slurm.removeprefix('failed: ')}", file=sys.stderr)
            else:
                slurm = f"Slurm node {node.node} {what}"
                if not args.json:
                    print(f"gpufleet health: {slurm}")
    if args.json:
        row = {"status": "ok", "diag_level": args.diag}
        host = {**verdict_json(socket.gethostname(), verdict, row), **({"slurm": slurm} if args.slurm else {})}
        print(json.dumps({"hosts": [host]}, indent=1))
    return 1 if failed or needs_attention(verdict) else 0


def build_parser(prog: str = "health") -> argparse.ArgumentParser:
    from gpufleet.controller import inventory_source
    from gpufleet.apps.exits import epilog

    parser = argparse.ArgumentParser(prog=prog, epilog=epilog("gpufleet-health"), description=(
        "Which GPU to pull, and what to do with it: every host of an inventory read at once, read-only, "
        "or this node (--local), one line per finding with its class and fix."))
    parser.add_argument("inventory", nargs="?", help="pyinfra inventory file (as given to pyinfra)")
    parser.add_argument("--local", action="store_true", help="check this node (as root), not an inventory")
    parser.add_argument("--nvlink", choices=NVLINK, default="any",
                        help="--local: the NVLink the node must have (the tier's validate_nvlink)")
    parser.add_argument("--slurm", action="store_true",
                        help="drain a host's Slurm node at class drain or worse, resume it once healthy (only "
                             "nodes gpufleet health drained); the one change this tool makes")
    parser.add_argument("--diag", type=int, choices=[0, *sorted(LEVEL_TIMEOUTS)], metavar="LEVEL",
                        help="also run DCGM's diagnostic at this level (1 seconds, 2 about 2 min, 3 about 15 min; "
                             "2 and 3 only on idle GPUs; 0: none, with --burn-in)")
    parser.add_argument("--burn-in", action="store_true",
                        help="the acceptance a host passes before it takes jobs (docs/acceptance.md): DCGM's long "
                             "diagnostic (level 3, or --diag), the performance probe, GPU health, an all-reduce with "
                             "--peer (or the first host) and the InfiniBand/RoCE ports; --local: the diagnostic only")
    parser.add_argument("--peer", metavar="HOST",
                        help="--burn-in: a known-good host of the inventory to run the all-reduce with")
    parser.add_argument("--history", metavar="HOST",
                        help="print the health watch's journal of this host of the inventory (deploys/health_watch.py)")
    parser.add_argument("--json", action="store_true", help="JSON instead of the table")
    parser.add_argument("--workers", type=int, default=20, help="hosts read at once (default 20)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    inventory_source.add_arguments(parser)
    add_version(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "health") -> int:
    from gpufleet.controller import inventory_source

    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.burn_in and args.diag is None:
        args.diag = 3
    args.diag = args.diag or None   # 0: no diagnostic
    if args.local:
        if args.inventory:
            parser.error("--local checks this node: give no inventory")
        return local_main(args)
    if not args.inventory:
        parser.error("give an inventory, or --local")
    from pathlib import Path

    if not Path(args.inventory).is_file():
        parser.error(f"no such inventory file: {args.inventory}")
    if not 1 <= args.workers <= 1000:
        parser.error(f"--workers {args.workers} out of range: allowed 1 to 1000")
    try:
        source = inventory_source.InventorySource.from_args(args)
        source.config()
        if not source.hosts(source.load()):
            parser.error(f"the inventory {args.inventory} has no hosts: nothing to check")
    except inventory_source.SourceError as exc:
        parser.error(str(exc))
    if args.history:
        return history_main(args)
    return burn_in_main(args, source) if args.burn_in else fleet_main(args)


def burn_in_main(args: argparse.Namespace, source: Any) -> int:
    """The acceptance of the inventory's hosts (--limit: one host or a group), with the JSON of
    tools/rollout's acceptance step: {"hosts": [{"host", "status", "findings": [...]}]}."""
    from gpufleet.apps.acceptance import accept

    names = [h.name for h in source.hosts(source.load())]
    if args.peer and args.peer in names:
        names.remove(args.peer)
    if not names:
        print("error: no host to accept but the peer", file=sys.stderr)
        return 2
    import logging

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)   # stdout is the JSON's (as fleet_main)
    say = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    verdicts = accept(source, names, args.peer, say=say, diag_level=args.diag or 0)
    if args.json:
        print(json.dumps({"hosts": [v.to_json() for v in verdicts.values()]}, indent=1))
    else:
        for name, verdict in verdicts.items():
            print(f"{name}: {'ACCEPTED' if verdict.passed else 'NOT ACCEPTED'}")
            for finding in verdict.findings:
                print(f"  {finding.line()}")
    return 0 if all(v.passed for v in verdicts.values()) else 1


def history_main(args: argparse.Namespace) -> int:
    """The journal of one host's health watch, oldest first (one remote command, with the host's sudo:
    the journal is root's)."""
    import gpufleet.deploys
    from gpufleet.controller import inventory_source
    from gpufleet.controller.fleet_read import connected_fleet, read_each
    from gpufleet.facts.health import HealthJournal
    from gpufleet.plans.health_watch import parse_journal

    args.limit = [args.history]
    source = inventory_source.InventorySource.from_args(args)
    events: dict[str, list[Any]] = {}

    def read(host: Any) -> dict[str, Any]:
        events[host.name] = parse_journal(host.get_fact(HealthJournal))
        return {"status": "ok"}

    import logging

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)
    with connected_fleet(source, 1, gpufleet.deploys.FOLDER.parent, prefetch=False) as fleet:
        names = [h.name for h in fleet.hosts if h.name == args.history]
        if not names:
            print(f"health: no host {args.history} in {args.inventory}", file=sys.stderr)
            return 2
        rows = read_each(fleet, read, 1, lambda *_: None)
    if rows[args.history]["status"] != "ok":
        print(f"health: {args.history}: {rows[args.history].get('error') or rows[args.history]['status']}",
              file=sys.stderr)
        return 1
    found = events.get(args.history, [])
    if args.json:
        print(json.dumps({"host": args.history, "events": [json.loads(e.as_json()) for e in found]}, indent=1))
        return 0
    import time

    for e in found:
        where = f"GPU {e.gpu} ({e.bus_id})" if e.gpu is not None else (e.bus_id or "node")
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.time))}  {e.cls:<7}  {e.action:<7}  {where}  "
              f"{e.check}: {e.reason}" + (f" [{e.detail}]" if e.detail else ""))
    if not found:
        print(f"{args.history}: no event in the health watch's journal (health_watch off, or nothing seen yet)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
