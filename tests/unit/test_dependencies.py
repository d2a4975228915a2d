"""What gpufleet's installed modules import from outside the standard library is declared in
pyproject.toml's dependencies (issue 34: typing_extensions was imported and not declared), and
what is declared is imported: nvidia-ml-py runs on the hosts (facts/health.py's NVML reader, with
the host's own python3), so it is the optional extra `nvml`, not a dependency."""
from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
#: Modules that run on a host, not on the controller: what they import is the host's.
ON_THE_HOST = {"gpufleet/perf_probe.py", "gpufleet/allreduce_probe.py"}


def distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def imported_top_levels() -> dict[str, set[str]]:
    """Top-level name -> the installed files importing it (at any depth: lazy imports count)."""
    found: dict[str, set[str]] = {}
    files = [p for folder in ("gpufleet", "deploys", "facts", "operations") for p in (REPO / folder).rglob("*.py")]
    for path in files:
        where = str(path.relative_to(REPO))
        if where in ON_THE_HOST:
            continue
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "gpufleet":
                    found.setdefault(top, set()).add(where)
    return found


def test_every_third_party_import_is_a_declared_dependency():
    declared = {distribution(r) for r in PROJECT["dependencies"]}
    providers = metadata.packages_distributions()
    missing = {}
    for top, files in imported_top_levels().items():
        dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
        if not dists & declared:
            # a dependency's own module (pyinfra_cli comes with pyinfra, yaml with PyYAML, ...)
            owners = {d for d in dists if any(distribution(r) == d for r in PROJECT["dependencies"])}
            if not owners:
                missing[top] = sorted(files)[:3]
    assert missing == {}, f"imported, not declared in [project] dependencies: {missing}"


def test_nvidia_ml_py_is_an_optional_extra_and_the_controller_does_not_import_it():
    assert "nvidia-ml-py" not in {distribution(r) for r in PROJECT["dependencies"]}
    assert "nvidia-ml-py" in {distribution(r) for r in PROJECT["optional-dependencies"]["nvml"]}
    assert "pynvml" not in imported_top_levels()


def test_typing_extensions_is_declared():
    assert "typing-extensions" in {distribution(r) for r in PROJECT["dependencies"]}
