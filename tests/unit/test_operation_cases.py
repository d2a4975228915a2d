"""Data-driven operation tests, as pyinfra's own tests/operations: one JSON file per case under
tests/unit/operations/<module>.<operation>/<case>.json, facts in, exact commands and no-op
messages out. An operation runs on a fake host that answers only the facts the case gives
(a fact the case does not give fails the test: every remote question is on the page).

A case:

    {
      "args": [...], "kwargs": {...},           # the operation's arguments
      "facts": {                                # "<fact module>.<FactClass>": value, or
        "packages.HeldPackages": ["a"],         #   {"<k>=<v>, ...": value} for a fact with
        "files.Sha256File": {"path=/x": null}   #   arguments (pyinfra's get_kwargs_str)
      },
      "commands": [...],                        # exactly what the operation yields
      "noops": [...],                           # every host.noop(...) message, in order
      "logs": [...],                            # optional: host.log_styled messages
      "exception": {"name": ..., "message": ...},  # instead of commands: what it raises
      "data": {...}, "executing": false,        # host data; planning (false) or executing
      "connector": {"host_key_type": "ssh-ed25519"}  # what this run's SSH connection verified
    }

A fact value is what the fact returns, in one of three forms:
- plain JSON, for facts that return lists, strings, dicts or None;
- {"$fact": {...}}: the fact's dataclass built from the JSON (field by field, typed);
- {"$output": [lines]} or {"$file": "tests/fixtures/..."}: recorded or written command
  output, given to the fact's own process(): the operation sees what the real parser makes.

Commands are written as pyinfra's tests write them: a string for a StringCommand (its raw
value), ["upload", data, dest] for a file upload, [function, args, kwargs] for a callback.
The long fixed shell scripts an operation passes as an argument (module constants) appear as
<module.NAME>: their text is tested by the e2e tests and tests/unit/test_driver_scripts.py;
here what matters is that the right script gets the right arguments.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import logging
import shlex
import sys
import types
import typing
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from pyinfra.api import Config, FileUploadCommand, FunctionCommand, StringCommand
from pyinfra.api.util import get_kwargs_str
from pyinfra.context import ctx_host, ctx_state

from gpufleet.operations.remote_files import Fetch, LazyWrite

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).parent / "operations"

# operations/ modules that hold no operation (helpers of the others)
HELPERS = {"__init__", "as_op", "notice"}


class FakeState:
    cwd = "/"
    in_op = True
    in_deploy = True
    pipelining = False
    deploy_name = None
    deploy_kwargs = None

    def __init__(self, executing: bool):
        self.is_executing = executing
        self.config = Config()

    def get_temp_filename(self, *args: Any, **kwargs: Any) -> str:
        return "_tempfile_"


class FakeData(dict):
    def __getattr__(self, key: str) -> Any:
        return self.get(key)


class FakeHost:
    """Answers the case's facts; records no-ops and logged messages."""

    in_op = True
    in_callback_op = False
    current_op_hash = None
    current_op_global_arguments: dict[str, Any] = {}
    current_deploy_name = None
    current_deploy_kwargs = None
    current_deploy_data = None
    print_prefix = "[testhost] "

    def __init__(self, name: str, facts: dict[str, Any], data: dict[str, Any], state: FakeState,
                 connector: dict[str, Any]):
        self.name = name
        self.facts = facts
        self.data = FakeData(data)
        self.state = state
        self.noops: list[str] = []
        self.logs: list[str] = []
        self.connector = _connector(connector)

    def noop(self, description: str) -> None:
        self.noops.append(description)

    def log_styled(self, message: str, **kwargs: Any) -> None:
        self.logs.append(message)

    def log(self, message: str, **kwargs: Any) -> None:
        self.logs.append(message)

    def get_temp_filename(self, *args: Any, **kwargs: Any) -> str:
        return "_tempfile_"

    def get_fact(self, fact_cls: type, *args: Any, **kwargs: Any) -> Any:
        assert not args, "facts are asked with keyword arguments"
        key = f"{fact_cls.__module__.split('.')[-1]}.{fact_cls.__name__}"
        if key not in self.facts:
            raise KeyError(f"the case gives no fact {key} (asked with {kwargs})")
        value = self.facts[key]
        if kwargs:
            # as pyinfra's tests: only arguments the fact's command() takes (else a typo hides a bug)
            real = inspect.getfullargspec(fact_cls.command).args
            assert set(kwargs) <= set(real), f"{key} takes no {sorted(set(kwargs) - set(real))}"
            wanted = get_kwargs_str(kwargs)
            if not isinstance(value, dict) or wanted not in value:
                raise KeyError(f"the case gives no {key} for {wanted!r}")
            value = value[wanted]
        return _fact_value(fact_cls, value)


