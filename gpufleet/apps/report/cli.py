"""tools/fleet-report INVENTORY [--limit PATTERN] [--data KEY=VALUE] [--config FILE] [--out DIR] [--workers N]
                    [--no-drift] [--probe] [--wide]

Gathers facts from every host of a pyinfra inventory in parallel (progress on stderr), prints
the fleet table (160 columns at most, the hosts that need attention first; every column with
--wide), and writes fleet-report.{json,md,html} to --out (default: reports/). Exit code
0 when every host was reached and passes validation, 1 otherwise (each host not reached or not
read named on stderr), 2 on usage errors (an inventory with no host among them).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gpufleet.controller import inventory_source
from gpufleet.config.failures import stop_line
from gpufleet.apps.exits import epilog
from gpufleet.version import add_version


def build_parser(prog: str = "fleet-report") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, epilog=epilog("gpufleet-report"), description=(
        "The fleet at a glance: facts from every host of a pyinfra inventory, read in parallel (progress on "
        "stderr), as a table (160 columns at most, the hosts that need attention first; every column with "
        "--wide) and as fleet-report.{json,md,html} in --out."))
    parser.add_argument("inventory", help="pyinfra inventory file (as given to pyinfra)")
    parser.add_argument("--out", default="reports", help="directory for fleet-report.{json,md,html}")
    parser.add_argument("--workers", type=_workers, default=20, help="hosts gathered at once (default 20)")
    parser.add_argument("--no-drift", action="store_true",
                        help="skip planning the all area (the drift column stays empty)")
    parser.add_argument("--probe", action="store_true",
                        help="also run the DCGM and performance probes where installed")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--wide", action="store_true",
                        help="every column in full (kernel, holds, clocks, firewall, SSH, endpoints, each check's "
                             "wording), in inventory order; default: a table of at most 160 columns")
    inventory_source.add_arguments(parser)
    add_version(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "fleet-report") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not Path(args.inventory).is_file():
        parser.error(f"no such inventory file: {args.inventory}")
    try:
        source = inventory_source.InventorySource.from_args(args)
        source.config()
        count = len(source.hosts(source.load()))
    except inventory_source.SourceError as exc:
        parser.error(str(exc))
    if not count:
        parser.error(f"the inventory {args.inventory} has no hosts: nothing to report")

    import logging

    from gpufleet.apps.report.gather import Progress, gather
    from gpufleet.apps.report.render import document, terminal, write_all

    logging.getLogger("pyinfra").setLevel(logging.CRITICAL)  # the report says it all
    start = time.monotonic()
    progress = None if args.quiet else Progress(total=count)
    rows = gather(source, workers=args.workers, drift=not args.no_drift, probe=args.probe,
                  progress=progress)
    doc = document(rows, args.inventory, time.monotonic() - start)
    print(terminal(doc, wide=args.wide))
    paths = write_all(doc, Path(args.out))
    print("written: " + ", ".join(str(p) for p in paths.values()))
    lost = [r for r in rows if r["status"] in ("unreachable", "error")]
    for r in lost:
        print(stop_line(r["host"], "failed", "report",
                        f"{'not reached' if r['status'] == 'unreachable' else 'not read'}: {r.get('error') or '?'}",
                        "bring the host back (or correct its ssh_* data in the inventory) and re-run"
                        if r["status"] == "unreachable" else "run with the host alone (--limit) to see why"),
              file=sys.stderr)
    if lost:
        print(f"fleet-report: {len(lost)} of {len(rows)} host(s) not reported: "
              f"{', '.join(r['host'] for r in lost)}", file=sys.stderr)
    healthy = bool(rows) and all(r["state"] == "provisioned" for r in rows)
    return 0 if healthy else 1


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{value} out of range: allowed 1 to 1000")
    return value


if __name__ == "__main__":
    sys.exit(main())
