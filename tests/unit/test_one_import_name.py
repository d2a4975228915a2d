"""gpufleet installs one top-level import name, `gpufleet` (pyproject.toml): deploys/, facts/ and
operations/ are imported as gpufleet.deploys, gpufleet.facts and gpufleet.operations everywhere,
in a checkout too. A module imported under two names would be two modules with two states (the
hosts needing a reboot, the pending upgrades), and the bare names would collide with any other
package called `facts` or `operations`."""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
AREAS = ("deploys", "facts", "operations", "templates")
#: Folders shipped for their files alone: no module in them, nothing imports them.
DATA_ONLY = {"gpufleet.docs": "docs"}


def python_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    return [REPO / n for n in names if not (REPO / n).is_symlink()]


def bare_imports(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"line {node.lineno}: {n}" for n in names if n.split(".")[0] in AREAS]
    return found


def test_no_module_imports_deploys_facts_or_operations_by_their_bare_names():
    offenders = {}
    for path in python_files():
        found = bare_imports(ast.parse(path.read_text(), str(path)))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}, "import them as gpufleet.<area>: " + repr(offenders)


def test_the_checker_sees_a_bare_import():
    assert bare_imports(ast.parse("from facts.gpu import GpuState\nimport operations.holds\n")) == [
        "line 1: facts.gpu", "line 2: operations.holds"]
    assert bare_imports(ast.parse("from gpufleet.facts.gpu import GpuState\nfrom . import plan\n")) == []


def test_no_links_in_the_tree():
    """Links draw a false house for tools that read imports (issue 28): pyproject.toml's
    package-dir maps the top-level folders to their import names instead."""
    names = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert [n for n in names if n.startswith("120000")] == []


def test_the_package_list_names_every_package_folder():
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"gpufleet." + area: area for area in AREAS}
    assert config["package-dir"] == {**folders, **DATA_ONLY}
    folders.update(DATA_ONLY)
    found = {"gpufleet." + ".".join(p.parent.relative_to(REPO / "gpufleet").parts)
             for p in (REPO / "gpufleet").rglob("__init__.py")}
    found = {n.rstrip(".") for n in found} | set(folders)
    assert sorted(config["packages"]) == sorted(found)


@pytest.mark.parametrize("area", ["deploys", "facts", "operations"])
def test_each_area_is_imported_from_its_top_level_folder(area):
    import importlib

    module = importlib.import_module(f"gpufleet.{area}")
    assert Path(module.__file__).resolve().parent == REPO / area


def test_the_wheel_ships_the_license_the_changelog_and_the_settings_reference():
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["project"]["license"] == "Apache-2.0" and config["project"]["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in (REPO / "LICENSE").read_text()  # the full text
    assert config["tool"]["setuptools"]["dynamic"]["readme"]["file"] == ["README.md", "CHANGELOG.md"]
    assert config["tool"]["setuptools"]["package-data"]["gpufleet.docs"] == ["settings.md"]
    assert not list((REPO / "docs").glob("*.py"))  # data only
