"""Uploads and downloads through sudo stage in the login user's private folder, never in /tmp.

pyinfra can SFTP only as the login user, so an upload with `_sudo` goes to a temporary file
first, then root copies it into place (a download the other way: root copies the file out, adds
read permission, the login user fetches it). pyinfra names that file `/tmp/pyinfra-<sha1 of
the destination>`: predictable, in world-writable /tmp. On a shared host any local user can
create that name first (a folder, a file of theirs: the upload fails, every run, on every host
they share) and read what is staged there while it waits (`chmod +r` on a download: a manifest,
a file of root's). Issue 26 item 3.

So every such transfer gets a random name in `/var/lib/gpufleet-upload.<uid>`: made by root
(the run's own sudo) in root's /var/lib, where no other user can create, replace or rename
anything, owned by the login user (SFTP writes as them), 0700, so nobody else can enter it. A
folder found there that is not exactly that (a symlink, another owner, another mode: only root
could have made it so) is refused by name, as the lock folder is (gpufleet/controller/hostlock.py). The
transfer itself is pyinfra's (cp as root, then rm), only its temporary name changes.

Installed by every entry point that changes hosts, next to gpufleet.controller.hostlock.install().
"""
from __future__ import annotations

import re
import uuid
from typing import Any

from pyinfra.api.command import QuoteString, StringCommand

from gpufleet.controller import askpass
from gpufleet.config.hostcontext import host_context
from gpufleet.printable import printable

PARENT = "/var/lib"
PREFIX = PARENT + "/gpufleet-upload."

# Run as root through the transfer's own sudo (so its password, if any, goes as pyinfra sends
# it). sudo sets SUDO_UID to the login user's uid. Prints the folder, or why not.
STAGE_SCRIPT = r"""
u=${SUDO_UID:-}
case "$u" in ''|*[!0-9]*) echo "NOUID sudo did not say who logged in (SUDO_UID)"; exit 74;; esac
[ "$(id -u)" = 0 ] || { echo "UNSAFE the staging folder is made as root, and this runs as $(id -un)"; exit 73; }
if [ "$(stat -c '%u' /var/lib)" != 0 ] || [ -n "$(find /var/lib -maxdepth 0 -perm /022)" ]; then
  echo "UNSAFE /var/lib is not root's own folder: $(stat -c 'owner %U, mode %a' /var/lib)"; exit 73
fi
d=/var/lib/gpufleet-upload.$u
if [ ! -e "$d" ] && [ ! -L "$d" ]; then
  mkdir -m 700 "$d" && chown "$u" "$d" || exit 70
fi
if [ -L "$d" ] || [ ! -d "$d" ] || [ "$(stat -c '%u %a' "$d")" != "$u 700" ]; then
  echo "UNSAFE $(stat -c '%F, owner %U, mode %a' "$d" 2>&1 | head -c 200)"; exit 73
fi
echo "STAGE $d"
"""

_STAGE_LINE = re.compile(r"STAGE (/var/lib/gpufleet-upload\.\d{1,10})")
# what the staging command takes of the transfer's arguments: how to become root, never whom
# to become (a `_sudo_user` transfer still stages as the login user, pyinfra hands it over)
_AUTH = ("_sudo", "_sudo_password", "_preserve_sudo_env", "_use_sudo_login", "_timeout", "_get_pty",
         "_shell_executable")


class StagingRefused(OSError):
    """The staging folder is not the login user's own 0700 folder in root's /var/lib (an OSError:
    pyinfra fails the operation and the host with it, before anything is uploaded)."""


def stage_command() -> StringCommand:
    return StringCommand("sh", "-c", QuoteString(STAGE_SCRIPT), "gpufleet-stage")


def parse_stage(lines: list[str]) -> str:
    """The folder STAGE_SCRIPT printed; StagingRefused with its reason otherwise."""
    for line in lines:
        match = _STAGE_LINE.fullmatch(line.strip())
        if match:
            return match.group(1)
    said = printable(" ".join(line.strip() for line in lines if line.strip())[:300]) or "no answer"
    said = said.removeprefix("UNSAFE ").removeprefix("NOUID ")
    raise StagingRefused(f"refused the gpufleet staging folder {PREFIX}<uid>: not the login user's own 0700 folder "
                         f"in root's {PARENT} ({said}); only root can have made it so: remove it and run again")


def folder(host: Any, kwargs: dict[str, Any]) -> str:
    """The host's staging folder, made or checked once per run and connection."""
    context = host_context(host)
    known = context.staging_folder
    if known and known[0] is host.connector:
        return known[1]
    auth = {k: v for k, v in kwargs.items() if k in _AUTH}
    auth["_sudo"] = True
    status, output = host.run_shell_command(stage_command(), **auth)
    lines = [*output.stdout_lines, *output.stderr_lines] if output is not None else []
    path = parse_stage(lines)   # refuses (raises) unless the script said STAGE
    context.staging_folder = (host.connector, path)
    return path


def temp_name(path: str) -> str:
    return f"{path}/{uuid.uuid4().hex}"


_installed = False


def install() -> None:
    """Give every sudo transfer of this run a random name in the login user's staging folder."""
    global _installed
    if _installed:
        return
    _installed = True
    askpass.install()  # sudo's password through a private file on the host, never a command line
    from gpufleet import pyinfra_private

    def staged(original: Any) -> Any:
        def transfer(self: Any, filename_or_io: Any, remote_filename: Any, remote_temp_filename: Any = None,
                     *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("_sudo"):
                remote_temp_filename = temp_name(folder(self, kwargs))
            return original(self, filename_or_io, remote_filename, remote_temp_filename, *args, **kwargs)
        return transfer

    pyinfra_private.patch_transfers(staged)
