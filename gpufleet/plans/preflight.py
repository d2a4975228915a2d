"""What deploys/preflight.py decides before anything is installed: the hardware the host really
has (read from PCI, so it works before any driver) against what its tier expects. A mismatch
warns, or with `tier_mismatch: fail` refuses this host (and only this host) at planning; the
gate's preflight check words the same finding."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpufleet.config.failures import Refusal
from gpufleet.config.settings import Settings


@dataclass(frozen=True)
class PreflightPlan:
    problems: tuple[str, ...]   # what differs from the tier, one finding each ("" tuple: it matches)
    found: str                  # the hardware found, with the problems: the words of the warning
    refusal: Refusal | None     # tier_mismatch: fail and a problem
    warning: str | None         # tier_mismatch: warn and a problem

    @property
    def matches(self) -> bool:
        return not self.problems


def plan_preflight(settings: Settings, hardware_summary: str, problems: Sequence[str]) -> PreflightPlan:
    if not problems:
        return PreflightPlan((), hardware_summary, None, None)
    found = f"found {hardware_summary}; " + "; ".join(problems)
    mismatch = f"hardware does not match tier {settings.tier}: {found}"
    if settings.tier_mismatch == "fail":
        refusal = Refusal("preflight", "tier", mismatch,
                          "give the host the tier its hardware is (tier), or set tier_mismatch: warn to go on anyway")
        return PreflightPlan(tuple(problems), found, refusal, None)
    return PreflightPlan(tuple(problems), found, None, f"{mismatch} (tier_mismatch: warn)")
