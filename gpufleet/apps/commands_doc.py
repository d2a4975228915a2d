"""docs/commands.md, the command reference, generated from the commands' own argument parsers
(tools/commands-doc writes it; tests/unit/test_commands_doc.py fails when it is stale)."""
from __future__ import annotations

import argparse
from typing import Callable

from gpufleet.apps import compat, compat_upstream, deploy, health
from gpufleet.apps.exits import EXIT_CODES
from gpufleet.apps.report.cli import build_parser as report_parser
from gpufleet.apps.rollout.cli import rollback_parser, rollout_parser

WIDTH = 100  # the usage lines are wrapped here, whatever the terminal
#: (installed command, checkout command, its parser; None: gpufleet-deploy, which passes pyinfra's on)
COMMANDS: tuple[tuple[str, str, Callable[[str], argparse.ArgumentParser] | None], ...] = (
    ("gpufleet-deploy", "pyinfra INVENTORY deploys/AREA.py", None),
    ("gpufleet-rollout", "tools/rollout", rollout_parser),
    ("gpufleet-rollback", "tools/rollback", rollback_parser),
    ("gpufleet-report", "tools/fleet-report", report_parser),
    ("gpufleet-compat", "tools/compat", compat.parser),
    ("gpufleet-health", "tools/health", health.build_parser),
    ("tools/compat-upstream", "tools/compat-upstream", compat_upstream.parser),
)


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Each command's parser under its installed name (a maintainer's tool under its checkout name)."""
    found = {}
    for name, _, make in COMMANDS:
        if make is not None:
            p = make(name)
            p.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
            found[name] = p
    return found


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.help != argparse.SUPPRESS]


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (("{" + ",".join(map(str, action.choices)) + "}") if action.choices else
                                 action.dest.upper())
    return f"{names} {metavar}"


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%" in text:
        text = text % {**vars(action), "prog": prog}
    return text.replace("|", "\\|").replace("\n", " ")


def _section(name: str, checkout: str, parser: argparse.ArgumentParser | None) -> list[str]:
    title = f"## {name}" + (f" (in a checkout: `{checkout}`)" if checkout != name else "")
    if parser is None:
        return [title, "", "```", deploy.usage().split("\n\nThe deploy files")[0].rstrip(), "```", ""]
    usage = parser.format_usage().strip()
    lines = [title, "", parser.description or "", "", "```", usage, "```", "", "| argument | what it does |",
             "|---|---|"]
    lines += [f"| `{_name(a)}` | {_help(a, parser.prog)} |" for a in arguments(parser)]
    return lines + [""]


def render() -> str:
    lines = ["# Command reference", "",
             "Generated from the commands' own argument parsers by `tools/commands-doc`; do not edit by hand. "
             "Each command is installed by `pip install` (see the README); in a checkout, `tools/*` are the "
             "same commands under their checkout names, with the same options and exit codes. Every command "
             "answers `--help`, `--version` and `--support` (the versions a bug report needs).", "",
             "## Exit codes", "", "| command | exit code | meaning |", "|---|---|---|"]
    for name, codes in EXIT_CODES.items():
        lines += [f"| `{name}` | {code} | {meaning} |" for code, meaning in codes]
    lines.append("")
    made = parsers()
    for name, checkout, _ in COMMANDS:
        lines += _section(name, checkout, made.get(name))
    return "\n".join(lines).rstrip() + "\n"
