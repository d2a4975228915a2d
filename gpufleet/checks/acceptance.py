"""The validation gate, acceptance: has the host proved itself with its peers (docs/acceptance.md)?

A converged host without an acceptance on record for the driver and CUDA it has now is valid, and
still a WARN: it is not known to run multi-node jobs yet (gpufleet-deploy accepts it)."""
from __future__ import annotations

from gpufleet.checks.gate import PASS, SKIP, WARN, Context, Result, check
from gpufleet.facts.acceptance import RECORD, AcceptanceRecord
from gpufleet.plans.acceptance import FIX_ACCEPT, standing

ACCEPTED = "accepted for its driver and CUDA"


@check("acceptance")
def accepted(ctx: Context) -> Result:
    if not ctx.settings.acceptance_new_host:
        return Result("acceptance", ACCEPTED, SKIP, "acceptance_new_host: false")
    if ctx.health_skip:
        return Result("acceptance", ACCEPTED, SKIP, "not read: this run changed nothing on the host (deploys/validate.py "
                                                    "and the fleet report read it)")
    found = standing(ctx.fact(AcceptanceRecord))
    if found.accepted:
        return Result("acceptance", ACCEPTED, PASS, f"accepted {found.when} ({RECORD})")
    return Result("acceptance", ACCEPTED, WARN, found.why, FIX_ACCEPT)
