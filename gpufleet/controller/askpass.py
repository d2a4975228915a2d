"""The sudo (and su) password reaches a host on an SSH channel's stdin, never in a command line.

pyinfra 3.10 hands sudo its password as `env SUDO_ASKPASS=<script> PYINFRA_SUDO_PASSWORD=<pw>
sudo -H -A -k sh -c ...`. That text is the command line of the login shell running it (dash,
Debian's `useradd` default, keeps it for the whole command; bash for a moment), which every
local user of the host reads in /proc/<pid>/cmdline: on a real test host a second user polling
/proc read the password in 4 processes of one planning run (issue 44).

Here, per host and SSH connection, one channel of the run's own connection runs HOLD_SCRIPT as
the login user. It makes a fresh folder (`mktemp -d`, umask 077: 0700) in the user's runtime
folder (/run/user/<uid>, a tmpfs only they can enter) or else the host's temp folder, reads the
password from its stdin into a 0600 file there, writes an askpass program beside it that prints
that file, says READY, and waits for its stdin to end; then it removes the folder. Every sudo
command then carries only `SUDO_ASKPASS=<that program>`: no password in any argv or environment.

The channel ends when the run disconnects (gpufleet closes it and waits for the removal), and
when the run is killed or its network drops (sshd closes it): the folder goes either way. A
folder whose holder died without removing it (a reboot, a kill on the host) is removed by the
next holder of that user: its recorded boot id or PID no longer live.

Only over pyinfra's ssh connector (the channel is opened on its paramiko client); a password for
a host reached any other way is refused, never sent. On a pyinfra release gpufleet has not
verified (gpufleet/pyinfra_private.py), pyinfra's own code would put the password on the command
line: there every command that would carry one is refused, with the ways out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pyinfra import logger
from pyinfra.api.command import QuoteString, StringCommand
from pyinfra.api.exceptions import PyinfraError

from gpufleet.config.hostcontext import host_context
from gpufleet.printable import printable

#: $1: the folder to use when the login user has no runtime folder of their own.
HOLD_SCRIPT = r"""
umask 077
boot=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)
run=${XDG_RUNTIME_DIR:-/run/user/$(id -u)}
if [ -d "$run" ] && [ ! -L "$run" ] && [ -O "$run" ] && [ -w "$run" ]; then base=$run; else base=$1; fi
for old in "$base"/gpufleet-askpass.*; do
  [ -d "$old" ] && [ ! -L "$old" ] && [ -O "$old" ] && [ -f "$old/holder" ] || continue
  read -r oboot opid < "$old/holder"
  if [ "$oboot" = "$boot" ] && [ -n "$opid" ] && kill -0 "$opid" 2>/dev/null; then continue; fi
  rm -rf -- "$old"
done
d=$(mktemp -d "$base/gpufleet-askpass.XXXXXXXXXX") || { echo "FAILED no private folder in $base"; exit 70; }
echo "$boot $$" > "$d/holder"
printf '#!/bin/sh\nexec cat -- "${0%%/*}/password"\n' > "$d/askpass"
chmod 700 "$d/askpass"
IFS= read -r pw || pw=
printf '%s\n' "$pw" > "$d/password"
pw=
echo "READY $d/askpass"
while read -r _; do :; done
rm -rf -- "$d"
"""

_READY = re.compile(r"READY (/\S+/gpufleet-askpass\.[A-Za-z0-9]{10}/askpass)")
#: seconds to wait for the holder to make its folder, and to remove it at disconnect
TIMEOUT = 30.0


class PasswordRefused(PyinfraError):
    """A password gpufleet will not send (no safe way to this host, or an unverified pyinfra)."""


@dataclass
class Holder:
    """One host's askpass holder: the paramiko client and channel it runs on, its program."""

    client: Any
    channel: Any
    password: str
    path: str

    def alive(self, client: Any) -> bool:
        return (self.client is client and not self.channel.closed
                and not self.channel.exit_status_ready())

    def close(self) -> None:
        """End its stdin and wait for it to remove its folder (a dead connection: at once)."""
        try:
            transport = self.client.get_transport()
            if self.channel.closed or transport is None or not transport.is_active():
                return   # the connection is gone (a reboot): sshd ended the holder
            self.channel.shutdown_write()
            self.channel.status_event.wait(TIMEOUT)
        except Exception as exc:  # a connection already gone: sshd ended the holder, it removed it
            logger.debug("gpufleet askpass holder: %s", exc)
        finally:
            self.channel.close()


