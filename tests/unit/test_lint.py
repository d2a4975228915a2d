"""Lint is part of the test command (README, .ci/run): `ruff check` and `mypy` over the project,
with the configuration in pyproject.toml (mypy strict on the core, gpufleet/, and on
gpufleet.deploys and gpufleet.operations; plain (check_untyped_defs) only on gpufleet.facts). The last two tests show the configuration can fail: a file with the faults it
is meant to catch, checked under the same settings."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_ruff_check_is_clean():
    r = _run("ruff", "check", "--no-cache", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def installed_layout(where: Path) -> Path:
    """The package as a wheel installs it (pyproject.toml's package-dir: deploys/, facts/,
    operations/ become gpufleet.deploys, ...), copied under `where`. mypy reads folders, not
    setuptools' mapping, so it checks this copy; file times are kept for its cache."""
    import shutil

    tree = where / "gpufleet"
    shutil.rmtree(tree, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "templates")
    shutil.copytree(ROOT / "gpufleet", tree, ignore=ignore)
    for area in ("deploys", "facts", "operations"):
        shutil.copytree(ROOT / area, tree / area, ignore=ignore)
    return tree


def test_mypy_is_clean():
    where = ROOT / "build" / "mypy"
    installed_layout(where)
    r = _run("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(ROOT / ".mypy_cache"),
             cwd=where)
    # name the checkout's files, not the copy's
    out = r.stdout.replace("gpufleet/deploys/", "deploys/").replace("gpufleet/facts/", "facts/") \
        .replace("gpufleet/operations/", "operations/")
    assert r.returncode == 0, out + r.stderr


def test_ruff_finds_what_it_is_configured_to_find(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f(items=[]):\n    return undefined_name\n")
    r = _run("ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    for code in ("F401", "B006", "F821"):   # unused import, mutable default, undefined name
        assert code in r.stdout, (code, r.stdout)


def test_mypy_is_strict_on_the_core_only(tmp_path):
    # the same faulty module, as part of the core and as a fact module: the core (and deploys,
    # operations) is strict, the fact modules are not
    body = ("def add(a, b):\n    return a + b\n\n\ndef count() -> int:\n    return 'one'\n\n\n"
            "def untyped():\n    n: int = 'one'\n    return n\n")
    for package in ("gpufleet", "gpufleet/facts"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "bad.py").write_text(body)
    args = ("mypy", "--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
            "--explicit-package-bases")
    core = _run(*args, "gpufleet/bad.py", cwd=tmp_path)
    assert core.returncode == 1, core.stdout + core.stderr
    assert "gpufleet/bad.py:1: error: Function is missing a type annotation" in core.stdout, core.stdout
    assert "gpufleet/bad.py:6: error: Incompatible return value type" in core.stdout, core.stdout
    facts = _run(*args, "gpufleet/facts/bad.py", cwd=tmp_path)
    assert facts.returncode == 1, facts.stdout + facts.stderr
    assert "missing a type annotation" not in facts.stdout, facts.stdout
    assert "gpufleet/facts/bad.py:6: error: Incompatible return value type" in facts.stdout, facts.stdout
    # below the core too, the body of a function without annotations is checked (check_untyped_defs)
    assert "gpufleet/facts/bad.py:10: error: Incompatible types in assignment" in facts.stdout, facts.stdout


def test_every_deploy_reads_as_a_short_story():
    """No function in deploys/ over 80 lines (issue 28): a long area is split into its steps."""
    import ast

    long = []
    for path in sorted((ROOT / "deploys").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []
