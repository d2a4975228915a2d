"""Run the real pyinfra CLI the way an operator does, and read its results table."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYINFRA = Path(sys.executable).with_name("pyinfra")


@dataclasses.dataclass
class Run:
    returncode: int
    output: str
    changed: int      # operations that changed something, summed over hosts
    unchanged: int
    errors: int

    def __str__(self) -> str:
        return self.output


def pyinfra(inventory: Path, deploy: str = "deploys/all.py", *args: str, timeout: int = 1800,
            netns: str | None = None) -> Run:
    """`netns`: run it from that network namespace (private-network test hosts)."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.run(
        [*prefix, str(PYINFRA), "-y", *args, str(inventory), deploy],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"),
    )
    out = proc.stdout + proc.stderr
    changed = unchanged = errors = 0
    m = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, re.M)
    if m:
        num = lambda s: 0 if s == "-" else int(s)  # noqa: E731
        changed, errors, unchanged = num(m[2]), num(m[3]), num(m[4])
    return Run(proc.returncode, out, changed, unchanged, errors)


def changed_operations(run: Run) -> list[str]:
    """Rows of the results table whose Success column (changes) is not '-'."""
    rows = []
    in_table = False
    for line in run.output.splitlines():
        if "--> Results:" in line:
            in_table = True
            continue
        if in_table:
            cols = re.split(r"\s{2,}", line.strip())
            if len(cols) >= 5 and cols[0] not in ("Operation", "Grand total") and cols[2] != "-":
                rows.append(cols[0])
    return rows