def hold_command(temp_dir: str) -> str:
    text: str = StringCommand("sh", "-c", QuoteString(HOLD_SCRIPT), "gpufleet-askpass",
                              QuoteString(temp_dir)).get_raw_value()
    return text


def askpass_path(host: Any, kind: str, password: str) -> str:
    """The askpass program that prints `password` on `host` (kind: sudo or su), made on first
    use per connection and password."""
    client = getattr(host.connector, "client", None)
    if client is None or client.get_transport() is None:
        raise PasswordRefused(
            f"{host.name}: gpufleet hands a {kind} password over only on an SSH connection "
            f"(pyinfra's ssh connector), and {host.name} is reached another way: the password is "
            "not sent. Fix: reach it over SSH, give its deploy user sudo without a password, or log in as root")
    holders: dict[str, Holder] = host_context(host).askpass
    held = holders.get(kind)
    if held is not None:
        if held.alive(client) and held.password == password:
            return held.path
        holders.pop(kind)
        held.close()
    channel = client.get_transport().open_session()
    channel.settimeout(TIMEOUT)
    channel.exec_command(hold_command(host.get_temp_dir_config()))
    channel.sendall((password + "\n").encode())
    out = channel.makefile("r")
    said: list[str] = []
    try:
        for line in out:
            match = _READY.fullmatch(line.strip())
            if match:
                holders[kind] = Holder(client, channel, password, match.group(1))
                logger.debug("gpufleet askpass holder on %s: %s", host.name, match.group(1))
                return match.group(1)
            said.append(line.strip())
    except OSError as exc:  # socket.timeout included
        said.append(str(exc))
    channel.close()
    raise PasswordRefused(f"{host.name}: could not make the private askpass folder for the {kind} password "
                          f"({printable(' '.join(said))[:300] or 'no answer'}). Fix: check that the login "
                          "user can write its runtime folder or the host's temp folder, then re-run")


def close(host: Any) -> None:
    """Remove the host's askpass folders (at disconnect)."""
    holders: dict[str, Holder] = host_context(host).askpass
    while holders:
        holders.popitem()[1].close()


def refuse_unverified(host: Any, arguments: dict[str, Any]) -> None:
    """On a pyinfra release gpufleet has not verified: PasswordRefused when a command of these
    arguments would carry a sudo or su password (pyinfra would put it on the command line)."""
    from gpufleet import pyinfra_private

    if pyinfra_private.carries_password(host, arguments):
        raise PasswordRefused(
            f"{host.name}: pyinfra {pyinfra_private.pyinfra_version()} is not a release gpufleet verified "
            "how it hands sudo its password (pyinfra 3.10 puts it on the host's command line, where every "
            "local user reads it): the password is not sent. Fix: install pyinfra "
            f"{', '.join(v + '*' for v in pyinfra_private.VERIFIED_PYINFRA)}, give the deploy user sudo "
            "without a password, or log in as root")


_installed = False


def install() -> None:
    """Hand every sudo and su password of this run to its host through the askpass holder (or,
    on a pyinfra release gpufleet has not verified, refuse to send one)."""
    global _installed
    if _installed:
        return
    _installed = True
    from gpufleet import pyinfra_private

    def make_command(state: Any, host: Any, command: Any, **arguments: Any) -> Any:
        return pyinfra_private.unix_command_with_askpass(host, command, askpass_path, **arguments)

    def refusing(state: Any, host: Any, command: Any, **arguments: Any) -> Any:
        refuse_unverified(host, arguments)
        return original(state, host, command, **arguments)

    original = pyinfra_private.original_make_unix_command_for_host()
    pyinfra_private.patch_askpass(make_command, refusing, close)
