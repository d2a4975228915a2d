"""tools/rollout, tools/rollback, tools/fleet-report: bad paths and numbers are refused when the
arguments are parsed (exit 2, one line naming the argument), before any inventory is loaded."""

from __future__ import annotations

import pytest

from gpufleet.apps.report.cli import main as report_main
from gpufleet.apps.rollout.cli import rollback_main, rollout_main

pytestmark = pytest.mark.unit


@pytest.fixture
def inventory(tmp_path):
    path = tmp_path / "fleet.py"
    path.write_text("hosts = []\n")
    return str(path)


def _refused(main, argv, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if fragment in line], err


@pytest.mark.parametrize("args, fragment", [
    (["--canary", "-1"], "argument --canary: -1 out of range: allowed 0 to"),
    (["--canary", "one"], "argument --canary: invalid int value: 'one'"),
    (["--batch-size", "0"], "argument --batch-size: 0 out of range"),
    (["--batch-percent", "0"], "argument --batch-percent: 0 out of range"),
    (["--batch-percent", "150"], "argument --batch-percent: 150 out of range"),
    (["--max-unavailable", "0"], "argument --max-unavailable: 0 out of range"),
    (["--max-fail", "-1"], "argument --max-fail"),
    (["--max-fail", "200%"], "a percentage must be <= 100%"),
    (["--wait-idle", "-5"], "argument --wait-idle: -5 out of range"),
    (["--reboot-timeout", "0"], "argument --reboot-timeout: 0 out of range"),
])
def test_rollout_numbers(inventory, args, fragment, capsys):
    _refused(rollout_main, [inventory, "--driver-version", "580.126.09", *args, "--dry-run"], fragment, capsys)


@pytest.mark.parametrize("main, argv", [
    (rollout_main, ["inventories/clod.py", "--driver-version", "580.126.09", "--dry-run"]),
    (rollback_main, ["inventories/clod.py", "gpu-a01", "--dry-run"]),
])
def test_mistyped_inventory_path(main, argv, capsys):
    _refused(main, argv, "argument inventory: no such inventory file: inventories/clod.py", capsys)


def test_fleet_report_mistyped_inventory_and_workers(inventory, capsys):
    _refused(report_main, ["inventories/clod.py"], "no such inventory file: inventories/clod.py", capsys)
    _refused(report_main, [inventory, "--workers", "0"], "argument --workers: 0 out of range", capsys)
