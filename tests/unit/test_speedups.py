"""gpufleet/speedups.py must answer exactly what the pyinfra functions it replaces answer."""
from __future__ import annotations

from types import SimpleNamespace

import pyinfra
import pytest
from pyinfra.api import arguments as pyinfra_arguments
from pyinfra.api import util as pyinfra_util

from gpufleet import speedups

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
