"""gpufleet/pyinfra_private.py: the one place pyinfra's private names are used, behind one gate.
On an unknown pyinfra release or connector nothing is patched, pyinfra's own functions stay in
place and facts still come back (the same answers, pyinfra's way); on the verified ones the
patched answers are pyinfra's (compared on @local here, on a real test host in
tests/e2e/test_pyinfra_private.py). No other module touches pyinfra's private names."""
from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.facts import get_fact
from pyinfra.api.host import Host
from pyinfra.connectors.local import LocalConnector
from pyinfra.connectors.ssh import SSHConnector
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.server import Arch

from gpufleet.controller import factcache
from gpufleet import pyinfra_private

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# A fresh process (the patches are process-wide, installed once): install gpufleet's fact
# memo and speed-ups under the given pyinfra version and connector, then ask facts of @local.
SCRIPT = r'''
import importlib, json, logging, sys
import pyinfra_cli  # noqa: F401  (gevent, as the CLI)
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.api.facts import get_fact
from pyinfra.api.host import Host
from pyinfra.connectors.local import LocalConnector
from pyinfra.context import ctx_state
from pyinfra.facts.files import Sha1File
from pyinfra.facts.server import Arch

from gpufleet.controller import factcache
from gpufleet import pyinfra_private

version, connector, path = sys.argv[1:4]
warnings = []
logging.getLogger("pyinfra").addHandler(type("H", (logging.Handler,), {
    "emit": lambda self, record: warnings.append(record.getMessage())})(logging.WARNING))
if version != "installed":
    pyinfra_private.pyinfra_version = lambda: version


class ThirdPartyConnector(LocalConnector):
    """Not a connector pyinfra registers: gpufleet has never seen it."""


facts_mod = importlib.import_module("pyinfra.api.facts")
modules = {name: importlib.import_module(name) for name in (
    "pyinfra.api.facts", "pyinfra.api.arguments", "pyinfra.api.operation")}
before = {
    "_get_fact": facts_mod._get_fact, "facts.all_global_arguments": facts_mod.all_global_arguments,
    "arguments.all_global_arguments": modules["pyinfra.api.arguments"].all_global_arguments,
    "get_operation_order_from_stack": modules["pyinfra.api.operation"].get_operation_order_from_stack,
    "operation.pop_global_arguments": modules["pyinfra.api.operation"].pop_global_arguments,
    "facts.pop_global_arguments": facts_mod.pop_global_arguments,
    "run_shell_command": Host.run_shell_command, "put_file": Host.put_file,
}
inventory = Inventory(([("@local", {})], {}))
state = State(inventory, Config())
host = inventory.get_host("@local")
if connector == "third-party":
    host.connector_cls = ThirdPartyConnector
with ctx_state.use(state):
    factcache.install()
after = {
    "_get_fact": facts_mod._get_fact, "facts.all_global_arguments": facts_mod.all_global_arguments,
    "arguments.all_global_arguments": modules["pyinfra.api.arguments"].all_global_arguments,
    "get_operation_order_from_stack": modules["pyinfra.api.operation"].get_operation_order_from_stack,
    "operation.pop_global_arguments": modules["pyinfra.api.operation"].pop_global_arguments,
    "facts.pop_global_arguments": facts_mod.pop_global_arguments,
    "run_shell_command": Host.run_shell_command, "put_file": Host.put_file,
}
connect_all(state)
commands = []
counted = Host.run_shell_command
def counting(self, *args, **kwargs):
    commands.append(1)
    return counted(self, *args, **kwargs)
Host.run_shell_command = counting
answers = [get_fact(state, host, Sha1File, kwargs={"path": path}) for _ in range(2)]
answers += [get_fact(state, host, Arch) for _ in range(2)]
print(json.dumps({"unchanged": sorted(k for k in before if before[k] is after[k]),
                  "patched": list(pyinfra_private.patched()), "installed": pyinfra_private.installed(),
                  "answers": answers, "commands": len(commands), "warnings": warnings}))
'''


