"""The installed commands (pyproject.toml's [project.scripts]): each answers --version with
gpufleet's version, and gpufleet-deploy checks its command line before pyinfra loads anything
(issue 34)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gpufleet.apps import deploy

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SCRIPTS = PROJECT["scripts"]
TAKES_VALUE = frozenset({"--limit", "--data", "--config"})


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_command_prints_gpufleets_version(script, monkeypatch, capsys):
    module, function = SCRIPTS[script].split(":")
    monkeypatch.setattr(sys, "argv", [script, "--version"])
    try:
        code = getattr(importlib.import_module(module), function)()
    except SystemExit as stop:  # argparse's version action
        code = stop.code
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(f"{script} (gpufleet) {PROJECT['version']};"), out
    assert "pyinfra 3." in out


def test_the_version_of_a_checkout_that_is_not_installed_comes_from_pyproject(monkeypatch):
    from importlib import metadata

    from gpufleet import version

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert version.version() == PROJECT["version"]


def test_a_checkouts_version_is_its_pyproject_even_where_an_older_install_left_metadata(monkeypatch, tmp_path):
    """An editable install keeps the version it was installed at until pip runs again; a wheel
    has no pyproject.toml beside its package and answers from its metadata."""
    from importlib import metadata

    from gpufleet import version

    monkeypatch.setattr(metadata, "version", lambda name: "0.0.1")
    assert version.version() == PROJECT["version"]
    monkeypatch.setattr(version, "PYPROJECT", tmp_path / "pyproject.toml")
    assert version.version() == "0.0.1"


def test_the_release_is_in_the_changelog_with_its_upgrading_notes_first():
    changelog = (REPO / "CHANGELOG.md").read_text()
    releases = [line for line in changelog.splitlines() if line.startswith("## ") and line != "## Unreleased"]
    assert releases[0].startswith(f"## {PROJECT['version']} ("), releases[:2]
    this = changelog.split(releases[0], 1)[1].split("\n## ", 1)[0]
    sections = [line for line in this.splitlines() if line.startswith("### ")]
    assert sections[0].startswith("### Upgrading from "), sections
    assert set(sections[1:]) <= {"### Added", "### Changed", "### Fixed", "### Security"}, sections


def test_every_runnable_deploy_file_is_an_area():
    runnable = {p.stem for p in (REPO / "deploys").glob("*.py") if "run_alone(__name__, __file__)" in p.read_text()}
    assert (runnable - {"standalone"}) | {"all", "plan"} == set(deploy.AREAS)
    assert "monitoring" in deploy.usage()


@pytest.mark.parametrize("args, expected", [
    (["inv.py"], ["inv.py", "=all"]),
    (["inv.py", "tuning", "-y"], ["inv.py", "=tuning", "-y"]),
    (["inv.py", "--limit", "g", "tuning"], ["inv.py", "--limit", "g", "=tuning"]),
    (["inv.py", "--limit", "tuning", "--dry"], ["inv.py", "=all", "--limit", "tuning", "--dry"]),
    (["--data", "tier=dev", "inv.py", "--data=x=1", "monitoring"], ["--data", "tier=dev", "inv.py", "--data=x=1", "=monitoring"]),
])
def test_pyinfra_options_pass_through_around_the_inventory_and_the_area(args, expected, tmp_path, monkeypatch):
    """`=AREA` in `expected`: the area's deploy file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inv.py").write_text("hosts = []\n")
    got = deploy.pyinfra_argv(args, TAKES_VALUE)
    assert got == [str(deploy.DEPLOYS / f"{a[1:]}.py") if a.startswith("=") else a for a in expected]
    assert all(Path(a).is_file() for a in got if a.endswith(".py"))


def test_the_options_that_take_a_value_are_pyinfras():
    from gpufleet import pyinfra_private

    options = pyinfra_private.cli_value_options()
    assert {"--limit", "--data", "--config", "--user", "--ssh-user"} <= options
    assert not {"--dry", "-y", "--yes", "--sudo"} & options


@pytest.mark.parametrize("args, fragment", [
    (["/nonexistent/inventory.py", "all"], "no such inventory file: /nonexistent/inventory.py"),
    (["inventories/clod.py"], "no such inventory file: inventories/clod.py"),
    (["{inv}", "tunning"], "unknown area 'tunning' (allowed: all, plan,"),
    (["{inv}", "tuning", "base"], "one area at a time"),
    (["--limit", "g"], "no inventory given"),
])
def test_a_bad_command_line_stops_before_pyinfra_runs(args, fragment, tmp_path, monkeypatch, capsys):
    inv = tmp_path / "inv.py"
    inv.write_text("hosts = []\n")

    def no_exec(*_: object) -> None:
        raise AssertionError("pyinfra was started")

    monkeypatch.setattr(deploy.os, "execv", no_exec)
    assert deploy.main([a.format(inv=inv) for a in args]) == 2
    assert fragment in capsys.readouterr().err


def test_settings_prints_the_settings_reference(capsys):
    assert deploy.main(["--settings"]) == 0
    assert capsys.readouterr().out == (REPO / "docs" / "settings.md").read_text()


def test_pyinfra_calling_an_area_by_its_import_name_is_refused_before_any_host(tmp_path):
    (tmp_path / "inv.py").write_text('hosts = [("nohost.invalid", {"tier": "dev"})]\n')
    proc = subprocess.run([sys.executable, "-m", "pyinfra", "inv.py", "gpufleet.deploys.tuning.tuning", "-y"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run the tuning area as its deploy file" in proc.stderr
    assert "gpufleet-deploy INVENTORY tuning" in proc.stderr
    assert "nohost.invalid" not in proc.stdout + proc.stderr  # no host was connected to nor planned


def test_only_the_command_line_naming_the_function_is_refused():
    from gpufleet.deploys.standalone import called_by_import_name

    name = "gpufleet.deploys.tuning"
    assert called_by_import_name(name, ["pyinfra", "inv.py", "gpufleet.deploys.tuning.tuning"])
    assert called_by_import_name(name, ["pyinfra", "inv.py", "gpufleet.deploys.tuning:tuning"])
    assert not called_by_import_name(name, ["pyinfra", "inv.py", "deploys/tuning.py"])
    assert not called_by_import_name(name, ["pyinfra", "inv.py", "gpufleet.deploys.tuning_extra.x"])
    assert not called_by_import_name("mydeploy", ["pyinfra", "inv.py", "mydeploy.x"])
