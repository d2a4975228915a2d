"""Validation gate: is each host what its tier says? Changes nothing; fails the host if not.

    pyinfra inventories/cloud.py deploys/validate.py     # on its own
    pyinfra inventories/cloud.py deploys/all.py          # runs it last

Story of a host, the end: after everything is applied, every promise is checked against the
host as it is *now* (facts read at execution time, after the changes, never the planning-time
view): the gpufleet marker and diagnostics packages, the hardware against the tier, loaded
driver = installed = resolved and no mismatch pending, persistence, clocks, Fabric Manager
where NVSwitch is present, containers seeing the GPUs, the tuning profiles, sshd's effective
configuration and the firewall; then, where DCGM or PyTorch exist, `dcgmi diag -r 1` and a
short bf16 matmul / memory / all-reduce probe against per-model minimums (gpufleet/perf.py).

Every check prints one line (PASS, FAIL with its fix, WARN, or SKIP with the reason). Any FAIL fails the host, so the run
exits non-zero naming the host and what changed. The checks live in gpufleet/validation.py.
Set GPUFLEET_VALIDATE_PROBE=0 to leave out the DCGM and performance probes.
"""
from __future__ import annotations

import os
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import FunctionCommand, deploy, operation

from gpufleet.settings import host_settings, validate_inventory
from gpufleet.validation import FAIL, WARN, failures, run_checks


def probe_enabled() -> bool:
    return os.environ.get("GPUFLEET_VALIDATE_PROBE", "1").strip().lower() not in ("0", "no", "false", "off")


def _refuse(state, host, summary: str) -> bool:
    logger.error(f"{host.print_prefix}validation failed: {summary}")
    return False


@operation()
def gate(probe: bool = True):
    """Check the host against its tier at execution time; a failed check fails the host."""
    if not host.state.is_executing:
        # Planning: the host has not been changed yet, so there is nothing to judge.
        return
    settings = host_settings(host)
    results = run_checks(host, settings, probe=probe)
    for result in results:
        log = logger.error if result.status == FAIL else logger.warning if result.status == WARN else logger.info
        log(f"{host.print_prefix}{result.line()}")
    failed = failures(results)
    if failed:
        summary = "; ".join(f"{r.name}: {r.message} (fix: {r.fix})" if r.fix else f"{r.name}: {r.message}"
                            for r in failed)
        yield FunctionCommand(_refuse, (summary,), {})


@deploy("Validate")
def validate():
    gate(
        name="Check that the host is what its tier says (read-only validation gate)",
        probe=probe_enabled(),
    )


def _run_as_deploy_file() -> bool:
    from pyinfra.context import ctx_state

    if not ctx_state.isset():
        return False
    current = state.current_exec_filename
    return bool(current) and Path(current).resolve() == Path(__file__).resolve()


if _run_as_deploy_file():
    # pyinfra executes this file per host: check the inventory once, then the host.
    validate_inventory(state.inventory)
    validate()
