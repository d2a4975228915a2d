"""gpufleet/plans/driver.py on recorded facts, tests as data: one JSON file per case under
tests/unit/plans/driver/<case>.json.

A case:

    {
      "doc": "what it shows",
      "inventory": {"tier": "hgx", ...},    # the host's inventory data (checked as a run does)
      "gpus": ["0x2330"], "os": "debian-12", "nvswitch": false,   # what the resolver is given
      "facts": {                            # DriverFacts' fields; a fact given as
        "before": "kernel.DriverState/no_driver.json",   # "<module.Fact>/<case>.json" is that
        ...                                 #   recorded fact case's output through the fact's
      },                                    #   own process(); else the value itself
      "expect": {"refused": {"key": ..., "reason": "starts with"}}
             | {"<DriverPlan field or field.field>": value as JSON, ...}
    }
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.explain import NAME_LIMIT

from gpufleet.config.hostfacts import KernelPlan
from gpufleet.config.resolver import resolve
from gpufleet.config.settings import _settings_for
from gpufleet.errors import Incompatible
from gpufleet.facts.kernel import DriverStateData, ProfilingStateData
from gpufleet.facts.packages import StackPackagesData
from gpufleet.config.failures import Refusal
from gpufleet.plans.driver import DriverFacts, DriverPlan, plan_driver
from tests.unit.test_fact_cases import as_json

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
CASES = sorted((HERE / "plans" / "driver").glob("*.json"))
KINDS: dict[str, type] = {"before": DriverStateData, "stack": StackPackagesData, "profiling": ProfilingStateData}


def recorded(ref: str) -> Any:
    """A recorded fact case's output, through the fact's own process()."""
    case = json.loads((HERE / "facts" / ref).read_text())
    module, _, cls = ref.split("/")[0].rpartition(".")
    fact = getattr(importlib.import_module(f"gpufleet.facts.{module}"), cls)()
    output = case["output"] if "output" in case else (ROOT / case["output_file"]).read_text().splitlines()
    return fact.process(output)


def fact_value(name: str, value: Any) -> Any:
    if isinstance(value, str) and value.endswith(".json"):
        return recorded(value)
    if name in KINDS:
        return KINDS[name](**value)
    if name == "kernel":
        return KernelPlan(value["release"], value["flavour"], tuple(value.get("modules", ())),
                          value.get("prebuilt", False))
    return tuple(value) if isinstance(value, list) else value


def planned(case: dict[str, Any]) -> DriverPlan | Refusal:
    settings, problems = _settings_for("gpu-a01", case["inventory"])
    assert settings is not None and not problems, problems
    try:
        resolved: Any = resolve(case["gpus"], settings, case.get("os", "debian-12"), nvswitch=case.get("nvswitch", False))
    except Incompatible as refused:
        resolved = refused
    facts = {name: fact_value(name, value) for name, value in case.get("facts", {}).items()}
    return plan_driver(settings, DriverFacts(resolved=resolved, os=case.get("os", "debian-12"), **facts))


def field(plan: DriverPlan, path: str) -> Any:
    value: Any = plan
    for part in path.split("."):
        value = getattr(value, part)
    return as_json(value)


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_driver_plan(path: Path) -> None:
    case = json.loads(path.read_text())
    plan = planned(case)
    expect = case["expect"]
    if "refused" in expect:
        assert isinstance(plan, Refusal), plan
        assert plan.key == expect["refused"]["key"], plan
        assert plan.reason.startswith(expect["refused"]["reason"]), plan
        return
    assert isinstance(plan, DriverPlan), plan
    for name, want in expect.items():
        assert field(plan, name) == want, (name, field(plan, name))
    if plan.change is not None:
        assert len(plan.change.name) <= NAME_LIMIT, plan.change.name


def test_the_change_name_fits_for_the_longest_stack() -> None:
    """An in-place move of driver + Fabric Manager + CUDA + cuDNN + Nsight named 75-79 characters
    before (the static check counts a value as 12); now the most detailed form that fits."""
    from types import SimpleNamespace

    from gpufleet.plans.driver import _change_what

    res = SimpleNamespace(driver_version="580.126.09", flavour="open", fabricmanager_needed=True,
                          cuda_version="12.9", cuda_release="12.9.1", cudnn_version="9.17.0")
    moves = SimpleNamespace(in_place=True, pending=("570.86.15", "580.126.09"), left=frozenset())
    name = "Install " + _change_what(res, moves, {"nsight-systems": "2025.1"}, False)  # type: ignore[arg-type]
    assert len(name) <= NAME_LIMIT and name.endswith("(in place, if idle)") and "580.126.09" in name, name
    kept = "Install " + _change_what(res, moves, {}, True)  # type: ignore[arg-type]
    assert len(kept) <= NAME_LIMIT and kept.endswith("(in place, if idle)"), kept
    roomy = SimpleNamespace(in_place=False, pending=None, left=frozenset())
    assert _change_what(res, roomy, {}, False) == "driver 580.126.09 + FM, CUDA 12.9.1, cuDNN 9.17.0"  # type: ignore[arg-type]


def test_the_cases_cover_every_refusal_and_the_moves() -> None:
    """A refusal of each kind the deploy knows, and a plan that leaves each move to the rollout."""
    cases = [json.loads(p.read_text())["expect"] for p in CASES]
    keys = {c["refused"]["key"] for c in cases if "refused" in c}
    assert {"driver_flavour", "driver_source", "driver_module_signing_key", "driver_kernel_headers",
            "tuning_profiling"} <= keys, keys
    assert any(c.get("pending") for c in cases) and any(c.get("drifted") for c in cases)
    assert any(c.get("change.in_place") for c in cases)


def test_a_plan_is_frozen_and_typed_without_any() -> None:
    import dataclasses
    import typing

    for cls in (DriverPlan, DriverFacts, Refusal):
        assert cls.__dataclass_params__.frozen  # type: ignore[attr-defined]
        hints = typing.get_type_hints(cls)
        assert all(hint is not Any for hint in hints.values()), cls
        assert {f.name for f in dataclasses.fields(cls)} <= set(hints)