def _run(tmp_path, version: str, connector: str = "local") -> dict:
    path = tmp_path / "x"
    path.write_text("hello\n")
    done = subprocess.run([sys.executable, "-c", SCRIPT, version, connector, str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


ALL = ["_get_fact", "arguments.all_global_arguments", "facts.all_global_arguments", "facts.pop_global_arguments",
       "get_operation_order_from_stack", "operation.pop_global_arguments", "put_file", "run_shell_command"]
GUARD = {*(f"pyinfra.connectors.{m}.make_unix_command_for_host"
           for m in ("util", "ssh", "local", "docker", "dockerssh", "chroot")), "pyinfra.api.host.Host.disconnect"}
HELLO_SHA1 = "f572d396fae9206628714fb2ce00f72e94f2258f"


def test_on_the_verified_release_and_connector_the_patches_are_in(tmp_path):
    got = _run(tmp_path, "installed")
    assert got["installed"] and got["unchanged"] == []
    assert "pyinfra.api.facts._get_fact" in got["patched"]
    assert got["answers"][:2] == [HELLO_SHA1, HELLO_SHA1]
    assert got["commands"] == 2  # each question once: the second ask is the memo's
    assert got["warnings"] == []


def test_an_unknown_release_leaves_pyinfra_unpatched_and_working(tmp_path):
    got = _run(tmp_path, "3.99.0")
    # only the safety that refuses to send a sudo password pyinfra would put on the command line
    assert got["unchanged"] == ALL and set(got["patched"]) == GUARD
    patched = _run(tmp_path, "installed")
    assert got["answers"] == patched["answers"]  # the same answers, pyinfra's way
    assert got["commands"] == 4  # one command per fact: pyinfra's plain path
    assert [w for w in got["warnings"] if "3.99.0" in w] == [got["warnings"][0]]  # once
    assert "verified" in got["warnings"][0] and "pyinfra's own code runs" in got["warnings"][0]


def test_an_unknown_connector_leaves_pyinfra_unpatched_and_working(tmp_path):
    got = _run(tmp_path, "installed", connector="third-party")
    # the password's command building is in place (a password to a host not over SSH is refused)
    assert got["unchanged"] == ALL and set(got["patched"]) == GUARD
    assert got["answers"][:2] == [HELLO_SHA1, HELLO_SHA1] and got["commands"] == 4
    assert len(got["warnings"]) == 1 and "ThirdPartyConnector" in got["warnings"][0]


# In this process (installed by the fixture): a host met after install() on an unknown
# connector takes pyinfra's own fact path.

class OtherConnector(LocalConnector):
    """A connector gpufleet was not verified with (runs locally, so the test can ask facts)."""


def test_a_host_on_an_unknown_connector_gets_pyinfra_answers_one_command_each(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(factcache, "PLAN_DIR", tmp_path / "plans")
    factcache.install()
    assert pyinfra_private.installed()
    path = tmp_path / "x"
    path.write_text("hello\n")

    def ask(connector: type | None) -> tuple[list, int]:
        inventory = Inventory(([("@local", {})], {}))
        state = State(inventory, Config())
        host = inventory.get_host("@local")
        if connector is not None:
            host.connector_cls = connector
        connect_all(state)
        calls = []
        original = Host.run_shell_command

        def counting(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Host, "run_shell_command", counting)
        answers = [get_fact(state, host, fact, kwargs=kwargs) for fact, kwargs in (
            (Sha1File, {"path": str(path)}), (Sha1File, {"path": str(path)}), (File, {"path": "/nonexistent"}),
            (Arch, {}), (Arch, {}))]
        monkeypatch.setattr(Host, "run_shell_command", original)
        return answers, len(calls)

    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        other, other_calls = ask(OtherConnector)
    verified, verified_calls = ask(None)
    assert other == verified and other[0] == HELLO_SHA1 and other[2] is None
    assert other_calls == 5 and verified_calls == 3
    assert any("OtherConnector" in r.getMessage() for r in caplog.records)


def test_the_verified_connectors_are_pyinfra_entry_points():
    assert set(pyinfra_private.verified_connector_classes()) == {SSHConnector, LocalConnector}
    for name, ok in (("gpu-a01", True), ("@local", True), ("@docker/img", False), ("@chroot/srv", False),
                     ("@dockerssh/h:img", False)):
        host = Inventory(([name], {})).get_host(name)
        assert pyinfra_private.connector_verified(host) is ok, name


def test_a_release_lacking_a_private_name_is_not_patched(monkeypatch):
    monkeypatch.setitem(pyinfra_private.REQUIRED, "pyinfra.api.facts", ("_get_fact", "_gone_in_a_later_release"))
    monkeypatch.setattr(pyinfra_private, "_warned", set())
    assert pyinfra_private.missing_names() == ["pyinfra.api.facts._gone_in_a_later_release"]
    assert not pyinfra_private.available() and not pyinfra_private.usable()


def test_this_release_is_verified_and_has_every_name():
    # Failing here means pyinfra was upgraded: compare the patches with it (the tests named in
    # gpufleet/pyinfra_private.py) and add it to VERIFIED_PYINFRA; until then they stay off.
    assert pyinfra_private.pyinfra_version().startswith(pyinfra_private.VERIFIED_PYINFRA)
    assert pyinfra_private.missing_names() == []


def test_one_gate_the_dependency_takes_any_3x_and_the_test_venv_the_verified_series():
    """The version gate is VERIFIED_PYINFRA alone: pyproject.toml allows every pyinfra 3.x, and
    the development/CI virtualenv's constraint (.ci/pyinfra-verified.txt) is that series."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d for d in deps if d.startswith("pyinfra")] == ["pyinfra>=3.10,<4"]
    lines = [ln for ln in (REPO / ".ci" / "pyinfra-verified.txt").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert pyinfra_private.VERIFIED_PYINFRA == ("3.10.",)  # change both together
    assert lines == ["pyinfra>=3.10,<3.11"]


# Nothing else touches pyinfra's private names ---------------------------------------------

SOURCES = ["gpufleet", "deploys", "operations", "facts"]
# pyinfra's documented way for an operation to call another (docs: Writing Operations)
DOCUMENTED = {"_inner"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    pyinfra_names: set[str] = set()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("pyinfra", "pyinfra_cli"):
            if node.module.split(".")[0] == "pyinfra_cli":
                found.append(f"{path}:{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if alias.name.startswith("_"):
                    found.append(f"{path}:{node.lineno}: imports {node.module}.{alias.name}")
                pyinfra_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "pyinfra":
                    pyinfra_names.add((alias.asname or alias.name).split(".")[0])
                # a bare `import pyinfra_cli` only runs its gevent set-up, as the CLI does
                if alias.name.startswith("pyinfra_cli."):
                    found.append(f"{path}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("pyinfra"):
                found.append(f"{path}:{node.lineno}: import_module({node.args[0].value!r})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in pyinfra_names:
            if node.attr.startswith("_") and node.attr not in DOCUMENTED:
                found.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
            if isinstance(node.ctx, ast.Store):
                found.append(f"{path}:{node.lineno}: assigns {node.value.id}.{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in pyinfra_names:
            found.append(f"{path}:{node.lineno}: setattr({node.args[0].id}, ...)")
        # a private name by string (gpufleet's own _gpufleet_* attributes aside)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and node.args[1].value.startswith("_") and not node.args[1].value.startswith(("_gpufleet", "__")):
            found.append(f"{path}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_other_module_touches_pyinfra_private_names():
    found = []
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if path.name != "pyinfra_private.py" and not path.is_symlink():
                found += _violations(path)
    assert found == [], "go through gpufleet/pyinfra_private.py:\n" + "\n".join(found)


def test_the_check_finds_a_private_use(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from pyinfra.api import facts as pf\nfrom pyinfra.api.host import Host\n"
                   "from pyinfra_cli.util import exec_file\nx = pf._get_fact\nHost.put_file = None\n"
                   "y = files.put._inner\nz = getattr(type(host), '_get_module', None)\n"
                   "w = getattr(host, '_gpufleet_memo', None)\n")
    # the pyinfra_cli import, pf._get_fact, assigning Host.put_file, '_get_module' by string
    assert len(_violations(bad)) == 4
