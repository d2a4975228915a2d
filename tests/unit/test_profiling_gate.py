"""The validation gate's profiling check (gpufleet/checks/tuning.py profiling_as_set) reads the same
plan as the driver deploy (gpufleet/plans/profiling.py): the option file, the loaded module's
RmProfilingAdminOnly, the Nsight packages exact and held. Facts are given as the fact cases
record them (tests/unit/facts/kernel.ProfilingState); the resolution is the hgx tier's CUDA 13.0.2."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace
from typing import Any

import pytest
from pyinfra.facts.files import Sha256File

from gpufleet.checks import validation
from gpufleet.facts.kernel import ProfilingState, ProfilingStateData
from gpufleet.facts.packages import HeldPackages, PackageVersions
from gpufleet.plans.profiling import FILE_TEXT, MODPROBE_FILE

pytestmark = pytest.mark.unit

NSIGHT = {"cuda-nsight-systems-13-0": "13.0.2-1", "nsight-systems-2025.3.2": "2025.3.2.474-1",
          "cuda-nsight-compute-13-0": "13.0.2-1", "nsight-compute-2025.3.1": "2025.3.1.4-1"}
RES = SimpleNamespace(cuda_release="13.0.2", source="nvidia", cuda_package="cuda-toolkit-13-0")


class Host:
    name = "gpu-a01"

    def __init__(self, state: ProfilingStateData, file: str | None, installed: dict[str, str], held: list[str]):
        self.facts: dict[Any, Any] = {ProfilingState: state, HeldPackages: held,
                                      Sha256File: hashlib.sha256(file.encode()).hexdigest() if file else None}
        self.installed = installed

    def get_fact(self, cls: Any, **kwargs: Any) -> Any:
        if cls is PackageVersions:
            return {p: self.installed.get(p) for p in kwargs["packages"]}
        return self.facts[cls]


def check(setting: str, host: Host) -> validation.Result:
    ctx = validation.Context(host, SimpleNamespace(tuning_profiling=setting, driver_hold=True))
    ctx.resolution = lambda: RES  # type: ignore[method-assign]
    return validation.profiling_as_set(ctx)


def users_host(admin_only: int, installed: dict[str, str] = NSIGHT, held: tuple[str, ...] = tuple(NSIGHT)) -> Host:
    return Host(ProfilingStateData(True, admin_only, {MODPROBE_FILE: 0}), FILE_TEXT, installed, list(held))


def test_users_written_not_loaded_warns_pending_naming_the_rollout():
    r = check("users", users_host(1))
    assert r.status == "warn" and r.message.startswith("PENDING: the loaded nvidia module gives them to admins only "
                                                       "(RmProfilingAdminOnly 1)")
    assert r.fix.startswith("tools/rollout INVENTORY reboots it through the gate")


def test_users_loaded_passes_with_the_nsight_packages_held():
    r = check("users", users_host(0))
    assert r.status == "pass" and r.message.startswith("every user (RmProfilingAdminOnly 0); cuda-nsight-systems-13-0 13.0.2")


def test_users_with_an_nsight_package_off_its_release_or_not_held_fails():
    moved = {**NSIGHT, "nsight-compute-2025.3.1": "2025.3.1.9-1"}
    r = check("users", users_host(0, installed=moved))
    assert r.status == "fail" and "nsight-compute-2025.3.1 2025.3.1.9-1 (wants 2025.3.1.4)" in r.message
    r = check("users", users_host(0, held=tuple(p for p in NSIGHT if p != "nsight-systems-2025.3.2")))
    assert r.status == "fail" and r.message == "nsight-systems-2025.3.2 not held"


def test_users_without_the_file_fails_it_would_not_survive_the_next_load():
    host = Host(ProfilingStateData(True, 0, {}), None, NSIGHT, list(NSIGHT))
    r = check("users", host)
    assert r.status == "fail" and r.message.startswith(f"{MODPROBE_FILE} is missing")


def test_admins_at_the_drivers_default_passes_and_another_files_opening_warns():
    assert check("admins", Host(ProfilingStateData(True, 1, {}), None, {}, [])).message == \
        "admins only (RmProfilingAdminOnly 1)"
    r = check("admins", Host(ProfilingStateData(True, 0, {"/etc/modprobe.d/site.conf": 0}), None, {}, []))
    assert r.status == "warn" and "/etc/modprobe.d/site.conf sets the option to 0 (not gpufleet's file)" in r.message


def test_no_module_loaded_is_skipped():
    r = check("users", Host(ProfilingStateData(False, None, {MODPROBE_FILE: 0}), FILE_TEXT, NSIGHT, list(NSIGHT)))
    assert r.status == "skip"
