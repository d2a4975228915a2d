"""The e2e tests' reading of pyinfra's results table (tests/e2e/pyinfra_cli.py), on recorded
real pyinfra 3.10 output (tests/fixtures/pyinfra/): strict, so that a run that never executed
cannot pass for one that changed nothing."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.pyinfra_cli import NoResultsTable, Run, changed_operations, results_table

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pyinfra"


def recorded(name: str) -> str:
    return (FIXTURES / f"{name}.out").read_text()


def test_first_run_lists_what_changed():
    ops = changed_operations(recorded("tuning-first"))
    assert len(ops) == 11
    assert "GPU persistence, clocks and environment profiles | Install the NVIDIA persistence daemon " \
           "(nvidia-persistenced)" in ops
    run = Run(0, recorded("tuning-first"))
    assert (run.changed, run.unchanged, run.errors) == (11, 3, 0)


def test_second_run_changes_nothing_and_says_so():
    table = results_table(recorded("tuning-second"))
    assert len(table.rows) == 14 and table.total.no_change == 14
    assert changed_operations(recorded("tuning-second")) == []


def test_one_unreachable_host_still_prints_the_reached_hosts_table():
    run = Run(1, recorded("ghost-mixed"))
    assert changed_operations(run) == [] and run.unchanged == 14


@pytest.mark.parametrize("name", ["ghost-only", "refused", "op-failed"])
def test_a_run_without_the_table_fails_loudly(name):
    text = recorded(name)
    with pytest.raises(NoResultsTable, match="Results") as info:
        changed_operations(text)
    assert "pyinfra error" in str(info.value)   # the output is in the failure
    for attr in ("changed", "unchanged", "errors"):
        with pytest.raises(NoResultsTable):
            getattr(Run(1, text), attr)


def test_a_cut_or_garbled_table_fails_too():
    lines = recorded("tuning-second").splitlines()
    total = next(i for i, line in enumerate(lines) if "Grand total" in line)
    with pytest.raises(NoResultsTable, match="no 'Grand total'"):
        changed_operations("\n".join(lines[:total]))
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("Operation"))
    with pytest.raises(NoResultsTable, match="table header"):
        changed_operations("\n".join(lines[:header] + lines[header + 1:]))
    garbled = lines[:header + 2] + ["    something else entirely"] + lines[header + 2:]
    with pytest.raises(NoResultsTable, match="not a row"):
        changed_operations("\n".join(garbled))
    wrong = [line.replace("14      -         -       14", "14      1         -       13") for line in lines]
    with pytest.raises(NoResultsTable, match="does not add up"):
        changed_operations("\n".join(wrong))


def test_colour_codes_are_ignored():
    text = recorded("tuning-first").replace("Grand total", "\x1b[1mGrand total\x1b[0m")
    assert len(changed_operations(text)) == 11


def test_a_failing_runs_explanation_starts_with_the_operation_that_failed():
    """Run.why, which e2e assertions print: the failed operation's own section first, so later
    output (a daemon's journal appended, the results table) cannot push it out of sight."""
    from tests.e2e.pyinfra_cli import Run, failed_operations

    recorded = (FIXTURES / "op-failed.out").read_text()
    assert failed_operations(recorded).splitlines() == [
        "--> Starting operation: server.shell (false)", "    [gf-exitcodes-1] Error: executed 0 commands"]
    why = Run(1, recorded + "\n--- journalctl -u docker\n" + "dockerd: noise\n" * 500).why
    assert why.startswith("--> Starting operation: server.shell (false)\n    [gf-exitcodes-1] Error:")
    assert failed_operations((FIXTURES / "tuning-second.out").read_text()) == ""
