"""operations/as_op.py: a callback's own commands run with its operation's privileges (a host
reached as a non-root user with _sudo would otherwise half-apply a change it cannot undo)."""
from __future__ import annotations

import pytest

from gpufleet.operations import as_op

pytestmark = pytest.mark.unit


class FakeHost:
    def __init__(self, arguments):
        self.current_op_global_arguments = arguments
        self.calls = []

    def run_shell_command(self, command, **kwargs):
        self.calls.append((command, kwargs))
        return True, None


def test_privilege_arguments_of_the_running_operation_are_passed():
    host = FakeHost({"_sudo": True, "_sudo_password": "pw", "_sudo_user": "root", "_retries": 3,
                     "_timeout": 5, "_stdin": "x", "_if": None})
    assert as_op.run(host, "true") == (True, None)
    assert host.calls == [("true", {"_sudo": True, "_sudo_password": "pw", "_sudo_user": "root"})]


def test_outside_an_operation_nothing_is_added():
    host = FakeHost(None)
    as_op.run(host, "true")
    assert host.calls == [("true", {})]


def test_every_privilege_argument_is_a_pyinfra_connector_argument():
    from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS

    assert set(as_op.PRIVILEGE_ARGUMENTS) <= set(CONNECTOR_ARGUMENT_KEYS)
