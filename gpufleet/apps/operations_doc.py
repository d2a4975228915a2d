"""The operations reference (docs/operations.md), generated from the deploys' and operations' code.

Every operation gpufleet names is a call with `name=` (or a helper that takes the name first:
NAME_FIRST); its name is short and its reason is `explained(name, why)` beside it
(gpufleet/explain.py). This module reads those calls from the source, without running anything:
the page lists each file's deploys and operations with what they do and why, and
tests/unit/test_operation_names.py holds every name to its limit and the page to the code.
Regenerate with `tools/operations-doc`.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

#: Helpers whose first positional argument is an operation's name.
NAME_FIRST = frozenset({"reload_when", "packages_at_releases"})
#: What a `{placeholder}` counts for in a name's length: a version, a setting's value, a group.
PLACEHOLDER = 12
FOLDERS = ("deploys", "operations")


@dataclass(frozen=True)
class Named:
    """One name in the source: an operation's (`kind` "operation") or a deploy's ("deploy")."""
    path: str  # e.g. deploys/tuning.py
    line: int
    kind: str
    name: str  # the text, `{expression}` where a value goes in
    length: int  # the longest the name can be, a placeholder counting PLACEHOLDER
    why: str  # explained()'s reason, "" where the name has none


def root() -> Path:
    """The folder holding deploys/ and operations/: the checkout's top, or the installed package."""
    package = Path(__file__).resolve().parents[1]
    return package.parent if (package.parent / "deploys").is_dir() else package


def _text(node: ast.expr, source: str) -> tuple[str, int]:
    """(text, longest length) of a name expression: literals as they are, values as {source}."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value, len(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = [_text(value, source) for value in node.values]
        return "".join(t for t, _ in parts), sum(n for _, n in parts)
    if isinstance(node, ast.FormattedValue):
        return "{" + (ast.get_source_segment(source, node.value) or "...") + "}", PLACEHOLDER
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        (left, n), (right, m) = _text(node.left, source), _text(node.right, source)
        return left + right, n + m
    if isinstance(node, ast.IfExp):
        (body, n), (other, m) = _text(node.body, source), _text(node.orelse, source)
        return (body if n >= m else other), max(n, m)
    if isinstance(node, ast.Call) and _called(node) == "explained" and node.args:
        return _text(node.args[0], source)
    if isinstance(node, ast.Name):  # a parameter handed on: its callers' names are checked
        return "{" + node.id + "}", 0
    segment = ast.get_source_segment(source, node) or "..."
    return "{" + segment + "}", 10 ** 6  # not readable from the source: make it a literal


def _called(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _why(node: ast.expr, source: str) -> str:
    if isinstance(node, ast.Call) and _called(node) == "explained" and len(node.args) > 1:
        return " ".join(_text(node.args[1], source)[0].split())
    return ""


def _first_sentence(docstring: str) -> str:
    """A docstring's first paragraph, on one line: what a deploy is for."""
    return " ".join(docstring.split("\n\n", 1)[0].split())


def names_in(path: Path, relative: str) -> Iterator[Named]:
    """Every operation and deploy name written in one file, in source order."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    found: list[Named] = []
    deploy_why = {id(decorator): _first_sentence(ast.get_docstring(node) or ast.get_docstring(tree) or "")
                  for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                  for decorator in node.decorator_list}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        called = _called(node)
        value: ast.expr | None = next((k.value for k in node.keywords if k.arg == "name"), None)
        if value is None and called in NAME_FIRST and node.args:
            value = node.args[0]
        kind = "operation"
        if called == "deploy" and node.args:
            value, kind = node.args[0], "deploy"
        if value is None or (isinstance(value, ast.Name) and kind == "operation"):
            continue
        text, length = _text(value, source)
        why = deploy_why.get(id(node), "") if kind == "deploy" else _why(value, source)
        found.append(Named(relative, node.lineno, kind, " ".join(text.split()), length, why))
    yield from sorted(found, key=lambda n: n.line)


def all_names(top: Path | None = None) -> list[Named]:
    top = top or root()
    return [named for folder in FOLDERS for path in sorted((top / folder).glob("*.py"))
            for named in names_in(path, f"{folder}/{path.name}")]


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "-"


def render(top: Path | None = None) -> str:
    lines = [
        "# Operations",
        "",
        "Generated from the code by `tools/operations-doc` (a unit test fails when it is stale): every",
        "operation and deploy gpufleet names, file by file, in the order the file writes them, with",
        "what it does and why. pyinfra prints the short name; `pyinfra -v` prints the reason too, for",
        "each host, as the operation is planned. `{...}` is a value filled in at planning (a version,",
        "a path, a setting). An operation that names none is shown by pyinfra as its own",
        "(`files.put`, ...).",
    ]
    current = ""
    for named in all_names(top):
        if named.path != current:
            current = named.path
            lines += ["", f"## {current}", "", "| Name | What and why |", "| --- | --- |"]
        shown = f"**{_cell(named.name)}** (deploy)" if named.kind == "deploy" else _cell(named.name)
        lines.append(f"| {shown} | {_cell(named.why)} |")
    return "\n".join(lines) + "\n"
