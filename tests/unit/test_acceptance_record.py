"""The record of a host's acceptance (facts/acceptance.py, gpufleet/plans/acceptance.py): a host
with none, or with one for another driver or CUDA toolkit than it has now, is not accepted; the
record gpufleet writes reads back as accepted on the host it was written for."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.facts.acceptance import RECORD, AcceptanceRecord, AcceptanceRecordData
from gpufleet.plans import acceptance as plan

pytestmark = pytest.mark.unit
CASES = Path(__file__).parent / "facts" / "acceptance.AcceptanceRecord"
MARK = "::gpufleet:: begin "


def recorded(case: str) -> AcceptanceRecordData:
    """The fact's value on a recorded case's output (tests/unit/facts/acceptance.AcceptanceRecord)."""
    return AcceptanceRecord().process(json.loads((CASES / f"{case}.json").read_text())["output"])


def test_a_record_for_the_driver_and_cuda_loaded_now_is_accepted():
    found = plan.standing(recorded("accepted"))
    assert found == plan.Standing(True, "", "2026-12-06T18:40:00Z")


def test_a_new_host_has_none_on_record():
    assert plan.standing(recorded("none_on_record")) == plan.Standing(False, "none on record")
    assert not plan.standing(recorded("no_driver_no_stack")).accepted


def test_a_driver_change_makes_the_record_stale():
    found = plan.standing(recorded("driver_changed"))
    assert not found.accepted
    assert found.why == "accepted 2026-12-06T18:40:00Z with driver 580.126.09, driver 580.159.04 loaded now"


def test_a_cuda_toolkit_change_makes_the_record_stale():
    now = recorded("accepted")
    moved = AcceptanceRecordData(now.record, "", now.driver, {"cuda-toolkit-13-0": "13.0.2"})
    found = plan.standing(moved)
    assert not found.accepted
    assert found.why == ("accepted 2026-12-06T18:40:00Z with cuda-toolkit-12-8 12.8.1, cuda-toolkit-13-0 13.0.2 now")


def test_a_broken_or_unknown_record_is_not_trusted():
    assert plan.standing(recorded("not_json")) == plan.Standing(
        False, f"the acceptance record is unreadable ({RECORD} is not JSON)")
    future = dict(recorded("accepted").record or {}, format=2)
    assert not plan.standing(AcceptanceRecordData(future, "", "580.126.09", {"cuda-toolkit-12-8": "12.8.1"})).accepted


def _verdict(*statuses: str) -> plan.Verdict:
    return plan.verdict("gpu-07", [plan.Finding(f"check {i}", s, f"measured {i}") for i, s in enumerate(statuses)])


def test_the_written_record_reads_back_as_accepted_until_the_driver_moves():
    """build_record -> the file's line as the fact prints it -> accepted; then another driver loaded."""
    verdict = _verdict(plan.PASS, plan.WARN, plan.SKIP)
    record = plan.build_record(verdict, "gpu-01", "580.126.09", {"cuda-toolkit-12-8": "12.8.1"}, 1796582400.0, "0.3.0")
    assert record["accepted_at"] == "2026-12-06T18:40:00Z" and record["peer"] == "gpu-01"
    assert record["gpufleet"] == "0.3.0" and record["host"] == "gpu-07"
    assert [f["status"] for f in record["findings"]] == ["pass", "warn", "skip"]    # the measurements, kept
    assert record["findings"][0]["message"] == "measured 0"

    def host_prints(driver: str) -> list[str]:
        return [MARK + "record", json.dumps(record, sort_keys=True), MARK + "driver",
                f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver}  Release Build  (x)  Tue",
                MARK + "stack", "cuda-toolkit-12-8 12.8.1", "libcudnn9-cuda-12 9.10.2.21"]

    assert plan.standing(AcceptanceRecord().process(host_prints("580.126.09"))).accepted
    assert not plan.standing(AcceptanceRecord().process(host_prints("580.159.04"))).accepted


def test_a_forged_section_in_the_record_is_refused():
    """The record is one JSON line: a line of it that looks like a marker is not the script's own."""
    from gpufleet.facts._common import FactParseError

    with pytest.raises(FactParseError):
        AcceptanceRecord().process([MARK + "record", "{}", MARK + "driver", MARK + "driver"])


def test_a_failed_acceptance_is_never_recorded():
    from pyinfra.api import Inventory, State
    from pyinfra.context import ctx_host, ctx_state

    from gpufleet.operations.acceptance import acceptance_recorded

    inventory = Inventory((["h"], {}))
    state = State(inventory)
    with ctx_state.use(state), ctx_host.use(inventory.get_host("h")):
        with pytest.raises(ValueError, match="a failed acceptance is not recorded"):
            list(acceptance_recorded._inner(_verdict(plan.PASS, plan.FAIL), "gpu-01"))  # type: ignore[attr-defined]


def test_a_reference_no_partner_proved_is_not_accepted():
    """gpufleet-deploy without a known-good peer: the first new host is the group's reference; it
    is accepted only when a partner's all-reduce with it passed (gpufleet/apps/new_hosts.py)."""
    from gpufleet.apps.new_hosts import reference_judged

    ref = plan.verdict("a", [plan.Finding(plan.ALLREDUCE, plan.SKIP, "this host is the reference")])

    def partner(name: str, status: str) -> plan.Verdict:
        return plan.verdict(name, [plan.Finding(plan.ALLREDUCE, status, f"with a: {status}")])

    proved = reference_judged({"a": ref, "b": partner("b", plan.PASS), "c": partner("c", plan.FAIL)}, ["a", "b", "c"], None)
    assert proved["a"].passed and not proved["c"].passed
    alone = reference_judged({"a": ref, "b": partner("b", plan.FAIL), "c": partner("c", plan.FAIL)}, ["a", "b", "c"], None)
    assert not alone["a"].passed and "no partner's all-reduce with it passed (b, c)" in alone["a"].summary()
    # with a known-good peer every host ran with it: nothing to prove by partners
    assert reference_judged({"a": ref, "b": partner("b", plan.FAIL)}, ["a", "b"], "z")["a"].passed
