"""Command lines of tools/rollout and tools/rollback."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable
from pathlib import Path

from gpufleet.controller import inventory_source
from gpufleet.rollout.progress import YES_ENV, env_yes
from gpufleet.apps.exits import epilog
from gpufleet.version import add_version


def _logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("    pyinfra: %(message)s"))
    log = logging.getLogger("pyinfra")
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.ERROR)
    log.propagate = False


def inventory_arg(text: str) -> str:
    """argparse type of an inventory argument: a path (anything with / or ending in .py) must be
    an existing file; a mistyped one would otherwise read as an empty fleet and "succeed"."""
    if ("/" in text or text.endswith(".py")) and not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such inventory file: {text}")
    return text


def count_arg(minimum: int, maximum: int = 1_000_000) -> Callable[[str], int]:
    """argparse type of an integer option with its bounds."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"{value} out of range: allowed {minimum} to {maximum}")
        return value
    parse.__name__ = "integer"
    return parse


def percent_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"{text} out of range: allowed more than 0 and at most 100")
    return value


def max_fail_arg(text: str) -> str:
    from gpufleet.rollout.plan import PlanError, parse_max_fail

    try:
        parse_max_fail(text, 100)
    except PlanError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check(parser: argparse.ArgumentParser, name: str, text: str, arg_type: Callable[[str], Any]) -> None:
    try:
        arg_type(text)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument {name}: {exc}")


def _yes_argument(parser: argparse.ArgumentParser, what: str, otherwise: str) -> None:
    parser.add_argument("-y", "--yes", action="store_true",
                        help=f"do not ask before {what} (also: {YES_ENV}=1, as for pyinfra); without it {otherwise}")


def _yes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """-y, or PYINFRA_YES as pyinfra reads it (a value it refuses is a usage error here too)."""
    try:
        return bool(args.yes) or env_yes(os.environ)
    except ValueError as exc:
        parser.error(str(exc))


def _source(parser: argparse.ArgumentParser, args: argparse.Namespace) -> inventory_source.InventorySource:
    """The inventory with --limit, --data and config.py (exit 2 on one that cannot be used)."""
    try:
        source = inventory_source.InventorySource.from_args(args)
        source.config()   # a config.py that fails to load stops here, not in the first step
    except inventory_source.SourceError as exc:
        parser.error(str(exc))
    return source


