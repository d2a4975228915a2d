"""
nftables operations: write a ruleset checked with ``nft -c``, load it atomically behind a
dead-man switch.

* ``ruleset``: stage the file, ``nft -c -f`` it (in a private user+network namespace when
  this host may not touch its own rules), and only then move it into place.
* ``apply``: on hosts that can load rules, arm a systemd timer that restores the previous
  gpufleet table in `revert_after` seconds, load the file in one transaction, prove that a
  fresh SSH login still works, and only then disarm the timer. Hosts that cannot load rules
  (containers without CAP_NET_ADMIN) are told so, and nothing fails.

Only gpufleet's own table (``inet gpufleet``) is ever replaced: Docker's tables, the forward
path and IP forwarding are not touched (no ``flush ruleset``).
"""

from __future__ import annotations

import hashlib
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import files

from facts.nftables import APPLIED_RECORD, TABLE, NftablesCapability
from operations.ssh import _fail, fresh_login

REVERT_FILE = "/run/gpufleet/nftables.revert"
REVERT_UNIT = "gpufleet-nft-revert"

# $1 staged file, $2 destination, $3 how to check (direct | namespace)
_CHECK_AND_INSTALL = r"""
set -u
new=$1 dest=$2 how=$3
if [ "$how" = namespace ]; then out=$(unshare -rn nft -c -f "$new" 2>&1); else out=$(nft -c -f "$new" 2>&1); fi
if [ $? -ne 0 ]; then
  rm -f "$new"
  echo "gpufleet: nft -c rejected the new ruleset; $dest is unchanged: $out" >&2
  exit 1
fi
chmod 644 "$new"
mv -f "$new" "$dest"
"""

# $1 ruleset, $2 revert file, $3 timer unit, $4 seconds before the automatic revert, $5 table
_ARM_AND_LOAD = r"""
set -u
conf=$1 revert=$2 unit=$3 after=$4 table=$5
mkdir -p "$(dirname "$revert")"
{ echo "table $table"; echo "delete table $table"; nft list table $table 2>/dev/null; } > "$revert.new"
mv -f "$revert.new" "$revert"
systemctl stop "$unit.timer" >/dev/null 2>&1
systemctl reset-failed "$unit.timer" "$unit.service" >/dev/null 2>&1
systemd-run --quiet --unit="$unit" --on-active="$after" --timer-property=AccuracySec=1s \
  /usr/sbin/nft -f "$revert" || { echo "gpufleet: could not arm the automatic revert; nothing loaded" >&2; exit 1; }
if ! nft -f "$conf"; then
  systemctl stop "$unit.timer" >/dev/null 2>&1
  echo "gpufleet: nft -f $conf failed; the previous rules are still loaded" >&2
  exit 1
fi
"""

# $1 revert file, $2 unit: revert now and disarm.
_REVERT_NOW = 'nft -f "$1"; rc=$?; systemctl stop "$2.timer" >/dev/null 2>&1; exit $rc'
# $1 unit, $2 record file, $3 digest: disarm and record what is loaded.
_DISARM = ('systemctl stop "$1.timer" >/dev/null 2>&1; mkdir -p "$(dirname "$2")"; '
           'printf "%s\\n" "$3" > "$2"')


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@operation()
def ruleset(dest: str, content: str):
    """Write `content` to `dest` once ``nft -c -f`` accepts it; unchanged file: nothing to do."""
    if host.get_fact(Sha256File, path=dest) == _sha256(content):
        host.noop(f"{dest} already holds this ruleset")
        return
    state = host.get_fact(NftablesCapability)
    # While planning, nft may not be installed yet (an earlier operation installs it).
    if not state.can_check and (state.nft_installed or host.state.is_executing):
        yield FunctionCommand(_fail, (
            f"cannot check the ruleset for {dest}: nft is missing, or this host can neither "
            "load rules nor create a private namespace (unshare -rn) to check them in; "
            "nothing was written",
        ), {})
        return
    staged = f"{dest}.gpufleet-new"
    yield from files.put._inner(src=StringIO(content), dest=staged, mode="600")
    yield StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_CHECK_AND_INSTALL), "gpufleet-nft-check",
        QuoteString(staged), QuoteString(dest),
        QuoteString("direct" if state.can_load else "namespace"),
    )


def _confirm_or_revert(state, host, digest: str) -> bool:
    error = fresh_login(host)
    if error is None:
        ok, _ = host.run_shell_command(StringCommand(
            "sh", "-c", QuoteString(_DISARM), "gpufleet-nft-disarm",
            QuoteString(REVERT_UNIT), QuoteString(APPLIED_RECORD), QuoteString(digest),
        ))
        if ok:
            host.log_styled("new firewall rules loaded; a fresh SSH login still works", fg="green")
        return ok
    reverted, _ = host.run_shell_command(StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_REVERT_NOW), "gpufleet-nft-revert",
        QuoteString(REVERT_FILE), QuoteString(REVERT_UNIT),
    ))
    host.log_styled(
        f"a fresh SSH login failed with the new firewall rules ({error}); "
        + ("the previous rules were restored." if reverted else
           "restoring the previous rules over this session failed too: the timer "
           f"{REVERT_UNIT}.timer restores them automatically."),
        fg="red", log_func=logger.error,
    )
    return False


@operation()
def apply(path: str, content: str, revert_after: int = 60):
    """Load `path` atomically, reverted automatically unless a fresh SSH login proves it safe."""
    state = host.get_fact(NftablesCapability)
    if not state.can_load:
        message = (
            f"firewall rules written to {path} and checked with nft -c, but NOT loaded: this "
            "host cannot load nftables rules (no CAP_NET_ADMIN, e.g. a container)"
        )
        host.noop(message)
        host.log_styled(message, fg="yellow", log_func=logger.warning)
        return
    digest = _sha256(content)
    if state.table_loaded and state.applied_digest == digest:
        host.noop(f"the ruleset in {path} is loaded")
        return
    yield StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_ARM_AND_LOAD), "gpufleet-nft-load",
        QuoteString(path), QuoteString(REVERT_FILE), QuoteString(REVERT_UNIT),
        QuoteString(f"{int(revert_after)}s"), QuoteString(TABLE),
    )
    yield FunctionCommand(_confirm_or_revert, (digest,), {})
