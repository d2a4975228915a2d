"""The host's acceptance record (facts/acceptance.py), written after an acceptance passed, and
the drain of a host that failed one."""
from __future__ import annotations

import json
import time
from collections.abc import Generator
from typing import Any

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.facts.acceptance import RECORD, RECORD_DIR, AcceptanceRecord
from gpufleet.config.failures import fail_now
from gpufleet.operations.remote_files import LazyWrite
from gpufleet.plans import acceptance as plan
from gpufleet.version import version


@operation(is_idempotent=False)
def acceptance_recorded(verdict: plan.Verdict, peer: str, when: float | None = None, made_by: str | None = None
                        ) -> Generator[StringCommand | LazyWrite, None, None]:
    """Write the record of a passed acceptance, for the driver and CUDA toolkits the host has
    now, 0600 in root's 0700 RECORD_DIR, never through a link (operations/remote_files.py).

    + verdict: the acceptance's verdict (gpufleet/plans/acceptance.py); a failed one is refused
    + peer: the host the all-reduce ran with, as the verdict names it ("" for none)
    + when: the acceptance's time (default: now); made_by: gpufleet's version (default: this one's)
    """
    if not verdict.passed:
        raise ValueError(f"{verdict.host}: a failed acceptance is not recorded")
    now = host.get_fact(AcceptanceRecord)
    record: dict[str, Any] = plan.build_record(verdict, peer, now.driver, now.cuda,
                                               time.time() if when is None else when, made_by or version())
    yield StringCommand("install", "-d", "-m", "700", QuoteString(RECORD_DIR))
    text = json.dumps(record, sort_keys=True) + "\n"
    yield LazyWrite(RECORD, lambda: text, on_error=lambda state, h: fail_now(
        state, h, "acceptance", f"could not write the acceptance record {RECORD}",
        "make room or fix the permissions of its folder, then gpufleet-deploy INVENTORY --accept"))
