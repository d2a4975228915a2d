"""The base and preflight plans: settings (and the hardware found) in, the plan out."""
from __future__ import annotations

import pytest

from gpufleet.config.failures import Refusal
from gpufleet.config.settings import Settings
from gpufleet.plans.base import plan_base
from gpufleet.plans.preflight import plan_preflight

pytestmark = pytest.mark.unit

# (tier, inventory data) -> what the plans must say
BASE_CASES = [
    ("research", {}, {"sysstat": True, "marker_tier": "research"}),
    ("research", {"extra_packages": ["nvtop"]}, {"sysstat": False, "marker_tier": "research", "packages": ("nvtop",)}),
]
PREFLIGHT_CASES = [
    ({"tier_mismatch": "warn"}, [], {"matches": True}),
    ({"tier_mismatch": "warn"}, ["no NVSwitch (the tier expects one)"], {"warning": True}),
    ({"tier_mismatch": "fail"}, ["no NVSwitch (the tier expects one)"], {"refusal": True}),
]


def settings(tier: str, data: dict) -> Settings:
    from gpufleet.config.settings import host_settings
    from tests.unit.test_settings import inventory

    return host_settings(inventory({"tier": tier, **data}).get_host("gpu-a01"))


@pytest.mark.parametrize("tier, data, want", BASE_CASES)
def test_base_plan(tier, data, want):
    plan = plan_base(settings(tier, data))
    assert plan.sysstat is want["sysstat"]
    assert f"tier: {want['marker_tier']}" in plan.marker_lines
    if "packages" in want:
        assert plan.packages == want["packages"]


@pytest.mark.parametrize("data, problems, want", PREFLIGHT_CASES)
def test_preflight_plan(data, problems, want):
    plan = plan_preflight(settings("research", data), "2 x H100", problems)
    assert plan.matches is want.get("matches", False)
    assert (plan.warning is not None) is want.get("warning", False)
    assert isinstance(plan.refusal, Refusal) is want.get("refusal", False)
    if plan.refusal is not None:
        assert plan.refusal.key == "tier" and "2 x H100" in plan.refusal.reason and "no NVSwitch" in plan.refusal.reason
