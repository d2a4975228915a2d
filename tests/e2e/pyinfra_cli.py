"""Run the real pyinfra CLI the way an operator does, and read its results table.

The table is read strictly: a run whose output has no complete table (pyinfra stopped before
executing: a refusal at planning, no host reachable, a crash) makes `changed_operations()` and
the counts raise with the output, so "the second run changes nothing" cannot pass on a run that
never ran. pyinfra 3.10 prints (tests/fixtures/pyinfra/*.out are recorded runs):

    --> Results:
        Operation                          Hosts   Success   Error   No Change
        Set the CPU frequency governor     1       -         -       1
        Grand total                        20      -         -       20
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_HEADER = re.compile(r"^\s*Operation\s+Hosts\s+Success\s+Error\s+No Change\s*$")
# the four counts are the last columns: an operation's name may hold anything before them
_ROW = re.compile(r"^\s*(?P<op>\S.*?)\s{2,}(?P<hosts>\d+|-)\s+(?P<success>\d+|-)\s+(?P<error>\d+|-)"
                  r"\s+(?P<no_change>\d+|-)\s*$")


class NoResultsTable(AssertionError):
    """pyinfra's output has no complete results table: the run did not get to execute."""


@dataclasses.dataclass(frozen=True)
class Row:
    operation: str
    hosts: int
    success: int      # hosts the operation changed
    error: int
    no_change: int


@dataclasses.dataclass(frozen=True)
class Table:
    rows: tuple[Row, ...]
    total: Row


def _count(text: str) -> int:
    return 0 if text == "-" else int(text)


def results_table(output: str) -> Table:
    """The results table of pyinfra's output, or NoResultsTable (with the output's tail)."""
    lines = [_ANSI.sub("", line) for line in output.splitlines()]
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "--> Results:")
    except StopIteration:
        raise NoResultsTable("no '--> Results:' in pyinfra's output (it stopped before executing):\n"
                             + output[-4000:]) from None
    body = [line for line in lines[start + 1:]]
    if not body or not _HEADER.match(body[0]):
        raise NoResultsTable("'--> Results:' not followed by pyinfra's table header:\n" + output[-4000:])
    rows: list[Row] = []
    for line in body[1:]:
        m = _ROW.match(line)
        if not m:
            raise NoResultsTable(f"a line of pyinfra's results table that is not a row: {line!r}\n"
                                 + output[-4000:])
        row = Row(m["op"], *(_count(m[k]) for k in ("hosts", "success", "error", "no_change")))
        if row.operation == "Grand total":
            if (row.hosts, row.success, row.error, row.no_change) != tuple(
                    sum(getattr(r, k) for r in rows) for k in ("hosts", "success", "error", "no_change")):
                raise NoResultsTable(f"the Grand total does not add up: {row} over {len(rows)} rows\n"
                                     + output[-4000:])
            return Table(tuple(rows), row)
        rows.append(row)
    raise NoResultsTable("pyinfra's results table has no 'Grand total' row (cut short):\n" + output[-4000:])


@dataclasses.dataclass
class Run:
    returncode: int
    output: str

    def __str__(self) -> str:
        return self.output

    @property
    def table(self) -> Table:
        return results_table(self.output)

    @property
    def changed(self) -> int:
        """Operations that changed something, summed over hosts (raises without a table)."""
        return self.table.total.success

    @property
    def unchanged(self) -> int:
        return self.table.total.no_change

    @property
    def errors(self) -> int:
        return self.table.total.error

    @property
    def why(self) -> str:
        """For a failing assertion: the operations that failed, each with its own output (what the
        host said, pyinfra's error), first; then the output's tail. The tail alone hid the failing
        operation behind later output (a daemon's journal, the results table)."""
        return failed_operations(self.output) + "\n--- end of pyinfra's output:\n" + self.output[-2500:]


_ERROR = re.compile(r"\[[^\]]+\] (Error|error|Failed|failed|refused)\b")


def failed_operations(output: str, max_lines: int = 40) -> str:
    """Each operation section of pyinfra's output in which a host reported an error, whole (up to
    `max_lines` lines each), in order; "" when no operation failed."""
    sections: list[list[str]] = [[]]
    for line in (_ANSI.sub("", raw) for raw in output.splitlines()):
        if line.startswith("--> "):
            sections.append([])
        sections[-1].append(line)
    failed = [section for section in sections if any(_ERROR.search(line) for line in section)]
    return "\n".join("\n".join(section[:max_lines]) for section in failed)


def pyinfra(inventory: Path, deploy: str = "deploys/all.py", *args: str, timeout: int = 1800,
            netns: str | None = None) -> Run:
    """`netns`: run it from that network namespace (private-network test hosts)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.run(
        [*prefix, str(PYINFRA), "-y", *args, str(inventory), deploy],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"),
    )
    return Run(proc.returncode, proc.stdout + proc.stderr)


def changed_operations(run: Run | str) -> list[str]:
    """Operations of the results table that changed at least one host; raises NoResultsTable
    (an AssertionError carrying the output) when the run printed no complete table."""
    output = run if isinstance(run, str) else run.output
    return [row.operation for row in results_table(output).rows if row.success]
