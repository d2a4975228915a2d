"""Nsight with the CUDA toolkit (issue 33, item 3 follow-up): NVIDIA's cuda-toolkit-X-Y reaches
cuda-nsight-systems-X-Y / cuda-nsight-compute-X-Y through cuda-tools-X-Y -> cuda-visual-tools-X-Y,
and they reach the release-named nsight-systems-YYYY.N.N / nsight-compute-YYYY.N.N with >=. The
walk of a toolkit release pins those at the builds the release names and holds them (all.py),
and tools/rollout moves them with the toolkit (deploys/upgrade.py through gpufleet/rollout/moves.py, on all.py's plan_package_change), with
tuning_profiling users' exact releases from compat.yaml whether or not the toolkit depends on
them. The index is the stand-in repository's (testing/aptrepo.py), as ToolkitIndex reads it."""
from __future__ import annotations

import pytest

from gpufleet.facts.packages import TOOLKIT, NSIGHT_RELEASE, toolkit_components
from gpufleet.plans.package_plan import plan_package_change, toolkit_release
from gpufleet.rollout.moves import MoveRefusal, RolloutMove, rollout_move
from gpufleet.plans.profiling import nsight_packages
from gpufleet.rollout.manifest import purpose
from testing.aptrepo import default_packages

pytestmark = pytest.mark.unit


def _index(mm: str = "13-0") -> dict[str, dict[str, str]]:
    """What ToolkitIndex gives for the stand-in repository: the -X-Y packages and Nsight's."""
    out: dict[str, dict[str, str]] = {}
    for p in default_packages():
        if (p.name.endswith(f"-{mm}") and p.name.startswith(("cuda-", "lib", "gds-"))) or NSIGHT_RELEASE.match(p.name):
            out.setdefault(p.name, {})[p.version] = ", ".join(p.depends)
    return out


INDEX = _index()
NSIGHT_1302 = {"cuda-nsight-systems-13-0": "13.0.2-1", "nsight-systems-2025.3.2": "2025.3.2.474-1",
               "cuda-nsight-compute-13-0": "13.0.2-1", "nsight-compute-2025.3.1": "2025.3.1.4-1"}
NSIGHT_1303 = {"cuda-nsight-systems-13-0": "13.0.3-1", "nsight-systems-2025.3.2": "2025.3.2.999-1",
               "cuda-nsight-compute-13-0": "13.0.3-1", "nsight-compute-2025.3.1": "2025.3.1.9-1"}
OFFERED = {"cuda-toolkit-13-0": ["13.0.3-1", "13.0.2-1", "13.0.1-1"],
           "nsight-systems-2025.3.2": ["2025.3.2.999-1", "2025.3.2.474-1"],
           "nsight-compute-2025.3.1": ["2025.3.1.9-1", "2025.3.1.4-1"],
           "cuda-nsight-systems-13-0": ["13.0.3-1", "13.0.2-1", "13.0.1-1"],
           "cuda-nsight-compute-13-0": ["13.0.3-1", "13.0.2-1", "13.0.1-1"]}


def test_the_toolkit_walk_reaches_nsight_through_its_tools_at_the_builds_its_release_names():
    walk = toolkit_release(INDEX, "cuda-toolkit-13-0", "13.0.2-1")
    assert {p: walk.versions[p] for p in NSIGHT_1302} == NSIGHT_1302      # not the later 2025.3.2.999 build
    assert walk.versions["cuda-tools-13-0"] == walk.versions["cuda-visual-tools-13-0"] == "13.0.2-1"
    later = toolkit_release(INDEX, "cuda-toolkit-13-0", "13.0.3-1")
    assert {p: later.versions[p] for p in NSIGHT_1303} == NSIGHT_1303
    # a release-named package of another tool is not Nsight's: the walk stays in the toolkit
    assert not NSIGHT_RELEASE.match("nsight-graphics-2025.1.0") and not NSIGHT_RELEASE.match("nsight-systems")


def test_all_py_installs_the_toolkits_nsight_exact_and_holds_it_whatever_tuning_profiling_says():
    # admins: no Nsight asked for; the toolkit brings it anyway, at its release's builds, held
    plan = plan_package_change({"cuda-toolkit-13-0": "13.0.2"}, [], None, True, [], {}, [], OFFERED,
                               {"cuda-toolkit-13-0": INDEX})
    assert plan.missing == ()
    assert {p: plan.install[p] for p in NSIGHT_1302} == NSIGHT_1302
    assert set(NSIGHT_1302) <= set(plan.hold) and {"cuda-tools-13-0", "cuda-visual-tools-13-0"} <= set(plan.hold)
    # users: the same packages at the same builds, each asked for once
    users = {p: v.rsplit("-", 1)[0] for p, v in NSIGHT_1302.items()}
    assert nsight_packages("13.0.2") == users               # compat.yaml agrees with the toolkit's chain
    plan = plan_package_change({"cuda-toolkit-13-0": "13.0.2", **users}, [], None, True, [], {}, [], OFFERED,
                               {"cuda-toolkit-13-0": INDEX})
    assert plan.missing == () and {p: plan.install[p] for p in NSIGHT_1302} == NSIGHT_1302


