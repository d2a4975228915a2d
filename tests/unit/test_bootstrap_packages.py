"""gpufleet/plans/bootstrap_packages.py on recorded facts, tests as data: one JSON file per case
under tests/unit/plans/bootstrap/<case>.json.

A case names a driver plan case (tests/unit/plans/driver/<driver_case>.json: its inventory and
recorded facts give the DriverPlan, and the tier the other areas' plans) and the packages
installed before the run (DebPackages' names):

    {"doc": ..., "driver_case": "hgx_new_host", "installed": ["openssh-server", ...],
     "before": {DriverState's fields}   (optional: replaces the driver case's)
     "expect": {"planned": false}
             | {"driver": true, "first": [...], "plain_includes": [...], "plain_excludes": [...],
                "toolkit": true, "left": ["node exporter", ...]}}
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpufleet.config.settings import Settings, _settings_for
from gpufleet.plans.base import plan_base
from gpufleet.plans.bootstrap_packages import BootstrapPackages, plan_bootstrap, union_change
from gpufleet.plans.docker import DockerPlan, plan as docker_plan, repositories
from gpufleet.plans.driver import DriverPlan
from gpufleet.plans.package_plan import plan_package_change
from tests.unit.test_driver_plan import planned as driver_planned

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent
CASES = sorted((HERE / "plans" / "bootstrap").glob("*.json"))


def _driver_case(name: str) -> dict[str, Any]:
    return json.loads((HERE / "plans" / "driver" / f"{name}.json").read_text())


def _plans(case: dict[str, Any]) -> tuple[Settings, DriverPlan, DockerPlan]:
    driver_case = _driver_case(case["driver_case"])
    if "before" in case:  # the driver case's facts, its DriverState replaced
        driver_case = {**driver_case, "facts": {**driver_case["facts"], "before": case["before"]}}
    settings, problems = _settings_for("gpu-a01", driver_case["inventory"])
    assert settings is not None and not problems, problems
    driver = driver_planned(driver_case)
    assert isinstance(driver, DriverPlan), driver
    installed = {p: "1" for p in case["installed"]}
    docker = docker_plan(settings, daemon_raw=None, installed=installed, candidates={"docker-cli": None},
                         repos=repositories(settings, "debian", "bookworm", "amd64"), gpu_uuids=[])
    assert isinstance(docker, DockerPlan), docker
    return settings, driver, docker


def _bootstrap(case: dict[str, Any]) -> tuple[BootstrapPackages | None, DriverPlan, DockerPlan]:
    settings, driver, docker = _plans(case)
    planned = plan_bootstrap(driver, docker, plan_base(settings), set(case["installed"]),
                             driver_hold=settings.driver_hold, node_exporter=settings.monitoring_node_exporter,
                             dcgm_exporter=settings.monitoring_dcgm_exporter)
    return planned, driver, docker


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_bootstrap_plan(path: Path) -> None:
    case = json.loads(path.read_text())
    planned, driver, docker = _bootstrap(case)
    expect = case["expect"]
    if expect.get("planned") is False:
        assert planned is None, planned
        return
    assert planned is not None
    if expect["driver"]:
        # the driver stack exactly as its own change asks for it
        assert planned.releases == driver.change.releases and planned.releases
        assert planned.present == driver.change.present and planned.pinning == driver.change.pinning
    else:
        assert not planned.releases and not planned.present and planned.pinning is None
        assert not set(planned.names) & {*driver.change.releases, *driver.change.present}
    assert list(planned.first) == expect["first"]
    assert set(expect["plain_includes"]) <= set(planned.plain), planned.plain
    assert not set(expect["plain_excludes"]) & set(planned.names), planned.names
    toolkit = dict(spec.split("=", 1) for spec in docker.toolkit_packages)
    assert planned.exact == (toolkit if expect["toolkit"] else {})
    assert [what for what, _ in planned.left] == expect["left"]
    assert not set(case["installed"]) & set(planned.names), "a first install takes no installed package"


def test_the_cases_cover_a_fresh_host_a_driver_present_and_a_converged_host() -> None:
    cases = [json.loads(p.read_text()) for p in CASES]
    assert any(c["expect"].get("planned") is False for c in cases)
    assert any(c["expect"].get("driver") is True for c in cases)
    assert any("driver stack" in c["expect"].get("left", []) for c in cases)


def _offered(planned: BootstrapPackages) -> dict[str, list[str]]:
    """An index offering each release at one Debian revision, and a newer one apt alone would take."""
    return {p: [f"{r}-1", f"{r}.9-1"] for p, r in planned.releases.items()}


@pytest.mark.parametrize("name", ["fresh_hgx_host", "distro_dev_host"])
def test_the_union_s_versions_are_each_area_plan_s(name: str) -> None:
    case = json.loads((HERE / "plans" / "bootstrap" / f"{name}.json").read_text())
    planned, driver, docker = _bootstrap(case)
    assert planned is not None
    installed: dict[str, str | None] = {p: "1" for p in case["installed"]}
    offered = _offered(planned)
    toolkits = {p: {r: ""} for p, r in planned.releases.items() if p.startswith("cuda-toolkit-")}
    own = plan_package_change(driver.change.releases, driver.change.present, driver.change.pinning, planned.hold,
                              (), installed, [], offered, toolkits)
    union = union_change(planned, installed, [], offered, toolkits)
    assert not union.missing and not own.missing
    # the driver stack: the versions, version lock and holds its own change would take
    assert {p: union.install[p] for p in own.install} == own.install
    assert set(own.first) <= set(union.first)
    # held as each area holds them: the driver stack as its change, the engine and toolkit as docker's
    assert set(union.hold) == {*own.hold, *docker.hold}
    # the container toolkit at the docker plan's pinned version; the rest as the sources offer them
    for spec in docker.toolkit_packages:
        package, version = spec.split("=", 1)
        assert union.install[package] == version
    assert all(union.install[p] is None for p in planned.plain)
    assert set(union.install) == set(planned.names)


def test_a_release_the_sources_do_not_offer_changes_nothing() -> None:
    case = json.loads((HERE / "plans" / "bootstrap" / "fresh_hgx_host.json").read_text())
    planned, _, _ = _bootstrap(case)
    assert planned is not None
    union = union_change(planned, {}, [], {}, {})
    assert union.missing and not union.install
