"""The commands an installed gpufleet gives (`pip install gpufleet`): the applications of
tools/* in a checkout, and `gpufleet-deploy`, which runs the installed deploy files with pyinfra
(a wheel has no deploys/ folder to point pyinfra at).

    gpufleet-deploy INVENTORY [AREA] [pyinfra options]   # AREA: all (default), plan, tuning, ...
    gpufleet-rollout / gpufleet-rollback / gpufleet-report / gpufleet-compat   # as tools/*
"""
from __future__ import annotations

import os
import sys

import gpufleet.deploys

#: The deploy files a user runs (deploys/upgrade.py and rollback.py are the rollout's own steps).
AREAS = ("all", "plan", "preflight", "base", "driver", "docker", "tuning", "hardening", "validate")
DEPLOYS = gpufleet.deploys.FOLDER  # deploys/: in a checkout or a wheel


def deploy_usage() -> str:
    return ("usage: gpufleet-deploy INVENTORY [AREA] [pyinfra options]\n"
            f"Runs pyinfra with gpufleet's deploy file AREA (default all): one of {', '.join(AREAS)}.\n"
            f"The deploy files are in {DEPLOYS}.\n")


def deploy(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(deploy_usage())
        return 0 if args else 2
    inventory, rest = args[0], args[1:]
    area = "all"
    if rest and not rest[0].startswith("-"):
        area, rest = rest[0], rest[1:]
    if area not in AREAS:
        sys.stderr.write(f"gpufleet-deploy: unknown area {area!r} (allowed: {', '.join(AREAS)})\n")
        return 2
    command = [sys.executable, "-m", "pyinfra", inventory, str(DEPLOYS / f"{area}.py"), *rest]
    os.execv(sys.executable, command)
    return 0  # not reached


def rollout() -> int:
    from gpufleet.apps.rollout.cli import rollout_main

    return rollout_main(sys.argv[1:], prog="gpufleet-rollout")


def rollback() -> int:
    from gpufleet.apps.rollout.cli import rollback_main

    return rollback_main(sys.argv[1:], prog="gpufleet-rollback")


def report() -> int:
    from gpufleet.apps.report.cli import main

    return main(sys.argv[1:], prog="gpufleet-report")


def compat() -> int:
    from gpufleet.apps.compat import main

    return main(sys.argv[1:], prog="gpufleet-compat")


def health() -> int:
    from gpufleet.apps.health import main

    return main(sys.argv[1:], prog="gpufleet-health")
