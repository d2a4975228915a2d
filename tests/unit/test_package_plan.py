"""gpufleet/plans/package_plan.py: the exact versions of the one package change, decided on the
controller from recorded facts (the ToolkitIndex case of the stand-in repository, AptVersions
lists as apt-cache madison gives them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.facts.packages import ToolkitIndex
from gpufleet.plans.package_plan import plan_package_change, toolkit_release

pytestmark = pytest.mark.unit

CASE = Path(__file__).parent / "facts/packages.ToolkitIndex/toolkit_13_0_stand_in.json"
INDEX = ToolkitIndex().process(json.loads(CASE.read_text())["output"])
DRIVER = {"nvidia-open": "580.126.09", "nvidia-fabricmanager": "580.126.09"}
OFFERED = {"nvidia-open": ["580.126.09-1", "580.95.05-1"], "nvidia-fabricmanager": ["580.126.09-1", "580.95.05-1"],
           "cuda-toolkit-13-0": ["13.0.3-1", "13.0.2-1"], "libcudnn9-cuda-13": ["9.17.0.29-1", "9.16.0.29-1"]}


def test_a_toolkit_brings_its_components_at_the_versions_its_release_names_not_the_newest():
    walk = toolkit_release(INDEX, "cuda-toolkit-13-0", "13.0.2-1")
    assert walk.versions == {"cuda-compiler-13-0": "13.0.2-1", "cuda-nvcc-13-0": "13.0.88-1"}
    assert walk.loose == ()
    # the later update names its own compiler release
    assert toolkit_release(INDEX, "cuda-toolkit-13-0", "13.0.3-1").versions == {"cuda-compiler-13-0": None}


def test_a_new_host_gets_the_version_lock_first_then_exact_versions_all_held():
    plan = plan_package_change({**DRIVER, "cuda-toolkit-13-0": "13.0.2"}, ["datacenter-gpu-manager-4-core"],
                               "nvidia-driver-pinning-580.126.09", True, [], {}, [], OFFERED,
                               {"cuda-toolkit-13-0": INDEX})
    assert plan.missing == ()
    assert plan.install == {"nvidia-open": "580.126.09-1", "nvidia-fabricmanager": "580.126.09-1",
                            "cuda-toolkit-13-0": "13.0.2-1", "cuda-compiler-13-0": "13.0.2-1",
                            "cuda-nvcc-13-0": "13.0.88-1", "datacenter-gpu-manager-4-core": None,
                            "nvidia-driver-pinning-580.126.09": None}
    assert plan.first == ("nvidia-driver-pinning-580.126.09",)
    assert set(plan.hold) == {*plan.install}


def test_a_release_the_sources_do_not_offer_changes_nothing_and_names_what_asked_for_it():
    plan = plan_package_change({**DRIVER, "libcudnn9-cuda-13": "9.18.0.1"}, [], None, True, [],
                               {}, [], OFFERED, {})
    assert plan.install == {} and plan.first == ()
    assert plan.missing == (("libcudnn9-cuda-13", "libcudnn9-cuda-13 9.18.0.1"),)
    late = plan_package_change({"cuda-toolkit-13-0": "13.0.3"}, [], None, True, [], {}, [], OFFERED,
                               {"cuda-toolkit-13-0": INDEX})
    assert late.missing == (("cuda-toolkit-13-0", "cuda-compiler-13-0 13.0.3 (named by cuda-toolkit-13-0 13.0.3)"),)


def test_pin_back_moves_only_what_differs_and_swaps_the_version_lock():
    installed = {"nvidia-open": "580.126.09-1", "nvidia-fabricmanager": "580.95.05-1",
                 "nvidia-driver-pinning-580.95.05": None, "nvidia-driver-pinning-580.126.09": "580.126.09-1"}
    held = ["nvidia-open", "nvidia-fabricmanager", "nvidia-driver-pinning-580.126.09"]
    plan = plan_package_change({"nvidia-open": "580.95.05", "nvidia-fabricmanager": "580.95.05"}, [],
                               "nvidia-driver-pinning-580.95.05", True, ["nvidia-driver-pinning-580.126.09"],
                               installed, held, OFFERED, {})
    assert plan.install == {"nvidia-open": "580.95.05-1", "nvidia-driver-pinning-580.95.05": None}
    assert plan.remove == ("nvidia-driver-pinning-580.126.09",)
    assert "nvidia-driver-pinning-580.126.09" not in plan.hold and "nvidia-driver-pinning-580.95.05" in plan.hold


def test_at_its_releases_nothing_moves_and_without_holding_only_what_was_held_is_held_again():
    installed = {"nvidia-open": "1:580.126.09-0ubuntu1", "nvidia-fabricmanager": "580.126.09-1"}
    assert plan_package_change(DRIVER, [], None, True, [], installed, [], OFFERED, {}).install == {}
    plan = plan_package_change({"nvidia-open": "580.95.05"}, [], None, False, [], installed, ["nvidia-open"], OFFERED, {})
    assert plan.install == {"nvidia-open": "580.95.05-1"} and plan.hold == ("nvidia-open",)
