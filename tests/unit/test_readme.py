"""The README stays an operator's manual (issue 49): at most 400 lines, the reference in docs/;
and its test command is the one CI runs (.ci/run runs `tools/test`, the README says so)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LIMIT = 400


def test_readme_is_a_manual_of_at_most_400_lines():
    lines = README.read_text().count("\n")
    assert lines <= LIMIT, (f"README.md has {lines} lines (limit {LIMIT}): move reference detail to docs/*.md "
                            "and link it")


def test_the_readme_test_command_is_what_ci_runs():
    """The quick start's `tools/test` line is the command .ci/run calls, with only options added."""
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    [command] = re.findall(r"^(tools/test)\s+#.*test suite", quick, re.M)
    ci = [line.split("||")[0].split() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith(command)]
    assert ci and all(words[0] == command and all(w.startswith("-") or w[:1].isdigit() for w in words[1:])
                      for words in ci), ci
    assert "`tools/test`" in quick and "`.ci/run`" in quick


def test_every_docs_page_the_readme_names_exists():
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    assert linked and [p for p in sorted(linked) if not (ROOT / p).exists()] == []
