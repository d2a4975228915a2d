"""The fleet report's clocks column in the tuning plan's model (gpufleet/plans/tuning.py), on recorded
nvidia-smi output: what gpufleet applied (application clocks before R595, read back from
nvidia-smi; locked clocks from R595, read from gpufleet's records in /run, since nvidia-smi
cannot read locks back), labelled, the planned pair beside it, and `= planned` / `≠ planned`
exactly when the validation gate passes / fails the clocks.

Application-clock driver: the real 2 x H200 recording (driver 580.159.04, tests/fixtures/facts/
h200-x2). Locked-clock driver: the same recording as a R595 driver prints it (driver version
595.45.04, the four application-clock fields "[Requested functionality has been deprecated]",
as the B200 sample in tests/fixtures/facts/samples shows them): composed here in the open, as no
R595 host was recorded; the lock records are LockedClocks' output lines."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
from jsonschema import validate

from gpufleet.facts.gpu import GpuState
from gpufleet.facts.gpu_tuning import LockedClocks
from gpufleet.apps.report.gather import clock_column
from gpufleet.apps.report.render import SCHEMA_PATH, document, html_page
from gpufleet.apps.report.view import cells, clocks_text
from gpufleet.catalog.tiers import tier_defaults
from gpufleet.plans.tuning import clocks_summary, host_clocks
from gpufleet.checks.validation import FAIL, PASS, clocks_as_set
from testing.chromium import parse_report
from tests.unit.test_facts_gpu import recorded_gpu_state

pytestmark = pytest.mark.unit

DEPRECATED = "[Requested functionality has been deprecated]"
BUS = ("00000000:00:06.0", "00000000:00:07.0")


def recorded_580() -> list[str]:
    return recorded_gpu_state("h200-x2")


def as_r595(output: list[str]) -> list[str]:
    """The recorded query-gpu lines as R595 prints them: driver 595.45.04, application clocks
    deprecated (GPU_QUERY_FIELDS columns 5 and 8..11); everything else as recorded."""
    out, in_query = [], False
    for line in output:
        if line.startswith("::gpufleet:: "):
            in_query = line == "::gpufleet:: begin query-gpu"
        elif in_query:
            cols = line.split(", ")
            cols[5] = "595.45.04"
            cols[8:12] = [DEPRECATED] * 4
            line = ", ".join(cols)
        out.append(line)
    return out


class FakeHost:
    """Answers GpuState and LockedClocks from recorded output through the facts' own process();
    every other fact its default (no NICs, no cpufreq: what the recording does not cover)."""

    def __init__(self, gpu_output: list[str], lock_lines: list[str] = ()):  # type: ignore[assignment]
        self.gpu = GpuState().process(gpu_output)
        self.locks = LockedClocks().process(list(lock_lines))

    def get_fact(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        if cls is GpuState:
            return self.gpu
        if cls is LockedClocks:
            return self.locks
        return cls.default()


def settings(policy: Any) -> SimpleNamespace:
    return SimpleNamespace(**{**tier_defaults("research"), "tier": "research", "clock_policy": policy})


def column(host: FakeHost, policy: Any) -> dict:
    return clock_column(host, settings(policy), host.gpu.driver_version)


def gate(gpu_output: list[str], lock_lines: list[str], policy: Any) -> Any:
    host = FakeHost(gpu_output, lock_lines)  # its own host: the gate reads the facts afresh
    return clocks_as_set(SimpleNamespace(host=host, settings=settings(policy), gpu=host.gpu))


def tuning_cell(clocks: dict, checks: list[dict] = ()) -> Any:  # type: ignore[assignment]
    row = {"host": "h", "status": "ok", "persistence": "on", "gpu_clocks": clocks, "clocks": clocks_text(clocks),
           "validation": {"checks": list(checks), "failed": []}}
    return cells(row)["tuning"]


# --- application clocks (driver 580, recorded) -------------------------------------------------


def test_application_clock_driver_at_max_shows_the_pair_equal_to_the_plan():
    host = FakeHost(recorded_580())
    clocks = column(host, "max")
    assert clocks == {
        "method": "application", "driver": "580.159.04", "policy": "max", "refused": None,
        "gpus": [{"index": i, "model": "NVIDIA H200", "bus_id": BUS[i], "applied": "3201,1980",
                  "planned": "3201,1980", "at_plan": True} for i in (0, 1)]}
    assert clocks_text(clocks) == "application 3201,1980 = planned"
    # the plan view's line and the gate's message name the same pair
    assert clocks_summary(host_clocks(FakeHost(recorded_580()), "max")) == "-ac 3201,1980 on GPU 0, 1 (NVIDIA H200)"
    assert gate(recorded_580(), [], "max").status == PASS
    cell = tuning_cell(clocks)
    assert (cell.text, cell.resolved, cell.differs, cell.compared) == (
        "persistence on\napplication clocks 3201,1980", "3201,1980", False, "planned")


def test_application_clock_driver_off_an_explicit_pair_is_flagged_like_a_version():
    pair = {"memory": 3201, "graphics": 1785}
    clocks = column(FakeHost(recorded_580()), pair)
    assert clocks["policy"] == "memory 3201 MHz, graphics 1785 MHz"
    assert [(g["applied"], g["planned"], g["at_plan"]) for g in clocks["gpus"]] == [("3201,1980", "3201,1785", False)] * 2
    assert clocks_text(clocks) == "application 3201,1980 ≠ planned 3201,1785"
    result = gate(recorded_580(), [], pair)
    assert result.status == FAIL and "wants 3201,1785" in result.message
    # the checks passed on this row: the difference alone fails the cell, as a version's does
    cell = tuning_cell(clocks, [{"area": "tuning", "name": "x", "status": "pass", "message": "", "fix": ""}])
    assert (cell.status, cell.differs, cell.resolved) == ("fail", True, "3201,1785")


# --- locked clocks (R595: the recording as that driver prints it) ------------------------------


@pytest.mark.parametrize("locks, text, at_plan", [
    ([], "locked none ≠ planned 3201,1980", [False, False]),
    ([f"{BUS[0]} 3201,1980", f"{BUS[1]} 3201,1980"], "locked 3201,1980 = planned", [True, True]),
    ([f"{BUS[0]} 3201,1980"], "locked 3201,1980 = planned on GPU 0; none ≠ planned 3201,1980 on GPU 1", [True, False]),
    ([f"{BUS[0]} 3201,1785", f"{BUS[1]} 3201,1980"],
     "locked 3201,1785 ≠ planned 3201,1980 on GPU 0; 3201,1980 = planned on GPU 1", [False, True]),
], ids=["never-locked", "locked-at-max", "one-gpu-locked", "one-gpu-locked-lower"])
def test_locked_clock_driver_shows_the_recorded_locks_against_the_plan(locks, text, at_plan):
    output = as_r595(recorded_580())
    host = FakeHost(output, locks)
    assert host.gpu.gpus[0].app_clocks is None  # R595: nvidia-smi has no application clocks to show
    clocks = column(host, "max")
    assert (clocks["method"], clocks["driver"]) == ("locked", "595.45.04")
    assert [g["planned"] for g in clocks["gpus"]] == ["3201,1980"] * 2
    assert [g["at_plan"] for g in clocks["gpus"]] == at_plan
    assert clocks_text(clocks) == text
    # the plan view words the same target the same way, and the gate agrees GPU by GPU
    assert clocks_summary(host_clocks(FakeHost(output, locks), "max")) == "-lgc/-lmc 3201,1980 on GPU 0, 1 (NVIDIA H200)"
    result = gate(output, locks, "max")
    assert result.status == (PASS if all(at_plan) else FAIL)
    wanted = [f"GPU {i} NVIDIA H200 ({BUS[i]}): wants 3201,1980" for i in (0, 1) if not at_plan[i]]
    assert result.status == PASS or result.message == "; ".join(wanted)
    cell = tuning_cell(clocks)
    assert cell.differs == (not all(at_plan)) and cell.compared == "planned"
    assert cell.status == ("info" if all(at_plan) else "fail")
    assert any(line.startswith("locked clocks (nvidia-smi -lgc/-lmc;") and "(driver 595.45.04)" in line
               for line in cell.details)


def test_default_policy_on_an_application_clock_driver_is_the_gpus_default_pair():
    # the recording's application clocks are its default application clocks (3201,1980)
    clocks = column(FakeHost(recorded_580()), "default")
    assert [(g["applied"], g["planned"], g["at_plan"]) for g in clocks["gpus"]] == [("3201,1980", "default", True)] * 2
    assert clocks_text(clocks) == "application 3201,1980 = planned default"
    assert gate(recorded_580(), [], "default").status == PASS


def test_default_policy_on_a_locked_clock_driver_wants_no_lock():
    output = as_r595(recorded_580())
    assert clocks_text(column(FakeHost(output), "default")) == "locked none = planned default"
    locked = column(FakeHost(output, [f"{BUS[0]} 3201,1980"]), "default")
    assert clocks_text(locked) == "locked 3201,1980 ≠ planned default on GPU 0; none = planned default on GPU 1"
    assert gate(output, [f"{BUS[0]} 3201,1980"], "default").status == FAIL


def test_unmanaged_and_refused_policies_show_the_applied_pair_without_judging_it():
    unmanaged = column(FakeHost(recorded_580()), "unmanaged")
    assert clocks_text(unmanaged) == "application 3201,1980 (clock_policy: unmanaged)"
    cell = tuning_cell(unmanaged)
    assert (cell.resolved, cell.differs, cell.note) == (None, False, "clock_policy: unmanaged")
    refused = column(FakeHost(recorded_580()), {"memory": 1234, "graphics": 999})
    assert refused["refused"].startswith("key 'clock_policy': clock pair memory 1234 MHz, graphics 999 MHz is not "
                                         "supported by GPU 0 NVIDIA H200")
    assert [g["planned"] for g in refused["gpus"]] == [None, None]
    assert clocks_text(refused) == "application 3201,1980; the tuning plan refuses this host"
    assert tuning_cell(refused).status == "fail"


# --- the JSON and the page -----------------------------------------------------------------------


def _row(name: str, clocks: dict) -> dict:
    return {"host": name, "address": name, "status": "ok", "state": "changed", "tier": "hgx", "seconds": 1.0,
            "drift": None, "gpus": [{"model": "NVIDIA H200", "count": 2}], "persistence": "on",
            "gpu_clocks": clocks, "clocks": clocks_text(clocks), "validation": {
                "counts": {"pass": 0, "fail": 0, "warn": 0, "skip": 0, "unmanaged": 0}, "failed": [], "checks": []}}


def test_the_rows_match_the_schema_and_the_page_flags_the_difference():
    r595 = as_r595(recorded_580())
    rows = [_row("app-at-plan", column(FakeHost(recorded_580()), "max")),
            _row("locked-off-plan", column(FakeHost(r595, [f"{BUS[0]} 3201,1785"]), "max")),
            _row("unmanaged", column(FakeHost(r595), "unmanaged"))]
    doc = json.loads(json.dumps(document(rows, "inventory.py", 1.0)))
    validate(doc, json.loads(SCHEMA_PATH.read_text()))
    page = html_page(doc)
    by = {r.host: r for r in parse_report(page).rows}
    at_plan = by["app-at-plan"]
    assert at_plan.cells["tuning"] == "info"  # no check on these rows: no judgement, and no difference
    assert at_plan.text["tuning"].startswith("persistence on · application clocks 3201,1980 = planned 2 GPUs"), at_plan
    assert (f"GPU 1 NVIDIA H200 ({BUS[1]}): application 3201,1980, planned 3201,1980 application clocks "
            "(nvidia-smi -ac), as nvidia-smi reads them (driver 580.159.04)") in at_plan.text["tuning"]
    off = by["locked-off-plan"]
    assert off.cells["tuning"] == "fail"
    assert "persistence on · locked clocks 3201,1785 / none ≠ planned 3201,1980 2 GPUs" in off.text["tuning"], off
    assert f"GPU 1 NVIDIA H200 ({BUS[1]}): locked none, planned 3201,1980" in off.text["tuning"]
    assert re.search(r'<span class="want differs" data-planned="3201,1980">&ne; planned 3201,1980</span>', page)
    assert by["unmanaged"].text["tuning"].startswith("persistence on · locked clocks none clock_policy: unmanaged")
    # the terminal and Markdown tables carry the one-line text
    from gpufleet.apps.report.render import markdown
    assert "| locked 3201,1785 ≠ planned 3201,1980 on GPU 0; none ≠ planned 3201,1980 on GPU 1 |" in markdown(doc)


def test_an_older_row_without_gpu_clocks_still_renders_its_text():
    row = {**_row("old", column(FakeHost(recorded_580()), "max")), "clocks": "5001,585"}
    del row["gpu_clocks"]
    cell = cells(row)["tuning"]
    assert (cell.text, cell.resolved) == ("persistence on\nclocks 5001,585", None)


# --- MIG: no clock plan for GPUs in MIG mode (gpu_mig), as in the deploy and the gate ------------------


class MigHost(FakeHost):
    def __init__(self, gpu_output: list[str], mig_output: list[str]):
        super().__init__(gpu_output)
        from gpufleet.facts.mig import MigState

        self.mig = MigState().process(mig_output)

    def get_fact(self, cls: Any, *args: Any, **kwargs: Any) -> Any:
        from gpufleet.facts.mig import MigState

        return self.mig if cls is MigState else super().get_fact(cls, *args, **kwargs)


def test_gpus_in_mig_mode_have_no_clock_plan_in_the_report():
    from pathlib import Path

    case = Path(__file__).parent / "facts/mig.MigState/one_partitioned_one_without_compute_instance.json"
    host = MigHost(recorded_580(), json.loads(case.read_text())["output"])
    layout = SimpleNamespace(**{**vars(settings("max")), "gpu_mig": {0: ("3g.71gb", "3g.71gb"), 1: ("7g.141gb",)}})
    clocks = clock_column(host, layout, host.gpu.driver_version)
    assert [(g["index"], g["planned"], g["at_plan"]) for g in clocks["gpus"]] == [(0, None, None), (1, None, None)]
    # gpu_mig none: both GPUs are turned off this run, so both are back in the clock plan
    clocks = clock_column(host, settings("max"), host.gpu.driver_version)
    assert [(g["index"], g["planned"]) for g in clocks["gpus"]] == [(0, "3201,1980"), (1, "3201,1980")]


def test_the_tuning_cell_names_the_mig_layout():
    check = {"area": "tuning", "name": "MIG partitions are what gpu_mig sets", "status": "pass",
             "message": "GPU 0, 1: 3g.71gb + 3g.71gb", "fix": ""}
    row = {"host": "h", "status": "ok", "persistence": "on", "mig": "ok: GPU 0, 1: 3g.71gb + 3g.71gb",
           "validation": {"checks": [check], "failed": []}}
    cell = cells(row)["tuning"]
    assert cell.text.splitlines() == ["persistence on", "MIG ok: GPU 0, 1: 3g.71gb + 3g.71gb"]
