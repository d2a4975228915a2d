"""The validation gate: is each host what its tier says? Read-only; facts + comparisons.

Each check is a small function ``check(ctx) -> Result | list[Result]`` registered for one area
in that area's module, gpufleet/checks/<area>.py (base, preflight, storage, driver, tuning,
docker, monitoring, hardening, health, probe, pytorch), on the frame of gpufleet/checks/gate.py
(Result, Context, the registry). This module imports the areas in that order (the order the
results come in) and re-exports their names. ``run_checks(host, settings)`` runs them all
against *fresh* facts (never the planning-time cache: the gate runs after the changes) and
returns one Result per check. deploys/validate.py turns failures into a failed host; the fleet
report shows the same results per host.

Statuses: pass | fail | warn | skip (does not apply, with the reason).

This is the core: it imports no deploy (tests/unit/test_import_direction.py). What a check
compares with is the same plan the deploy applies (gpufleet.plans.*: tuning, storage, MIG,
GPUDirect, profiling; gpufleet.catalog.tiers.managed_marker, gpufleet.plans.dockerconf,
gpufleet.catalog.sshd_policy), and what the deploy did with it this run (the host's outcome in
its context: a MIG change left pending under GPU work).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpufleet.checks.gate import (
    PASS as PASS,
    FAIL as FAIL,
    WARN as WARN,
    SKIP as SKIP,
    STATUSES as STATUSES,
    MARKER as MARKER,
    FIX_DEPLOY as FIX_DEPLOY,
    FIX_ROLLOUT as FIX_ROLLOUT,
    AREAS as AREAS,
    Result as Result,
    Context as Context,
    Check as Check,
    CHECKS as CHECKS,
    check as check,
    fresh_host_facts as fresh_host_facts,
)
from gpufleet.checks.base import (
    marker_matches_tier as marker_matches_tier,
    diagnostics_installed as diagnostics_installed,
)
from gpufleet.checks.preflight import (
    tier_matches_hardware as tier_matches_hardware,
    one_gpu_model as one_gpu_model,
    fastest_data_nic as fastest_data_nic,
    enough_ram as enough_ram,
    fast_enough_nic as fast_enough_nic,
    enough_nvme as enough_nvme,
    os_as_planned as os_as_planned,
)
from gpufleet.checks.storage import (
    scratch_in_place as scratch_in_place,
    shm_sized as shm_sized,
)
from gpufleet.checks.driver import (
    no_mismatch_pending as no_mismatch_pending,
    driver_versions_agree as driver_versions_agree,
    FIX_STACK_DRIFT as FIX_STACK_DRIFT,
    FIX_COMPONENT_DRIFT as FIX_COMPONENT_DRIFT,
    cuda_cudnn_releases_exact as cuda_cudnn_releases_exact,
    stack_held as stack_held,
    kernels_have_the_module as kernels_have_the_module,
    fabric_manager_active as fabric_manager_active,
)
from gpufleet.checks.tuning import (
    persistence_on as persistence_on,
    clocks_as_set as clocks_as_set,
    mig_as_set as mig_as_set,
    profiles_current as profiles_current,
    gpudirect_rdma as gpudirect_rdma,
    nccl_hcas_up as nccl_hcas_up,
    profiling_as_set as profiling_as_set,
    cpu_governor_as_set as cpu_governor_as_set,
)
from gpufleet.checks.docker import (
    containers_see_gpus as containers_see_gpus,
    daemon_json_current as daemon_json_current,
)
from gpufleet.checks.monitoring import (
    exporter_check_name as exporter_check_name,
    exporters_serve_metrics as exporters_serve_metrics,
)
from gpufleet.checks.hardening import (
    sshd_hardened as sshd_hardened,
    firewall_active as firewall_active,
    training_peers_let_in as training_peers_let_in,
)
from gpufleet.checks.health import (
    HEALTH_CHECK as HEALTH_CHECK,
    gpu_health as gpu_health,
)
from gpufleet.checks.probe import (
    DCGM_CHECK as DCGM_CHECK,
    diag_result as diag_result,
    dcgm_diag as dcgm_diag,
    probe_arguments as probe_arguments,
    no_torch as no_torch,
    no_runtime as no_runtime,
    performance as performance,
)
from gpufleet.checks.pytorch import (
    PYTORCH_CHECK as PYTORCH_CHECK,
    pytorch_build_runs_here as pytorch_build_runs_here,
)
from gpufleet.checks.acceptance import (
    ACCEPTED as ACCEPTED,
    accepted as accepted,
)

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings


# --- running ----------------------------------------------------------------------------------

def run_checks(host: Any, settings: Settings, probe: bool = True, probe_skip: str = "probes turned off",
               torch_probe: bool | None = None, scrape_skip: str = "", health_skip: str = "") -> list[Result]:
    """Every check against the host as it is now. A check that raises becomes a failed result
    naming the error, so one broken check never hides the others. `scrape_skip`, when given,
    says why the exporters are not scraped (their units are checked instead)."""
    ctx = Context(host, settings, probe=probe, probe_skip=probe_skip, torch_probe=torch_probe,
                  scrape_skip=scrape_skip, health_skip=health_skip)
    results: list[Result] = []
    with fresh_host_facts(host):
        for area, func in CHECKS:
            try:
                out = func(ctx)
            except Exception as error:  # noqa: BLE001 - reported, never swallowed
                out = Result(area, func.__name__.replace("_", " "), FAIL,
                             f"the check itself failed: {type(error).__name__}: {error}",
                             "report this as a gpufleet bug")
            results.extend(out if isinstance(out, list) else [out])
    return results


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if r.status == FAIL]