def rollout_parser(prog: str = "tools/rollout") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, epilog=epilog("gpufleet-rollout"), description=(
        "Rolling NVIDIA driver upgrade to what the inventory resolves for each host (as "
        "gpufleet-deploy does): canary first, then batches; drain, snapshot + manifest, unhold/upgrade/re-hold, reboot "
        "if needed, validate, undrain. Hosts there already are left alone. Re-run to resume."))
    p.add_argument("inventory", help="pyinfra inventory file, as for `gpufleet-deploy INVENTORY`")
    p.add_argument("--driver-version", help="override the inventory's driver, e.g. 580.126.09: resolved per host "
                                            "like the inventory's (refused where it does not fit); afterwards "
                                            "set it in the inventory as the run tells you")
    p.add_argument("--canary", type=int, default=1, help="hosts in the canary batch (default 1; 0 = none)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=count_arg(1), help="hosts per batch after the canary (default: rollout_batch_size)")
    size.add_argument("--batch-percent", type=percent_arg, help="hosts per batch as a percentage of the rollout's hosts")
    p.add_argument("--max-unavailable", type=count_arg(1), help="most hosts out of service at once (default: the batch size)")
    p.add_argument("--max-fail", type=max_fail_arg, default="0", help="stop when more hosts than this failed: a count or P%% (default 0)")
    p.add_argument("--state", type=Path, help="state file (default .gpufleet/rollouts/<inventory>.json)")
    p.add_argument("--manifests", type=Path, default=Path(".gpufleet/manifests"),
                   help="where manifests are copied on the controller (default .gpufleet/manifests)")
    p.add_argument("--skip", nargs="+", default=[], metavar="HOST", help="hosts to leave alone this run")
    p.add_argument("--force", action="store_true", help="upgrade hosts even while GPU processes run")
    p.add_argument("--wait-idle", type=count_arg(0, 7 * 86400), default=0, metavar="SECONDS",
                   help="wait up to SECONDS for running GPU processes to finish (default 0: refuse at once)")
    p.add_argument("--stop-gpu-containers", action="store_true", help="stop Docker containers using GPUs when draining")
    p.add_argument("--reboot-timeout", type=count_arg(1, 86400), default=600, metavar="SECONDS",
                   help="wait up to SECONDS for a rebooted host to answer again (default 600)")
    p.add_argument("--retune", action="store_true",
                   help="after the reboot apply the tier's tuning (the tuning area) instead of restoring the "
                        "persistence mode and clocks recorded in the manifest")
    p.add_argument("--dry-run", action="store_true", help="show batches, versions, reboots and GPU jobs; change nothing")
    _yes_argument(p, "draining", "a run without a terminal on stdin stops after its dry run")
    p.add_argument("--heartbeat", type=count_arg(0, 3600), default=30, metavar="SECONDS",
                   help="during a wave, a progress line with the time elapsed and left every SECONDS "
                        "(default 30; 0: none)")
    p.add_argument("--json", action="store_true",
                   help="the run's result as one JSON document on stdout (batches, each host's outcome and step "
                        "timings, the hosts left out, what is left); the progress lines go to stderr")
    p.add_argument("-v", "--verbose", action="store_true", help="show pyinfra's operation log")
    inventory_source.add_arguments(p)
    add_version(p)
    return p


def rollout_main(argv: list[str] | None = None, prog: str = "tools/rollout") -> int:
    p = rollout_parser(prog)
    args = p.parse_args(argv)
    # checked here rather than as argparse types on their lines, which tools/rollout's target
    # arguments share: the same message and exit code 2 as argparse's own
    _check(p, "inventory", args.inventory, inventory_arg)
    _check(p, "--canary", str(args.canary), count_arg(0))
    source = _source(p, args)
    _logging(args.verbose)
    from .runner import Options, Runner
    opts = Options(inventory=source, target=args.driver_version, canary=args.canary,
                   batch_size=args.batch_size, batch_percent=args.batch_percent,
                   max_unavailable=args.max_unavailable, max_fail=args.max_fail, state_path=args.state,
                   skip=args.skip, force=args.force, dry_run=args.dry_run, wait_idle=args.wait_idle,
                   stop_containers=args.stop_gpu_containers, manifests_dir=args.manifests,
                   reboot_timeout=args.reboot_timeout, retune=args.retune,
                   assume_yes=_yes(p, args), heartbeat=args.heartbeat,
                   command=f"{prog} {args.inventory}")
    if not args.json:
        return Runner(opts).run()
    import json

    from .result import result_doc

    import contextlib

    runner = Runner(opts, out=sys.stderr)
    with contextlib.redirect_stdout(sys.stderr):   # stdout holds the document and nothing else
        code = runner.run()
    print(json.dumps(result_doc(runner, code), indent=1, sort_keys=True), flush=True)
    return code


def rollback_parser(prog: str = "tools/rollback") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, epilog=epilog("gpufleet-rollback"), description=(
        "Put hosts back to the package versions, holds and /etc files of a manifest taken before an upgrade."))
    p.add_argument("inventory", type=inventory_arg,
                   help="pyinfra inventory file the hosts are in (the rollout's, or any that lists them)")
    p.add_argument("hosts", nargs="+", metavar="HOST", help="hosts to roll back, by their inventory names")
    p.add_argument("--manifest", type=Path, help="manifest file (default: the newest in --manifests/<host>/)")
    p.add_argument("--manifests", type=Path, default=Path(".gpufleet/manifests"),
                   help="where the rollout copied the manifests on the controller (default .gpufleet/manifests)")
    p.add_argument("--reboot", action="store_true", help="reboot to load the restored driver, then validate")
    p.add_argument("--force", action="store_true", help="even while GPU processes run")
    p.add_argument("--dry-run", action="store_true", help="show what would be restored and the disk snapshot")
    p.add_argument("--disk-snapshot", action="store_true",
                   help="also put the snapshotted btrfs subvolume back to the snapshot taken before the upgrade "
                        "(the current one is kept next to it)")
    _yes_argument(p, "restoring", "a run without a terminal on stdin stops after its dry run (--dry-run's check)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pyinfra's operation log")
    inventory_source.add_arguments(p, limit=False)   # the hosts are named
    add_version(p)
    return p


def rollback_main(argv: list[str] | None = None, prog: str = "tools/rollback") -> int:
    p = rollback_parser(prog)
    args = p.parse_args(argv)
    source = _source(p, args)
    _logging(args.verbose)
    from .rollback import rollback
    try:
        return rollback(source, args.hosts, args.manifest, args.manifests, args.reboot, args.force, args.dry_run,
                        from_disk=args.disk_snapshot, assume_yes=_yes(p, args), prog=prog)
    except inventory_source.SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    cmd = sys.argv[1]
    sys.exit({"rollout": rollout_main, "rollback": rollback_main}[cmd](sys.argv[2:]))
