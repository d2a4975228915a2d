"""The resolved PyTorch wheel in gpufleet's shared environment (pytorch_runtime: venv)."""
from __future__ import annotations

from collections.abc import Generator

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation
from pyinfra.facts.files import Sha256File

from gpufleet.plans.pytorch_runtime import INSTALL_SCRIPT, VenvPlan


@operation()
def venv_torch(plan: VenvPlan) -> Generator[StringCommand, None, None]:
    """Make the venv (once) and pip-install `plan.spec` of `plan.variant` into it, unless the
    record beside it says that wheel is there (then nothing runs: no index is asked).

    + plan: gpufleet/pytorch_runtime.venv_plan()
    """
    if host.get_fact(Sha256File, path=plan.marker) == plan.record_sha256:
        host.noop(f"{plan.path} has {plan.record.strip()}")
        return
    yield StringCommand("sh", "-c", QuoteString(INSTALL_SCRIPT), "gpufleet-pytorch", QuoteString(plan.path),
                        QuoteString(plan.spec), QuoteString(plan.variant), QuoteString(plan.record),
                        *(QuoteString(arg) for arg in plan.source))