def _connector(spec: dict[str, Any]) -> Any:
    """pyinfra's SSH connector as far as gpufleet looks at it: the host key it verified."""
    key_type = spec.get("host_key_type")
    if key_type is None:
        return types.SimpleNamespace(client=None)
    key = types.SimpleNamespace(get_name=lambda: key_type)
    transport = types.SimpleNamespace(get_remote_server_key=lambda: key, get_username=lambda: "root")
    return types.SimpleNamespace(client=types.SimpleNamespace(get_transport=lambda: transport))


def _fact_value(fact_cls: type, value: Any) -> Any:
    if isinstance(value, dict) and "$output" in value:
        return fact_cls().process(list(value["$output"]))
    if isinstance(value, dict) and "$file" in value:
        return fact_cls().process((ROOT / value["$file"]).read_text().splitlines())
    if isinstance(value, dict) and "$fact" in value:
        hints = typing.get_type_hints(fact_cls.process)
        return _build(hints["return"], value["$fact"])
    return value


def _build(tp: Any, value: Any) -> Any:
    """A typed value (dataclasses, lists, tuples, dicts, optionals) from JSON."""
    if value is None:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp)}
        unknown = set(value) - names
        assert not unknown, f"{tp.__name__} has no field {sorted(unknown)}"
        return tp(**{k: _build(hints[k], v) for k, v in value.items()})
    if isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return tp(*value)  # a NamedTuple (ClockPair)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        return _build(options[0], value) if len(options) == 1 else value
    if origin is list:
        return [_build(args[0], v) for v in value]
    if origin is tuple:
        item = args[0] if args else Any
        return tuple(_build(item, v) for v in value)
    if origin is dict:
        key_type, value_type = args
        return {(int(k) if key_type is int else k): _build(value_type, v) for k, v in value.items()}
    return value


def _scripts(module: types.ModuleType) -> dict[str, str]:
    """Quoted long script constants of an operation's module, and of the operations modules it
    imports (a shared mechanism: operations/driver.py runs driver_upgrade's), -> their
    <module.NAME> placeholder (the module's own win)."""
    found: dict[str, str] = {}

    def reached(m: types.ModuleType) -> list[types.ModuleType]:
        imported = [v for v in vars(m).values() if isinstance(v, types.ModuleType)]
        sources = {getattr(v, "__module__", None) for v in vars(m).values() if callable(v)}
        return [*imported, *(sys.modules[n] for n in sorted(sources)
                             if n and n.startswith("gpufleet.operations.") and n in sys.modules)]

    # the operations modules it reaches, through those it composes (package_steps -> driver_upgrade
    # -> remote_files), farthest first
    order: list[types.ModuleType] = []
    todo = [module]
    while todo:
        for other in reached(todo.pop()):
            if other not in order and other is not module and other.__name__.startswith("gpufleet.operations."):
                order.append(other)
                todo.append(other)
    for source in [*reversed(order), module]:
        if source is not module and not source.__name__.startswith("gpufleet.operations."):
            continue
        name = source.__name__.split(".")[-1]
        for attr, value in vars(source).items():
            if isinstance(value, str) and ("\n" in value or len(value) > 80):
                found[shlex.quote(value)] = f"<{name}.{attr}>"
                found[value] = f"<{name}.{attr}>"
    return found


def _render(command: Any, scripts: dict[str, str]) -> Any:
    if isinstance(command, str):
        command = StringCommand(command.strip())
    if isinstance(command, StringCommand):
        text = command.get_raw_value()
        for script in sorted(scripts, key=len, reverse=True):
            text = text.replace(script, scripts[script])
        return text
    if isinstance(command, FileUploadCommand):
        src = command.src
        data = src.getvalue() if hasattr(src, "getvalue") else str(src)
        return ["upload", data.decode() if isinstance(data, bytes) else data, str(command.dest)]
    if isinstance(command, FunctionCommand):
        plain = json.loads(json.dumps([list(command.args), command.kwargs],
                                      default=lambda o: f"<{getattr(o, '__name__', type(o).__name__)}>"))
        return [command.function.__name__, *plain]
    if isinstance(command, LazyWrite):  # its content as built when it runs
        return ["write", command.dest, command.mode, command.build()]
    if isinstance(command, Fetch):
        return ["fetch", command.src]
    raise AssertionError(f"not a command: {command!r}")


def _cases() -> list[Any]:
    return [pytest.param(path, id=f"{path.parent.name}/{path.stem}")
            for path in sorted(CASES.glob("*.*/*.json"))]


