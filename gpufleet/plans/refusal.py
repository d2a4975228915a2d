"""A plan's "not on this host", as data: the deploy turns it into a stop
(gpufleet/config/failures.py `refuse`) before anything changes; a test compares it as a value."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """Why a plan rules a host out: `area` the plan's (docker, hardening), `key` the setting to
    change, else the part of gpufleet that judged (`connector`), `reason` and `fix` as the stop
    line prints them."""

    area: str
    key: str
    reason: str
    fix: str