def test_an_nsight_pin_the_toolkit_release_contradicts_changes_nothing_and_says_so():
    pins = {"cuda-toolkit-13-0": "13.0.2", "nsight-compute-2025.3.1": "2025.3.1.9"}   # 13.0.3's build
    plan = plan_package_change(pins, [], None, True, [], {}, [], OFFERED, {"cuda-toolkit-13-0": INDEX})
    assert plan.install == {}
    assert ("nsight-compute-2025.3.1", "nsight-compute-2025.3.1 2025.3.1.9 (the toolkit cuda-toolkit-13-0 13.0.2 "
            "names 2025.3.1.4)") in plan.missing


def test_the_installed_toolkit_counts_its_nsight_among_its_components():
    entries = {name: (version, "hi", INDEX[name][version])
               for name, version in toolkit_release(INDEX, "cuda-toolkit-13-0", "13.0.2-1").versions.items()}
    entries["cuda-toolkit-13-0"] = ("13.0.2-1", "hi", INDEX["cuda-toolkit-13-0"]["13.0.2-1"])
    found = toolkit_components(entries, ["cuda-toolkit-13-0"])
    assert found["nsight-systems-2025.3.2"] == ["2025.3.2.474-1", "2025.3.2.474", True]


def _rolled(release: str, index: dict, nsight: dict, offered: dict | None = None) -> RolloutMove | MoveRefusal:
    """The rollout's change for a host on toolkit 13.0.2 moving to `release` (or staying there)."""
    installed = {"cuda-toolkit-13-0": "13.0.2-1" if release != "13.0.2" else "13.0.1-1"}
    return rollout_move(installed, [], {"cuda-toolkit-13-0": [f"{release}-1"], **(offered or OFFERED)}, "580.126.09",
                        {"cuda-toolkit-13-0": release}, {"cuda-toolkit-13-0": index}, nsight, True)


def test_a_rollout_moving_the_toolkit_moves_its_nsight_to_the_new_release_builds():
    move = _rolled("13.0.3", INDEX, {})
    assert isinstance(move, RolloutMove), move
    assert {p: move.install[p] for p in NSIGHT_1303} == NSIGHT_1303
    assert move.install["cuda-nvcc-13-0"] == "13.0.96-1"
    assert set(NSIGHT_1303) <= set(move.hold)


def test_a_rollout_brings_users_nsight_of_the_new_release_even_when_the_toolkit_does_not_depend_on_it():
    bare = {name: {v: d for v, d in versions.items()} for name, versions in INDEX.items()}
    bare["cuda-toolkit-13-0"] = {v: ", ".join(x for x in d.split(", ") if not x.startswith("cuda-tools-"))
                                 for v, d in bare["cuda-toolkit-13-0"].items()}
    users = {p: v.rsplit("-", 1)[0] for p, v in NSIGHT_1302.items()}
    move = _rolled("13.0.2", bare, users)
    assert isinstance(move, RolloutMove), move
    assert "cuda-tools-13-0" not in move.install
    assert {p: move.install[p] for p in NSIGHT_1302} == NSIGHT_1302


def test_a_rollout_refuses_users_nsight_the_sources_or_the_toolkit_contradict():
    users = {p: v.rsplit("-", 1)[0] for p, v in NSIGHT_1302.items()}
    # the toolkit moves to 13.0.3, whose chain names later builds than users' pins
    refused = _rolled("13.0.3", INDEX, users)
    assert isinstance(refused, MoveRefusal) and refused.area == "cuda_version"
    assert ("nsight-compute-2025.3.1 2025.3.1.4 (the toolkit cuda-toolkit-13-0 13.0.3 names 2025.3.1.9)"
            in refused.reason), refused
    gone = {**OFFERED, "nsight-systems-2025.3.2": ["2025.3.2.999-1"]}
    refused = _rolled("13.0.2", {"cuda-toolkit-13-0": {"13.0.2-1": ""}}, users, gone)
    assert isinstance(refused, MoveRefusal) and "nsight-systems-2025.3.2 2025.3.2.474" in refused.reason, refused
    assert all(TOOLKIT.match(p) is None for p in users)


def test_the_drain_says_what_the_host_is_taken_out_of_service_for():
    base = {"installed": "580.126.09", "loaded": "580.126.09", "stack_moves": [], "profiling_pending": False}
    assert purpose({**base, "installed": "580.95.05"}, "580.126.09") == "driver upgrade to 580.126.09"
    assert purpose({**base, "loaded": "580.95.05"}, "580.126.09") == "driver upgrade to 580.126.09"
    assert purpose({**base, "stack_moves": ["cuda-toolkit-13-0 13.0.2 -> 13.0.3"]}, "580.126.09") == \
        "CUDA toolkit / cuDNN move (driver 580.126.09 stays)"
    assert purpose({**base, "profiling_pending": True}, "580.126.09") == \
        "reboot for tuning_profiling (driver 580.126.09 and packages stay)"
    assert purpose({}, "580.126.09") == "driver upgrade to 580.126.09"    # not surveyed (resumed): as before
