"""gpufleet/controller/speedups.py must answer exactly what the pyinfra functions it replaces answer."""
from __future__ import annotations

from types import SimpleNamespace

import pyinfra
import pytest
from pyinfra.api import arguments as pyinfra_arguments
from pyinfra.api import util as pyinfra_util

from gpufleet.controller import speedups

ORIGINAL_ORDER = pyinfra_util.get_operation_order_from_stack  # the module itself is never patched


def _ask(fn, state):
    # Stands in for pyinfra's operation wrapper: both functions are called from the same frame.
    return fn(state)


def _nested(depth, fn, state):
    if depth == 0:
        return _ask(fn, state)
    return _nested(depth - 1, fn, state)


@pytest.mark.parametrize("is_cli", [True, False])
@pytest.mark.parametrize("deploy_file", [__file__, "/nowhere/deploy.py", None])
@pytest.mark.parametrize("depth", [0, 3])
def test_operation_order_matches_pyinfra(monkeypatch, is_cli, deploy_file, depth):
    monkeypatch.setattr(pyinfra, "is_cli", is_cli)
    state = SimpleNamespace(current_deploy_filename=deploy_file, current_op_file_number=7)
    # Both from one line of this file: the order is made of call-line numbers
    expected, got = [_nested(depth, fn, state) for fn in (ORIGINAL_ORDER, speedups.operation_order_from_stack)]
    assert got == expected
    if deploy_file == __file__:
        assert len(got) >= depth + 3  # the frames from the deploy file down were walked


def test_operation_order_differs_by_call_line():
    state = SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=0)
    first = _ask(speedups.operation_order_from_stack, state)
    second = [_ask(speedups.operation_order_from_stack, state)][0]
    assert first != second  # two call lines, two orders: what pyinfra ids operations by


def test_global_arguments_match_pyinfra():
    expected = list(pyinfra_arguments.get_type_hints(pyinfra_arguments.AllArguments).items())
    assert speedups.all_global_arguments() == expected
    got = speedups.all_global_arguments()
    got.clear()  # callers get their own list
    assert speedups.all_global_arguments() == expected


def test_install_replaces_what_pyinfra_calls():
    import importlib

    speedups.install()
    operation = importlib.import_module("pyinfra.api.operation")
    facts = importlib.import_module("pyinfra.api.facts")
    assert operation.get_operation_order_from_stack is speedups.operation_order_from_stack
    assert pyinfra_arguments.all_global_arguments is speedups.all_global_arguments
    assert facts.all_global_arguments is speedups.all_global_arguments


def test_pinned_to_the_pyinfra_release_it_was_compared_with():
    from importlib.metadata import version

    # Failing here means pyinfra was upgraded: re-run this file against the new release and
    # add it to VERIFIED_PYINFRA (until then the speed-ups stay off, pyinfra's own code runs).
    assert version("pyinfra").startswith(speedups.VERIFIED_PYINFRA)


# -- pop_global_arguments: pyinfra's own function, the host's data read once per call ---------

def _fleet():
    from pyinfra.api import Config, Inventory, State

    inventory = Inventory(
        ([("web1", {"_sudo": True, "_env": {"A": "host"}, "tier": "research"}),
          ("web2", {"_sudo_user": "gpu"}), ("web3", {})],
         {"_retries": 2, "_env": {"A": "global"}}),
        gpus=(["web1", "web2"], {"_sudo": False, "_shell_executable": "bash", "_env": {"A": "gpus"}}),
        late=(["web2"], {"_shell_executable": "dash"}),
    )
    return inventory, State(inventory, Config(SUDO_PASSWORD=None))


def _both(state, host, kwargs):
    original = pyinfra_arguments.pop_global_arguments
    mine, theirs = dict(kwargs), dict(kwargs)
    return speedups.pop_global_arguments(state, host, mine), mine, original(state, host, theirs), theirs


@pytest.mark.parametrize("name", ["web1", "web2", "web3"])
@pytest.mark.parametrize("kwargs", [{}, {"_sudo": False, "path": "/x"}, {"_env": {"B": "op"}, "_retries": 5}])
@pytest.mark.parametrize("deploy", [None, ({"_sudo_user": "deployer", "_if": []}, {"_shell_executable": "zsh"})])
@pytest.mark.parametrize("override", [{}, {"_retries": 9, "_sudo": True}])
def test_pop_global_arguments_matches_pyinfra(name, kwargs, deploy, override):
    from contextlib import nullcontext

    inventory, state = _fleet()
    host = inventory.get_host(name)
    for key, value in override.items():
        setattr(host.data, key, value)  # `host.data.x = ...` in a deploy: the override layer
    scope = host.deploy("d", *deploy) if deploy else nullcontext()
    with scope:
        mine, my_left, theirs, their_left = _both(state, host, kwargs)
    assert mine == theirs and my_left == their_left  # the arguments, the keys found, what is left
    assert my_left == {k: v for k, v in kwargs.items() if not k.startswith("_")}


def test_pop_global_arguments_copies_what_it_hands_out():
    inventory, state = _fleet()
    host = inventory.get_host("web1")
    arguments, _ = speedups.pop_global_arguments(state, host, {})
    assert arguments["_env"] == {"A": "host"}
    arguments["_env"]["A"] = "changed"  # a shallow copy, as HostData gives: the host keeps its own
    assert host.data._env == {"A": "host"}
    assert speedups.pop_global_arguments(state, host, {})[0]["_env"] == {"A": "host"}


def test_pop_global_arguments_reads_each_data_source_once_per_call():
    inventory, state = _fleet()
    host = inventory.get_host("web2")
    calls = []
    counted = inventory.get_groups_data

    def counting(groups):
        calls.append(1)
        return counted(groups)

    inventory.get_groups_data = counting
    speedups.pop_global_arguments(state, host, {})
    assert len(calls) == 1
    calls.clear()
    pyinfra_arguments.pop_global_arguments(state, host, {})
    assert len(calls) > 20  # pyinfra's own: once per global argument the earlier layers lack


def test_install_replaces_pop_global_arguments_where_it_is_called():
    import importlib

    speedups.install()
    for path in ("pyinfra.api.operation", "pyinfra.api.facts", "pyinfra.api.deploy"):
        assert importlib.import_module(path).pop_global_arguments is speedups.pop_global_arguments
    # pyinfra's own stays in its module: the replacement calls it
    assert pyinfra_arguments.pop_global_arguments is not speedups.pop_global_arguments
