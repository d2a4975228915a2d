"""Files gpufleet writes on a host and copies back, through the operation's own privileges.

pyinfra's `host.put_file`/`get_file` called from a callback run as the login user: with a sudo
user (the operator's shape) they cannot reach root's 0700 /var/lib/gpufleet, and pyinfra's sudo
upload stages through a predictable /tmp/pyinfra-<sha1> that another local user can plant.
These commands are ordinary shell commands instead, run with the connector arguments of the
operation that yields them (sudo, its password through pyinfra's askpass): the content goes on
the command's standard input, never on a command line or under /tmp, and the file appears
whole (a mktemp file in the destination's own folder, then mv).
"""
from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

from pyinfra.api import Host, QuoteString, State, StringCommand
from pyinfra.api.arguments import ConnectorArguments
from pyinfra.api.command import PyinfraCommand

# $1 destination, $2 octal mode; the content on stdin. The folder must exist already (made 0700
# by the operation) and be a real folder: the file is never written through a link.
_WRITE = (
    'set -e; umask 077; d=${1%/*}; '
    '[ -d "$d" ] && [ ! -L "$d" ] || { echo "gpufleet: $d is not a folder" >&2; exit 1; }; '
    't=$(mktemp "$d/.gpufleet-write.XXXXXX"); '
    'if cat > "$t" && chmod "$2" "$t" && mv -f "$t" "$1"; then exit 0; fi; rm -f "$t"; exit 1'
)
# $1 the file; a regular file only (not a link), printed as one base64 line.
_READ = '[ -f "$1" ] && [ ! -L "$1" ] || { echo "gpufleet: $1 is not a regular file" >&2; exit 1; }; base64 -w0 -- "$1"'


def write_command(dest: str, content: str, mode: str = "600") -> StringCommand:
    """The command that writes `content` to `dest` (mode `mode`) with the operation's privileges."""
    return StringCommand("sh", "-c", QuoteString(_WRITE), "gpufleet-write", QuoteString(dest), mode,
                         _stdin=content)


class LazyWrite(PyinfraCommand):
    """`write_command`, its content built when the command runs (a manifest is written after the
    disk snapshot it records). `on_error(state, host)` reports a failure in gpufleet's words."""

    def __init__(self, dest: str, build: Callable[[], str], mode: str = "600",
                 on_error: Callable[[State, Host], bool] | None = None):
        super().__init__()
        self.dest, self.build, self.mode, self.on_error = dest, build, mode, on_error

    def __repr__(self) -> str:
        return f"LazyWrite({self.dest})"

    def execute(self, state: State, host: Host, connector_arguments: ConnectorArguments) -> bool:
        ok, output = write_command(self.dest, self.build(), self.mode).execute(state, host, connector_arguments)
        if not ok:
            for line in output.stderr_lines:
                host.log_styled(line, fg="red")
            return self.on_error(state, host) if self.on_error is not None else False
        return True


class Fetch(PyinfraCommand):
    """Read a file of the host with the operation's privileges and give its bytes to `sink`
    (called on the controller); `on_error(state, host)` when it cannot be read."""

    def __init__(self, src: str, sink: Callable[[bytes], object], on_error: Callable[[State, Host], bool]):
        super().__init__()
        self.src, self.sink, self.on_error = src, sink, on_error

    def __repr__(self) -> str:
        return f"Fetch({self.src})"

    def execute(self, state: State, host: Host, connector_arguments: ConnectorArguments) -> bool:
        ok, output = host.run_shell_command(
            StringCommand("sh", "-c", QuoteString(_READ), "gpufleet-read", QuoteString(self.src)),
            print_output=False, print_input=state.print_input, **connector_arguments)
        if ok:
            try:
                data = base64.b64decode("".join(output.stdout_lines).strip(), validate=True)
            except (binascii.Error, ValueError):
                ok = False
        if not ok:
            return self.on_error(state, host)
        self.sink(data)
        return True
