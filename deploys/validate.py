"""Validation gate: is each host what its tier says? Changes nothing; fails the host if not.

    pyinfra inventories/cloud.py deploys/validate.py     # on its own
    pyinfra inventories/cloud.py deploys/all.py          # runs it last

Story of a host, the end: after everything is applied, every promise is checked against the
host as it is *now* (facts read at execution time, after the changes, never the planning-time
view): the gpufleet marker and diagnostics packages, the hardware against the tier, loaded
driver = installed = resolved and no mismatch pending, persistence, clocks, Fabric Manager
where NVSwitch is present, containers seeing the GPUs, the tuning profiles, sshd's effective
configuration and the firewall; then, where DCGM or PyTorch exist, `dcgmi diag -r 1` and a
short bf16 matmul / memory / all-reduce probe against per-model minimums (gpufleet/plans/perf.py),
and whether the PyTorch build runs on the GPUs with this driver (facts/pytorch.py), both with the
tier's PyTorch runtime (pytorch_runtime: gpufleet's venv, an interpreter the site keeps, or none;
each line names it; a runtime without torch is a WARN naming what to set).

Every check prints one line (PASS, FAIL with its fix, WARN, or SKIP with the reason). Any FAIL fails the host, so the run
exits non-zero naming the host and what changed. The checks live in gpufleet/checks/validation.py.
GPUFLEET_VALIDATE_PROBE: 0 leaves out the DCGM and performance probes; by default they run when
this file runs on its own, and at the end of all.py only on hosts the run changed (a no-op re-run
of a whole fleet must not load every GPU for seconds); `always` runs them at the end of all.py
too. The exporters are scraped likewise: always when this file runs on its own, at the end of
all.py only on hosts the run changed (or with `always`); on the others the gate checks that
systemd reports each exporter running (deploys/monitoring.py read that this run) and says why it
did not scrape (each scrape made the exporter collect everything: about 70 ms of the host's CPU a
no-op, a fifth of all it spent; bench/fleet.py). GPUFLEET_VALIDATE_PROBE_DEVICE=cpu runs the performance probe's small CPU variant instead
(PyTorch without a CUDA device: the test hosts).
"""
from __future__ import annotations

import os
from collections.abc import Generator

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, deploy, operation

from gpufleet.explain import explained
from gpufleet.config.failures import fail
from gpufleet.config.settings import host_settings
from gpufleet.checks.validation import FAIL, WARN, failures, run_checks
from gpufleet.controller.run_summary import outcome


def probe_setting() -> str:
    return os.environ.get("GPUFLEET_VALIDATE_PROBE", "1").strip().lower()


def probe_enabled() -> bool:
    return probe_setting() not in ("0", "no", "false", "off")


def _changed_this_run(host: Host) -> bool:
    """Did an operation of this run already change the host? (the gate runs last)"""
    return any(op.operation_meta.is_complete() and op.operation_meta.did_change()
               for op in host.state.ops[host].values())


@operation()
def gate(probe: bool = True, probe_only_if_changed: bool = False) -> Generator[FunctionCommand, None, None]:
    """Check the host against its tier at execution time; a failed check fails the host."""
    if not host.state.is_executing:
        # Planning: the host has not been changed yet, so there is nothing to judge.
        return
    settings = host_settings(host)
    skip, scrape_skip, health_skip = "probes turned off", "", ""
    if probe_only_if_changed and not _changed_this_run(host):
        scrape_skip = ("this run changed nothing on the host (deploys/validate.py, the fleet report and "
                       "GPUFLEET_VALIDATE_PROBE=always scrape)")
        # a GPU going bad is not a run's doing: tools/health (one command per host), Slurm's health
        # check, deploys/validate.py and the fleet report read it; a no-op re-run does not pay for it
        health_skip = ("GPU health not read: this run changed nothing on the host (tools/health, "
                       "deploys/validate.py and the fleet report read it)")
        if probe:
            probe, skip = False, ("probes skipped: this run changed nothing on the host "
                                  "(GPUFLEET_VALIDATE_PROBE=always runs them on every run)")
    results = run_checks(host, settings, probe=probe, probe_skip=skip, scrape_skip=scrape_skip,
                         health_skip=health_skip)
    for result in results:
        log = logger.error if result.status == FAIL else logger.warning if result.status == WARN else logger.info
        log(f"{host.print_prefix}{result.line()}")
    failed = failures(results)
    refused = [r for r in results if r.area == "acceptance" and r.status == WARN]
    if refused and not failed:
        # a valid host all the same: the run's end names it, with the command that accepts it
        outcome(host).not_accepted = refused[0].message
    if failed:
        summary = "; ".join(f"{r.name}: {r.message}" for r in failed)
        fixes = "; ".join(f"{r.name}: {r.fix}" for r in failed if r.fix)
        yield fail(host, "validation", f"{len(failed)} check(s) failed: {summary}",
                   fixes or "bring the host back to what its tier says (deploys/all.py), then validate again")


@deploy("Validate")
def validate(probe_only_if_changed: bool = False) -> None:
    gate(
        name=explained("Validation gate", "Check that the host is what its tier says (read-only validation gate)"),
        probe=probe_enabled(),
        probe_only_if_changed=probe_only_if_changed and probe_setting() != "always",
    )


# `pyinfra INVENTORY deploys/validate.py`: the gate on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
