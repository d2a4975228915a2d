"""Shell commands run from inside an operation's callback (a FunctionCommand: confirm a login,
disarm a revert timer, restore a configuration) with the privileges of that operation.

pyinfra hands an operation's connector arguments (`_sudo`, `_sudo_password`, `_su_user`, ...)
to the commands the operation yields, but a callback's own `host.run_shell_command` gets none
of them: on a host reached as a non-root user with `_sudo: True` it would run unprivileged and
fail half-way through a change that must complete or be put back."""
from __future__ import annotations

from typing import Any

from pyinfra.api import Host, StringCommand
from pyinfra.connectors.util import CommandOutput

# Who runs the command and how; not the operation's own retries, timeouts or stdin.
PRIVILEGE_ARGUMENTS = (
    "_sudo", "_sudo_user", "_use_sudo_login", "_sudo_password", "_preserve_sudo_env",
    "_su_user", "_use_su_login", "_preserve_su_env", "_su_shell", "_su_password",
    "_doas", "_doas_user", "_dzdo", "_dzdo_user", "_shell_executable", "_env",
)


def privileges(host: Any) -> dict[str, Any]:
    """The running operation's privilege arguments (empty outside an operation)."""
    arguments = getattr(host, "current_op_global_arguments", None) or {}
    return {key: arguments[key] for key in PRIVILEGE_ARGUMENTS if key in arguments}


def run(host: Host, command: str | StringCommand) -> tuple[bool, CommandOutput]:
    """`host.run_shell_command(command)` as the running operation would run it."""
    return host.run_shell_command(command, **privileges(host))
