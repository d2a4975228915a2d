"""`gpufleet-deploy INVENTORY [AREA] [pyinfra options]`: pyinfra with gpufleet's deploy file
AREA (default all), for an installed gpufleet (a wheel has no deploys/ folder to point pyinfra
at). pyinfra's options pass through where pyinfra takes them (`--limit`, `--data`, `--dry`,
`-y`, ...), before or after the inventory and the area; the arguments are checked here first, so
a missing inventory or an unknown area stops before pyinfra loads anything.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

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


class UsageError(ValueError):
    """A command line gpufleet-deploy refuses before running pyinfra: one line, exit 2."""


def usage() -> str:
    return (f"usage: {PROG} INVENTORY [AREA] [pyinfra options]\n"
            f"       {PROG} --settings | --version | --support | --help\n\n"
            f"Runs pyinfra with gpufleet's deploy file AREA (default all) against the hosts of the pyinfra\n"
            f"inventory file INVENTORY. AREA is one of: {', '.join(AREAS)}.\n"
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
        command = pyinfra_argv(args)
    except UsageError as problem:
        sys.stderr.write(f"{PROG}: {problem}\n{usage().splitlines()[0]}\n")
        return USAGE
    os.execv(sys.executable, [sys.executable, "-m", "pyinfra", *command])
    return 0  # not reached
