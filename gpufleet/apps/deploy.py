"""`gpufleet-deploy INVENTORY [AREA] [pyinfra options]`: pyinfra with gpufleet's deploy file
AREA (default all), for an installed gpufleet (a wheel has no deploys/ folder to point pyinfra
at). pyinfra's options pass through where pyinfra takes them (`--limit`, `--data`, `--dry`,
`-y`, ...), before or after the inventory and the area; the arguments are checked here first, so
a missing inventory or an unknown area stops before pyinfra loads anything.

After all.py (AREA all), the hosts it left converged that are not accepted (no acceptance record
for the driver and CUDA they have now: facts/acceptance.py) run the acceptance
(gpufleet/apps/new_hosts.py): a new node is not handed to users before it proved itself, and a
re-run does not burn in every host again. `--no-accept` leaves it out (said), `--accept` runs
only it, for the hosts (of --limit) not accepted. A host that fails it is drained and named, and
the exit code is EXIT_NOT_ACCEPTED.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gpufleet.deploys
from gpufleet import pyinfra_private
from gpufleet.apps.exits import epilog
from gpufleet.version import support_text, version_line

PROG = "gpufleet-deploy"
#: The deploy files a user runs (deploys/upgrade.py and rollback.py are the rollout's own
#: steps; standalone.py is how an area runs alone).
AREAS = ("all", "plan", "preflight", "package_cache", "base", "driver", "docker", "tuning", "pytorch", "storage", "monitoring",
         "health_watch", "hardening", "validate")
DEPLOYS = gpufleet.deploys.FOLDER  # deploys/: in a checkout or a wheel
USAGE = 2
EXIT_NOT_ACCEPTED = 4
OWN_FLAGS = ("--accept", "--no-accept")


class UsageError(ValueError):
    """A command line gpufleet-deploy refuses before running pyinfra: one line, exit 2."""


def usage() -> str:
    return (f"usage: {PROG} INVENTORY [AREA] [--no-accept] [pyinfra options]\n"
            f"       {PROG} INVENTORY --accept [--limit PATTERN] [--data KEY=VALUE]\n"
            f"       {PROG} --settings | --version | --support | --help\n\n"
            f"Runs pyinfra with gpufleet's deploy file AREA (default all) against the hosts of the pyinfra\n"
            f"inventory file INVENTORY. AREA is one of: {', '.join(AREAS)}.\n"
            "After all, the converged hosts with no acceptance on record for their driver and CUDA run the\n"
            "acceptance (docs/acceptance.md): a pass is recorded on the host, a failure drains it.\n\n"
            "  --no-accept leave the acceptance out (the run's end names the hosts not accepted)\n"
            "  --accept    run only the acceptance, of the hosts not accepted (no deploy)\n"
            "pyinfra's options pass through, e.g. --limit PATTERN, --exclude PATTERN, --data KEY=VALUE, --dry, -y.\n\n"
            "  --settings  print the settings reference (every key, its default, each tier's value)\n"
            "  --version   print gpufleet's version (and pyinfra's)\n"
            "  --support   print gpufleet's, pyinfra's, paramiko's, Python's and the OS's versions for a bug report\n"
            f"\nThe deploy files are in {DEPLOYS}.\n\n{epilog(PROG)}\n")


def positionals(args: list[str], takes_value: frozenset[str]) -> list[int]:
    """Indices of the positional arguments among pyinfra's options (an option's value is not one)."""
    found: list[int] = []
    skip = False
    for index, arg in enumerate(args):
        if skip:
            skip = False
        elif arg == "--":
            return found + list(range(index + 1, len(args)))
        elif arg.startswith("-") and arg != "-":
            skip = "=" not in arg and arg in takes_value
        else:
            found.append(index)
    return found


def pyinfra_argv(args: list[str], takes_value: frozenset[str] | None = None) -> list[str]:
    """pyinfra's arguments for gpufleet-deploy's `args`: the area replaced by its deploy file.
    Raises UsageError for a missing inventory, an unknown area or more than one area."""
    takes_value = pyinfra_private.cli_value_options() if takes_value is None else takes_value
    where = positionals(args, takes_value)
    if not where:
        raise UsageError("no inventory given")
    inventory = args[where[0]]
    if len(where) > 2:
        extra = " ".join(args[i] for i in where[2:])
        raise UsageError(f"one area at a time, got {extra!r} after {args[where[1]]!r} (areas: {', '.join(AREAS)})")
    if not Path(inventory).is_file():
        raise UsageError(f"no such inventory file: {inventory} (a pyinfra inventory file, e.g. inventories/cloud.py)")
    area = args[where[1]] if len(where) == 2 else "all"
    if area not in AREAS:
        raise UsageError(f"unknown area {area!r} (allowed: {', '.join(AREAS)})")
    deploy_file = str(DEPLOYS / f"{area}.py")
    if len(where) == 2:
        return [*args[:where[1]], deploy_file, *args[where[1] + 1:]]
    return [*args[:where[0] + 1], deploy_file, *args[where[0] + 1:]]


def own_flags(args: list[str]) -> tuple[list[str], bool, bool]:
    """(pyinfra's arguments, --accept, --no-accept): gpufleet-deploy's own flags taken out."""
    accept_only, no_accept = "--accept" in args, "--no-accept" in args
    if accept_only and no_accept:
        raise UsageError("--accept and --no-accept exclude each other")
    return [a for a in args if a not in OWN_FLAGS], accept_only, no_accept


def area_of(args: list[str], takes_value: frozenset[str] | None = None) -> str:
    takes_value = pyinfra_private.cli_value_options() if takes_value is None else takes_value
    where = positionals(args, takes_value)
    return args[where[1]] if len(where) >= 2 else "all"


def option_values(args: list[str], name: str, takes_value: frozenset[str]) -> list[str]:
    """The values of pyinfra's option `name` (`--name V` or `--name=V`, repeatable)."""
    found, skip = [], False
    for index, arg in enumerate(args):
        if skip:
            skip = False
            continue
        if arg == "--":
            break
        if arg == name and index + 1 < len(args):
            found.append(args[index + 1])
            skip = True
        elif arg.startswith(name + "="):
            found.append(arg.split("=", 1)[1])
        elif arg.startswith("-") and "=" not in arg and arg in takes_value:
            skip = True
    return found


def inventory_source(args: list[str], takes_value: frozenset[str] | None = None) -> Any:
    """The inventory as the pyinfra run sees it: its --limit, --exclude, --data and --config."""
    from gpufleet.controller.inventory_source import InventorySource, data_arg

    takes_value = pyinfra_private.cli_value_options() if takes_value is None else takes_value
    inventory = args[positionals(args, takes_value)[0]]
    data = dict(data_arg(item) for item in option_values(args, "--data", takes_value))
    given = option_values(args, "--config", takes_value)
    config = given[-1] if given else None
    if config is None:
        beside = Path(inventory).resolve().parent / "config.py"
        here = Path.cwd() / "config.py"
        config = str(here) if here.is_file() else str(beside) if beside.is_file() else None
    return InventorySource(inventory, option_values(args, "--limit", takes_value), data, config,
                           exclude=option_values(args, "--exclude", takes_value))


def say(line: str) -> None:
    from gpufleet.printable import printable

    print(f"--> {PROG}: {printable(line, newlines=True)}", flush=True)


def accept_hosts(source: Any, names: list[str]) -> int:
    """The acceptance of `names` not accepted; 0, or EXIT_NOT_ACCEPTED naming who failed."""
    from gpufleet.apps.new_hosts import accept_new_hosts

    if not names:
        say("acceptance: no converged host to accept")
        return 0
    outcome = accept_new_hosts(source, names, say)
    if outcome.failed:
        say(f"{len(outcome.failed)} host(s) FAILED acceptance, not accepted (a Slurm node drained): "
            f"{', '.join(sorted(outcome.failed))} (each named above with its measurement and fix; "
            f"`{PROG} INVENTORY --accept` once fixed)")
        return EXIT_NOT_ACCEPTED
    if outcome.accepted:
        say(f"accepted and recorded: {', '.join(outcome.accepted)}")
    return 0


def deploy_and_accept(command: list[str], source: Any) -> int:
    """all.py as a child pyinfra, then the acceptance of the hosts it left converged."""
    from gpufleet.controller import run_result

    with tempfile.TemporaryDirectory(prefix="gpufleet-deploy-") as private:   # 0700
        results = os.path.join(private, "results.json")
        env = {**os.environ, run_result.ENV: results, run_result.ACCEPTS_NEXT: "1"}
        code = subprocess.call([sys.executable, "-m", "pyinfra", *command], env=env)
        hosts = run_result.read(results)
    converged = [name for name, status in hosts.items() if status == "ok"]
    if not hosts:
        say("acceptance: not run (the deploy ended before its hosts did)")
        return code
    accepted = accept_hosts(source, sorted(converged, key=list(hosts).index))
    return code or accepted


def settings_reference() -> str:
    """The settings reference, as docs/settings.md has it (rendered from the installed tiers.yaml)."""
    from gpufleet.config.settings_doc import render

    return render()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or "-h" in args or "--help" in args:
        sys.stdout.write(usage())
        return 0 if args else USAGE
    if "--version" in args:
        print(version_line(PROG))
        return 0
    if "--support" in args:
        sys.stdout.write(support_text())
        return 0
    if "--settings" in args:
        sys.stdout.write(settings_reference())
        return 0
    try:
        args, accept_only, no_accept = own_flags(args)
        command = pyinfra_argv(args)
        area = area_of(args)
        if (accept_only or no_accept) and area != "all":
            raise UsageError(f"{'--accept' if accept_only else '--no-accept'} is for area all (the acceptance "
                             f"follows a converge of all.py), not {area!r}")
        source = inventory_source(args) if accept_only or (area == "all" and not no_accept) else None
    except (UsageError, ValueError, argparse.ArgumentTypeError) as problem:
        sys.stderr.write(f"{PROG}: {problem}\n{usage().splitlines()[0]}\n")
        return USAGE
    if accept_only and source is not None:
        try:
            names = [h.name for h in source.hosts(source.load())]
        except ValueError as problem:
            sys.stderr.write(f"{PROG}: {problem}\n")
            return USAGE
        return accept_hosts(source, names)
    if area == "all" and no_accept:
        say("acceptance left out (--no-accept): the run's end names the converged hosts not accepted")
    if area == "all" and not no_accept and "--dry" in args:
        say("acceptance left out: --dry changes nothing, so no host converges")
    if area != "all" or no_accept or "--dry" in args:
        os.execv(sys.executable, [sys.executable, "-m", "pyinfra", *command])
        return 0  # not reached
    return deploy_and_accept(command, source)
