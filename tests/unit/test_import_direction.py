"""Imports point down (gpufleet/layers.py): applications and inventories -> deploys -> operations
-> gpufleet core -> facts. Every module of every layer is parsed (ast, nothing imported): import
statements (relative ones resolved, `from package import module` seen as the module),
importlib.import_module / __import__ with a literal or f-string name, and a string that is
exactly a project module's name (a table of modules imported later by name)."""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.layers import LAYERS, OUTSIDE, arrow_problem, layer_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LAYERED = ("gpufleet", "deploys", "operations", "facts", "inventories")
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


@dataclass(frozen=True)
class Arrow:
    file: str
    line: int
    importer: str
    imported: str
    how: str  # import | importlib | name in a string

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.importer} -> {self.imported} ({self.how})"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path) -> set[str]:
    names: set[str] = set()
    for top in (*LAYERED, *OUTSIDE):
        for path in (root / top).rglob("*.py") if (root / top).is_dir() else ():
            name = module_name(root, path)
            names.add(name)
            names.update(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))  # packages
    # deploys/, operations/ and facts/ are imported as gpufleet.<area> (pyproject.toml's package-dir)
    names |= {f"gpufleet.{n}" for n in names if n.split(".")[0] in ("deploys", "operations", "facts")}
    return names


def _literal_prefix(node: ast.AST) -> str | None:
    """'gpufleet.deploys.tuning' for a literal, 'deploys' for f'deploys.{area}'."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value).rstrip(".") or None
    return None


def arrows_of(root: Path, path: Path, known: set[str]) -> list[Arrow]:
    importer = module_name(root, path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    rel = str(path.relative_to(root))
    out: list[Arrow] = []
    seen: set[int] = set()  # the name given to an import call is not also "a name in a string"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
        if isinstance(node, ast.Import):
            out += [Arrow(rel, node.lineno, importer, alias.name, "import") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append(Arrow(rel, node.lineno, importer, sub if sub in known else base, "import"))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__"):
                name = _literal_prefix(node.args[0])
                seen.add(id(node.args[0]))
                if name:
                    out.append(Arrow(rel, node.lineno, importer, name, "importlib"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in seen \
                and importer != "gpufleet.layers":  # the list of layers names them, it imports none
            if _MODULE_NAME.fullmatch(node.value) and node.value in known:
                out.append(Arrow(rel, node.lineno, importer, node.value, "name in a string"))
    return out


def upward_arrows(root: Path) -> list[str]:
    known = project_modules(root)
    problems = []
    for top in LAYERED:
        for path in sorted((root / top).rglob("*.py")):
            for arrow in arrows_of(root, path, known):
                why = arrow_problem(arrow.importer, arrow.imported)
                if why:
                    problems.append(f"{arrow}: {why}")
    return problems


def test_no_import_points_up():
    problems = upward_arrows(ROOT)
    assert not problems, "imports that point up (see gpufleet/layers.py):\n" + "\n".join(problems)


def test_every_layer_names_modules_that_exist():
    """A renamed or moved module must not silently leave its layer (and the rule) behind."""
    known = project_modules(ROOT)
    for layer, _, prefixes in LAYERS:
        for prefix in prefixes:
            assert prefix in known, f"gpufleet/layers.py: layer {layer} names {prefix}, which does not exist"
    for top in LAYERED:
        for path in (ROOT / top).rglob("*.py"):
            assert layer_of(module_name(ROOT, path)) not in (None, ("outside", -1)), path


def test_the_applications_are_above_the_deploys_and_the_core_below():
    assert layer_of("gpufleet.apps.rollout.runner") == ("applications", 0)
    assert layer_of("gpufleet.apps.report.gather") == ("applications", 0)
    assert layer_of("gpufleet.apps.compat") == ("applications", 0)
    assert layer_of("gpufleet.rollout.manifest") == ("rollout", 3)
    assert layer_of("gpufleet.checks.validation") == ("checks", 3)
    assert arrow_problem("gpufleet.apps.rollout.runner", "gpufleet.deploys.upgrade") is None
    assert arrow_problem("gpufleet.checks.validation", "gpufleet.deploys.tuning")
    assert arrow_problem("gpufleet.controller.hostlock", "gpufleet.apps.rollout.session")


BROKEN = {
    # each line must be reported: (file, source, what is imported)
    "gpufleet/bad_from.py": ("from deploys.base import managed_marker\n", "deploys.base"),
    "gpufleet/bad_import.py": ("import deploys.tuning\n", "deploys.tuning"),
    "gpufleet/bad_package.py": ("from deploys import tuning\n", "deploys.tuning"),
    "gpufleet/bad_relative.py": ("from .apps.rollout import runner\n", "gpufleet.apps.rollout.runner"),
    "gpufleet/bad_importlib.py": ("import importlib\nimportlib.import_module('gpufleet.deploys.tuning')\n", "gpufleet.deploys.tuning"),
    "gpufleet/bad_fstring.py": ("import importlib\nimportlib.import_module(f'deploys.{area}')\n", "deploys"),
    "gpufleet/bad_dunder.py": ("__import__('gpufleet.operations.gpu')\n", "gpufleet.operations.gpu"),
    "gpufleet/bad_table.py": ("AREAS = {'tuning': 'gpufleet.deploys.tuning'}\n", "gpufleet.deploys.tuning"),
    "gpufleet/nested/bad_up.py": ("from ..apps.rollout.session import load_inventory\n", "gpufleet.apps.rollout.session"),
    "facts/bad.py": ("from gpufleet.plans.tuning import plan_tuning\n", "gpufleet.plans.tuning"),
    "operations/bad.py": ("from testing.gpusim import x\n", "testing.gpusim"),
    "deploys/bad.py": ("from inventories import cloud\n", "inventories.cloud"),
    "inventories/bad.py": ("from gpufleet.apps.report import gather\n", "gpufleet.apps.report.gather"),
    "deploys/bad_peer.py": ("from gpufleet.deploys.tuning import tuning\n", "gpufleet.deploys.tuning"),
    "deploys/bad_peer_path.py": ("from deploys.base import X\n", "deploys.base"),
}
FINE = {
    "deploys/tuning.py": "from gpufleet.plans.tuning import plan_tuning\nfrom operations import gpu\nfrom facts import gpu as g\n",
    "deploys/base.py": "X = 1\n",
    "gpufleet/__init__.py": "",
    "gpufleet/plans/tuning.py": "from facts.gpu import GpuInfo\nfrom . import compat\n\"\"\"gpufleet.deploys.tuning uses this.\"\"\"\n",
    "gpufleet/catalog/compat.py": "",
    "gpufleet/nested/__init__.py": "",
    "gpufleet/rollout/__init__.py": "",
    "gpufleet/apps/__init__.py": "",
    "gpufleet/apps/rollout/__init__.py": "",
    "gpufleet/apps/rollout/runner.py": "from deploys import upgrade\nfrom .session import run_step\nfrom gpufleet.rollout import manifest\n",
    "gpufleet/apps/rollout/session.py": "import pyinfra_cli\n",
    "gpufleet/rollout/manifest.py": "import json\n",
    "gpufleet/apps/report/__init__.py": "",
    "gpufleet/apps/report/gather.py": "from gpufleet import validation\n",
    "gpufleet/checks/validation.py": "from .tuning import plan_tuning\n",
    "deploys/upgrade.py": "",
    "deploys/all.py": "from gpufleet.deploys.base import X\nfrom gpufleet.deploys.tuning import tuning\n",
    "deploys/standalone.py": "import importlib\nimportlib.import_module(f'gpufleet.deploys.{area}')\n",
    "deploys/monitoring.py": "from gpufleet.deploys.standalone import run_alone\n",
    "operations/gpu.py": "from facts.gpu import GpuState\n",
    "facts/gpu.py": "from pyinfra.api import FactBase\n",
    "inventories/cloud.py": "",
    "inventories/sandbox.py": "from testing.testhosts import list_hosts\n",
    "testing/gpusim.py": "from deploys import all\n",
    "testing/testhosts.py": "",
}


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_the_check_fails_on_each_kind_of_upward_import(tmp_path):
    """The checker itself can fail: a tree of allowed imports passes, and every kind of upward
    arrow added to it is reported, naming the file, the line and the imported module."""
    _tree(tmp_path, FINE)
    for top in LAYERED:
        (tmp_path / top).mkdir(exist_ok=True)
    assert upward_arrows(tmp_path) == []
    _tree(tmp_path, {rel: source for rel, (source, _) in BROKEN.items()})
    problems = upward_arrows(tmp_path)
    for rel, (_, imported) in BROKEN.items():
        hits = [p for p in problems if p.startswith(f"{rel}:") and f"-> {imported} (" in p]
        assert hits, f"{rel} importing {imported} was not reported; got:\n" + "\n".join(problems)
    assert len(problems) == len(BROKEN), "\n".join(problems)  # and nothing else: the allowed ones stay allowed


def test_a_folder_imported_by_its_package_name_keeps_its_layer():
    assert layer_of("gpufleet.deploys.tuning")[0] == "deploys"
    assert layer_of("gpufleet.facts.gpu")[0] == "facts"
    assert arrow_problem("gpufleet.checks.validation", "gpufleet.deploys.base")
    assert arrow_problem("gpufleet.deploys.tuning", "gpufleet.plans.tuning") is None
