"""The two ways gpufleet stops a host (gpufleet/config/failures.py), in a real pyinfra State with two
hosts that are never connected (their operations run Python only): `refuse` at planning time and
`fail` at execution time each print one line with host, area, reason and fix, stop that host
alone, and the other host carries on."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pyinfra_cli  # noqa: F401  (gevent monkey-patching, as the CLI does, before pyinfra.api)
import pytest
from pyinfra import host
from pyinfra.api import Config, FunctionCommand, Inventory, State, operation
from pyinfra.api.deploy import add_deploy
from pyinfra.api.operations import run_ops
from pyinfra.api.state import StateStage

from gpufleet.config.failures import fail, fail_now, refuse, stop_line

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RAN: list[str] = []


@operation()
def _step(failed: str = "", failed_in_callback: str = ""):
    if host.name == failed:
        yield fail(host, "validation", "1 check(s) failed: persistence: off on GPU 0.", "run deploys/tuning.py.")
        return
    if host.name == failed_in_callback:  # a callback that finds the failure while it runs
        yield FunctionCommand(lambda state, host: fail_now(state, host, "reboot", "the host did not come back.",
                                                        "look at its console."), (), {})
        return
    yield FunctionCommand(lambda: RAN.append(host.name), (), {})


def _deploy(refused: str = "", failed: str = "", failed_in_callback: str = "") -> None:
    """As gpufleet's deploys do: refuse before planning anything for the host."""
    if host.name == refused:
        refuse(host, "driver_version", "580.1.2 is not a release", "set driver_version to 580.126.09")
        return
    _step(name="Do the step", failed=failed, failed_in_callback=failed_in_callback)


def _run(caplog: pytest.LogCaptureFixture, **kwargs: str) -> tuple[State, list[str]]:
    RAN.clear()
    inventory = Inventory((["gpu-a01", "gpu-b01"], {}))
    state = State(inventory, Config())
    for h in inventory:
        state.activate_host(h)  # as connect_all does; nothing here needs a connection
    state.set_stage(StateStage.Prepare)
    with caplog.at_level(logging.INFO, logger="pyinfra"):
        add_deploy(state, _deploy, **kwargs)
        state.set_stage(StateStage.Execute)
        run_ops(state)
    return state, [r.getMessage() for r in caplog.records]


def test_refuse_prints_host_area_reason_fix_and_only_that_host_stops(caplog):
    state, lines = _run(caplog, refused="gpu-a01")
    assert ("[gpu-a01] refused (driver_version): 580.1.2 is not a release. "
            "Fix: set driver_version to 580.126.09") in lines
    assert {h.name for h in state.failed_hosts} == {"gpu-a01"}
    assert RAN == ["gpu-b01"]  # the other host carried on
    # refused at planning: no operation of the refused host was even planned
    assert not state.ops[state.inventory.get_host("gpu-a01")]


def test_fail_prints_host_area_reason_fix_at_execution_and_only_that_host_stops(caplog):
    state, lines = _run(caplog, failed="gpu-b01")
    assert ("[gpu-b01] failed (validation): 1 check(s) failed: persistence: off on GPU 0. "
            "Fix: run deploys/tuning.py") in lines
    assert {h.name for h in state.failed_hosts} == {"gpu-b01"}
    assert RAN == ["gpu-a01"]
    # planned like any operation: the host stopped when it ran (an error result, not a refusal)
    results = state.get_results_for_host(state.inventory.get_host("gpu-b01"))
    assert results.error_ops == 1 and results.success_ops == 0


def test_fail_now_in_a_running_callback_prints_the_same_line_and_only_that_host_stops(caplog):
    state, lines = _run(caplog, failed_in_callback="gpu-a01")
    assert "[gpu-a01] failed (reboot): the host did not come back. Fix: look at its console" in lines
    assert {h.name for h in state.failed_hosts} == {"gpu-a01"}
    assert RAN == ["gpu-b01"]
    results = state.get_results_for_host(state.inventory.get_host("gpu-a01"))
    assert results.error_ops == 1 and results.success_ops == 0


def test_both_hosts_carry_on_when_nothing_stops_them(caplog):
    state, lines = _run(caplog)
    assert sorted(RAN) == ["gpu-a01", "gpu-b01"] and not state.failed_hosts
    assert not any(" refused (" in line or " failed (" in line for line in lines)


def test_one_wording_for_every_stop():
    assert stop_line("h", "refused", "tier", "hardware does not match.", "set tier.") == \
        "[h] refused (tier): hardware does not match. Fix: set tier"


def test_no_host_is_stopped_another_way():
    """deploys/, operations/ and the core stop a host only through gpufleet.config.failures: no direct
    state.fail_hosts, no DeployError / OperationError raised, no callback failing with only a
    log line of its own (`return False` after logging)."""
    found = []
    for top in ("gpufleet", "deploys", "operations"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel == "gpufleet/config/failures.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fail_hosts":
                    found.append(f"{rel}:{node.lineno}: fail_hosts")
                if isinstance(node, ast.Raise) and node.exc is not None:
                    call = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                    name = call.attr if isinstance(call, ast.Attribute) else getattr(call, "id", "")
                    if name in ("DeployError", "OperationError"):
                        found.append(f"{rel}:{node.lineno}: raise {name}")
    assert not found, "stop a host with gpufleet.config.failures.refuse / fail:\n" + "\n".join(found)
