"""Every area all.py runs has its plan in gpufleet/plans/, and its deploy reads it (issue 49):
the deploy applies the plan, the gate and the plan view read the same one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpufleet.apps.deploy import AREAS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: area -> its plan module, where the names differ
PLAN_OF = {"pytorch": "pytorch_runtime"}
#: not areas with a plan of their own: the whole story, the plan view, the gate (reads every plan)
NOT_AREAS = {"all", "plan", "validate"}


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("area", sorted(set(AREAS) - NOT_AREAS))
def test_each_area_has_a_plan_its_deploy_reads(area):
    plan = PLAN_OF.get(area, area)
    assert (ROOT / "gpufleet" / "plans" / f"{plan}.py").is_file(), f"no gpufleet/plans/{plan}.py for area {area}"
    assert f"gpufleet.plans.{plan}" in imported(ROOT / "deploys" / f"{area}.py"), \
        f"deploys/{area}.py does not read gpufleet.plans.{plan}"
