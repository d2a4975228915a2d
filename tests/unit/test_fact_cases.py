"""Data-driven fact tests, as pyinfra's own tests/facts: one JSON file per case under
tests/unit/facts/<fact module>.<FactClass>/<case>.json, the command the fact sends and the
output a host printed in, the exact value the operations see out.

A case:

    {
      "kwargs": {...},                      # the fact's arguments (its command()'s)
      "command": "...",                     # exactly what is sent (long fixed scripts of the
                                            #   fact module as <module.NAME>, as in the
                                            #   operation cases)
      "requires_command": "sshd",           # when the fact names one
      "output": [...] | "output_file": "tests/fixtures/...",   # recorded or written output
      "fact": ...                           # process()'s value as JSON (dataclasses as dicts,
    }                                       #   tuples as lists, bytes as text)

The recorded outputs are those of tests/fixtures (see the README and COMMANDS.txt there);
test_facts_commands.py runs the commands themselves against recorded trees.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from pyinfra.api import FactBase, StringCommand

from tests.unit.test_operation_cases import _scripts

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "facts"


def as_json(value: Any) -> Any:
    """A fact's value as the case writes it."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [as_json(v) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, bytes):
        return value.decode()
    return value


def command_text(fact: FactBase, kwargs: dict[str, Any]) -> str:
    command = fact.command(**kwargs)
    text = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
    scripts = _scripts(importlib.import_module(type(fact).__module__))
    for script in sorted(scripts, key=len, reverse=True):
        text = text.replace(script, scripts[script])
    return text


def _cases() -> list[Any]:
    return [pytest.param(path, id=f"{path.parent.name}/{path.stem}")
            for path in sorted(CASES.glob("*.*/*.json"))]


@pytest.mark.parametrize("path", _cases())
def test_fact_case(path: Path) -> None:
    case = json.loads(path.read_text())
    unknown = set(case) - {"kwargs", "command", "requires_command", "output", "output_file", "fact", "comment"}
    assert not unknown, f"{path.name}: unknown keys {sorted(unknown)}"
    module_name, class_name = path.parent.name.split(".")
    fact = getattr(importlib.import_module(f"gpufleet.facts.{module_name}"), class_name)()
    kwargs = case.get("kwargs", {})
    assert command_text(fact, kwargs) == case["command"]
    requires = fact.requires_command(**kwargs) if callable(fact.requires_command) else fact.requires_command
    assert requires == case.get("requires_command"), requires
    if "output_file" in case:
        output = (ROOT / case["output_file"]).read_text().splitlines()
    else:
        output = case["output"]
    value = as_json(fact.process(output))
    assert value == case["fact"], json.dumps(value, indent=4)


def test_every_fact_has_a_case() -> None:
    cased = {path.parent.name for path in CASES.glob("*.*/*.json")}
    missing = []
    for file in sorted((ROOT / "facts").glob("*.py")):
        module = importlib.import_module(f"gpufleet.facts.{file.stem}")
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, FactBase) and value.__module__ == module.__name__
                    and "command" in vars(value) and f"{file.stem}.{name}" not in cased):
                missing.append(f"{file.stem}.{name}")
    assert not missing, f"facts without a case: {missing}"
