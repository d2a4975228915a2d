"""The command reference (docs/commands.md) is generated from the commands' own parsers and must
not drift from them; every argument has help; each --help ends with its exit codes and names
the installed commands; every command answers --support (issue 50 item 4)."""
from __future__ import annotations

import argparse
import importlib
import platform
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from gpufleet.apps import deploy
from gpufleet.apps.commands_doc import COMMANDS, arguments, parsers, render
from gpufleet.apps.exits import EXIT_CODES, epilog

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "commands.md"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
SCRIPTS = PROJECT["scripts"]


def test_docs_commands_md_is_current():
    assert DOC.read_text() == render(), "docs/commands.md is stale: run tools/commands-doc"


def test_every_installed_command_and_app_tool_is_in_the_reference():
    named = {name for name, _, _ in COMMANDS}
    assert set(SCRIPTS) <= named
    assert set(EXIT_CODES) == named
    checkout = {c for _, c, _ in COMMANDS if c.startswith("tools/")}
    # every tools/ wrapper of an application (the harness's own tools are not commands of gpufleet)
    apps = {f"tools/{p.name}" for p in (REPO / "tools").iterdir()
            if "gpufleet.apps" in p.read_text() and p.name not in ("commands-doc", "operations-doc")}
    assert apps == checkout


@pytest.mark.parametrize("name", sorted(parsers()))
def test_every_option_and_positional_has_help(name):
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in arguments(parsers()[name])
               if not (a.help or "").strip()]
    assert missing == [], f"{name}: arguments without help text: {missing}"


@pytest.mark.parametrize("name", sorted(parsers()))
def test_each_help_ends_with_the_exit_codes_and_names_installed_commands(name):
    text = parsers()[name].format_help()
    assert "".join(epilog(name).split()) in "".join(text.split())   # as wrapped, at any width
    assert [code for code, _ in EXIT_CODES[name]] == sorted(code for code, _ in EXIT_CODES[name])
    if name in SCRIPTS:
        assert "tools/" not in text, f"{name}'s help names a checkout path"


def test_deploys_help_has_its_exit_codes():
    assert epilog("gpufleet-deploy") in deploy.usage()
    assert "tools/" not in deploy.usage()


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_command_prints_the_versions_a_bug_report_needs(script, monkeypatch, capsys):
    module, function = SCRIPTS[script].split(":")
    monkeypatch.setattr(sys, "argv", [script, "--support"])
    try:
        code = getattr(importlib.import_module(module), function)()
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr().out
    assert code == 0
    lines = dict(line.strip().split(": ", 1) for line in out.splitlines()[1:])
    assert lines["gpufleet"] == PROJECT["version"]
    assert lines["pyinfra"] == metadata.version("pyinfra")
    assert lines["paramiko"] == metadata.version("paramiko")
    assert lines["Python"].startswith(platform.python_version() + " ")
    assert platform.release() in lines["OS"]


def test_support_needs_nothing_else_on_the_command_line(capsys):
    """`--support` stops before the required arguments are checked, as --version does."""
    p = parsers()["gpufleet-rollback"]
    with pytest.raises(SystemExit) as stop:
        p.parse_args(["--support"])
    assert stop.value.code == 0
    assert "paramiko: " in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:
        p.parse_args([])
    assert usage.value.code == 2
    assert isinstance(p, argparse.ArgumentParser)