@pytest.mark.parametrize("path", _cases())
def test_operation_case(path: Path) -> None:
    case = json.loads(path.read_text())
    unknown = set(case) - {"args", "kwargs", "facts", "commands", "noops", "logs", "exception", "data",
                           "executing", "connector", "comment"}
    assert not unknown, f"{path.name}: unknown keys {sorted(unknown)}"
    module_name, op_name = path.parent.name.split(".")
    module = importlib.import_module(f"gpufleet.operations.{module_name}")
    op = getattr(module, op_name)
    state = FakeState(bool(case.get("executing", False)))
    host = FakeHost("testhost", case.get("facts", {}), case.get("data", {}), state, case.get("connector", {}))
    args = case.get("args", [])
    kwargs = {k: _argument(module, v) for k, v in case.get("kwargs", {}).items()}
    logs = _Logs(host)
    pyinfra_logger = logging.getLogger("pyinfra")
    pyinfra_logger.addHandler(logs)
    # a fixed uuid4 (reboot's marker nonce), as pyinfra's tests fix get_timestamp
    try:
        with ctx_state.use(state), ctx_host.use(host), mock.patch("uuid.uuid4", lambda: uuid.UUID(int=1)):
            if "exception" in case:
                with pytest.raises(Exception) as raised:
                    list(op._inner(*args, **kwargs))
                assert type(raised.value).__name__ == case["exception"]["name"]
                assert str(raised.value) == case["exception"]["message"]
                return
            commands = [_render(c, _scripts(module)) for c in op._inner(*args, **kwargs)]
    finally:
        pyinfra_logger.removeHandler(logs)
    assert commands == case["commands"], json.dumps(commands, indent=4)
    assert host.noops == case.get("noops", []), host.noops
    if "logs" in case:
        assert host.logs == case["logs"], host.logs
    # every operation says why it did nothing: a no-op message (shown in the plan), or a log line
    if not commands:
        assert host.noops or host.logs, "no command, and no noop message or log line"


class _Logs(logging.Handler):
    """pyinfra's logger, as the host's log lines (the operations log through both)."""

    def __init__(self, host: FakeHost):
        super().__init__(logging.DEBUG)
        self.host = host

    def emit(self, record: logging.LogRecord) -> None:
        self.host.logs.append(record.getMessage().removeprefix(self.host.print_prefix))


def _argument(module: types.ModuleType, value: Any) -> Any:
    """{"$dataclass": "module.Name", ...fields}: an argument built as that dataclass;
    {"$returns": value}: a callable returning value."""
    if isinstance(value, dict) and "$returns" in value:
        return lambda: value["$returns"]
    if isinstance(value, dict) and "$dataclass" in value:
        owner, name = value["$dataclass"].rsplit(".", 1)
        cls = getattr(importlib.import_module(owner), name)
        return _build(cls, {k: v for k, v in value.items() if k != "$dataclass"})
    return value


def test_every_operation_module_has_cases() -> None:
    """Each operation of every operations/ module has at least one case that changes something
    and one that changes nothing (a no-op), or says in the table below why not."""
    covered: dict[str, set[str]] = {}
    for path in CASES.glob("*.*/*.json"):
        case = json.loads(path.read_text())
        kind = "exception" if "exception" in case else "change" if case["commands"] else "noop"
        covered.setdefault(path.parent.name, set()).add(kind)
    missing = []
    for file in sorted((ROOT / "operations").glob("*.py")):
        if file.stem in HELPERS:
            continue
        module = importlib.import_module(f"gpufleet.operations.{file.stem}")
        for name, value in vars(module).items():
            if getattr(value, "__module__", None) != module.__name__ or not hasattr(value, "_inner"):
                continue
            kinds = covered.get(f"{file.stem}.{name}", set())
            key = f"{file.stem}.{name}"
            wanted = {"change"} if key in ALWAYS_CHANGES else {"noop"} if key in NEVER_CHANGES else {"change", "noop"}
            if not wanted <= kinds:
                missing.append(f"{file.stem}.{name}: {sorted(wanted - kinds)}")
    assert not missing, "operations without a changed and a no-op case:\n" + "\n".join(missing)


#: operations that only ever say something (no changing case exists)
NEVER_CHANGES = {"daemon_reload.still_pending"}

#: operations that always yield commands (is_idempotent=False: no no-op case exists)
ALWAYS_CHANGES = {
    "apt_index.index_refreshed", "apt_index.lists_refreshed", "apt_index.index_read", "drain.gpus_idle_now", "reboot.rebooted", "reboot.slurm_rebooted",
    "snapshot.disk_snapshot_taken", "snapshot.disk_snapshot_restored", "snapshot.controller_snapshot_taken",
    "snapshot.etc_archived", "snapshot.manifest_written", "snapshot.copied_to_controller",
    "driver.refresh_initramfs",
    "daemon_reload.daemon_reload",
    "acceptance.acceptance_recorded",   # written after each passed acceptance: its time is new
}
