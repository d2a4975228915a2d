"""The commands an installed gpufleet gives (`pip install gpufleet`): the applications of
tools/* in a checkout, and `gpufleet-deploy`, which runs the installed deploy files with pyinfra
(a wheel has no deploys/ folder to point pyinfra at).

    gpufleet-deploy INVENTORY [AREA] [pyinfra options]   # AREA: all (default), plan, tuning, ... (apps/deploy.py)
    gpufleet-rollout / gpufleet-rollback / gpufleet-report / gpufleet-compat / gpufleet-health   # as tools/*
"""
from __future__ import annotations

import sys


def deploy(argv: list[str] | None = None) -> int:
    from gpufleet.apps.deploy import main

    return main(argv)


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
