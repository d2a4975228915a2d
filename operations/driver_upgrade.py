"""The sanctioned driver change: release the holds, install exact versions, hold again.

The change runs on the host as a transient systemd unit (`gpufleet-package-change.service`),
not inside the SSH session: when the session dies (controller killed, network gone) apt and
dpkg still finish, the holds come back, and the unit keeps its result for the next run to read.
What runs is a fixed script (PACKAGE_CHANGE_SCRIPT) given the packages as arguments; no shell
text is built from them.
"""
from __future__ import annotations

import re
from collections.abc import Generator, Mapping, Sequence

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.facts.packages import HeldPackages, PackageVersions
from gpufleet.facts.packages import PackageChange
from gpufleet.operations.drain import idle_check
from gpufleet.operations.remote_files import write_command
from gpufleet.versions import downgraded

UNIT = "gpufleet-package-change.service"
SCRIPT_DIR = "/var/lib/gpufleet/libexec"
SCRIPT = SCRIPT_DIR + "/package-change"
LOG = "/var/log/gpufleet/package-change.log"
# package names and Debian versions (epoch, upstream, revision): nothing a shell would expand
_WORD = re.compile(r"^[a-z0-9][a-z0-9.+~:-]*$")

# Run by systemd as the unit's main process. Arguments: unhold=P first=P[=V] install=P[=V]
# remove=P hold=P downgrade norecommends. Every argument is checked against the characters of
# package names and versions. `first`: installed in an apt run of its own before the rest (NVIDIA's
# version lock, whose preferences then choose the versions of what is asked for without one).
PACKAGE_CHANGE_SCRIPT = r"""#!/bin/sh
# gpufleet: the sanctioned driver package change (unhold, install exact versions, hold again),
# run as the transient unit gpufleet-package-change.service so that it survives the SSH session.
set -u
umask 077
mkdir -p /var/log/gpufleet
exec >>/var/log/gpufleet/package-change.log 2>&1
echo "=== $(date -u +%FT%TZ) package change: $*"
unhold= first= specs= hold= opts=
for a in "$@"; do
    case $a in
        *[!a-z0-9.+~:=-]*|'') echo "gpufleet: refused argument with unexpected characters: $a"; exit 2;;
    esac
    case $a in
        unhold=*) unhold="$unhold ${a#unhold=}";;
        first=*) first="$first ${a#first=}";;
        install=*) specs="$specs ${a#install=}";;
        remove=*) specs="$specs ${a#remove=}-";;
        hold=*) hold="$hold ${a#hold=}";;
        downgrade) opts="$opts --allow-downgrades";;
        norecommends) opts="$opts --no-install-recommends";;
        *) echo "gpufleet: unknown argument: $a"; exit 2;;
    esac
done
export DEBIAN_FRONTEND=noninteractive
# a change interrupted earlier (unit killed, host rebooted) left dpkg half done: finish it first
dpkg --configure -a
rc=0
[ -z "$unhold" ] || apt-mark unhold $unhold >/dev/null || rc=$?
apt() { apt-get install -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold -o Dpkg::Use-Pty=0 $opts "$@"; }
if [ $rc -eq 0 ] && [ -n "$first" ]; then apt $first || rc=$?; fi
if [ $rc -eq 0 ] && [ -n "$specs" ]; then apt $specs || rc=$?; fi
# the holds come back whatever apt did, on what is on disk: a package apt never unpacked (the
# new pinning package of a failed change) gets no hold (a selection for a package not installed)
held=
for p in $hold; do
    case $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) in
        ''|*" not-installed"|*" config-files") echo "gpufleet: $p is not installed: not held";;
        *) held="$held $p";;
    esac
done
[ -z "$held" ] || apt-mark hold $held >/dev/null || { [ $rc -ne 0 ] || rc=5; }
echo "=== $(date -u +%FT%TZ) exit $rc"
exit $rc
"""

# Runs in the SSH session: $1 the script the unit runs, then its arguments. Waits for a change an
# earlier session started, (with a gate: checks that no GPU work runs, in this same command),
# starts this one as a transient unit, polls it to its end and reads its result back (the log
# tail on failure). deploys/driver.py's first install runs through it too (operations/driver.py).
def _runner(gate: str = "") -> str:
    return (
        "u=" + UNIT + "; script=$1; shift; "
        "running() { case $(systemctl show -p SubState --value $u 2>/dev/null) in "
        "start*|running|reload|auto-restart) return 0;; esac; return 1; }; "
        "while running; do sleep 1; done; " + gate +
        "systemctl stop $u 2>/dev/null; systemctl reset-failed $u 2>/dev/null; "
        "systemd-run --quiet --unit=$u --description='gpufleet package change' "
        "-p RemainAfterExit=yes -p Type=exec \"$script\" \"$@\" || exit 1; "
        "sleep 0.2; while running; do sleep 1; done; "
        "result=$(systemctl show -p Result --value $u); status=$(systemctl show -p ExecMainStatus --value $u); "
        "if [ \"$result\" != success ]; then tail -n 15 " + LOG + " >&2; "
        "echo \"gpufleet: the package change ($u) ended: $result, exit status $status (its log: " + LOG + ")\" >&2; "
        # its outcome is read (and said): no failed unit is left behind
        "systemctl reset-failed $u 2>/dev/null; exit 1; fi; "
        "echo \"gpufleet: the package change ($u) finished: exit status $status\""
    )


_RUN = _runner()
# a driver package swapped under a running job breaks it: checked right before the unit starts
_RUN_IF_IDLE = _runner(idle_check("not changing the driver packages") + "; ")


def _spec(package: str, version: str | None) -> str:
    return package if version is None else package + "=" + version


def change_arguments(install: Mapping[str, str | None], remove: list[str], unhold: list[str], hold: list[str],
                     downgrade: bool, first: Sequence[str] = (), recommends: bool = True) -> list[str]:
    """The script's arguments; refuses names or versions a shell would read as syntax."""
    # tag=value words, each one argv word of the fixed script (quoted where the command is built)
    args = (["unhold=" + p for p in unhold] + ["first=" + _spec(p, install.get(p)) for p in first]
            + ["install=" + _spec(p, v) for p, v in sorted(install.items())]
            + ["remove=" + p for p in remove] + ["hold=" + p for p in hold] + (["downgrade"] if downgrade else [])
            + ([] if recommends else ["norecommends"]))
    for word in [*(v for v in install.values() if v is not None), *install, *first, *remove, *unhold, *hold]:
        if not _WORD.match(word):
            raise ValueError(f"not a package name or version: {word!r}")
    return args


def package_change_command(args: list[str], script: str = SCRIPT, require_idle: bool = False) -> StringCommand:
    """The command that runs `script` with `args` as the transient unit; `require_idle`: refused
    (drain.BUSY_EXIT, a drain.BUSY_MARK line) when GPU work runs right before it would start."""
    return StringCommand("sh", "-c", QuoteString(_RUN_IF_IDLE if require_idle else _RUN), "gpufleet-package-change",
                         QuoteString(script), *(QuoteString(a) for a in args))


@operation()
def packages_at_versions(install: Mapping[str, str | None], remove: Sequence[str] | None = None,
                         hold: Sequence[str] | None = None, downgrade: bool | None = None,
                         require_idle: bool = False, first: Sequence[str] = (), recommends: bool = True
                         ) -> Generator[StringCommand, None, None]:
    """Put packages at exact versions the sanctioned way: unhold, `apt-get install pkg=ver`, hold,
    as a transient systemd unit on the host (see the module docstring).

    + install: package -> exact Debian version (None: any, for a package only wanted installed)
    + remove: packages to remove in the same apt transaction (e.g. the old pinning package)
    + hold: the packages held afterwards (re-held even when apt fails, so nothing is left loose)
    + downgrade: allow going to older versions (apt --allow-downgrades); None (the default): exactly
      when a target is older than the installed version (Debian version order)
    + require_idle: refuse (busy) when GPU work runs, checked in the command that starts the change
    + first: packages of ``install`` put in first, in an apt run of their own (a version lock)
    + recommends: let apt bring the packages' Recommends
    """
    remove = list(remove or [])
    hold = sorted(set(hold or []))
    names = sorted(set(install) | set(remove))
    installed = host.get_fact(PackageVersions, packages=names) if names else {}
    todo = {name: ver for name, ver in install.items()
            if (installed.get(name) != ver if ver is not None else not installed.get(name))}
    gone = [name for name in remove if installed.get(name)]
    held = {*host.get_fact(HeldPackages)}
    if not todo and not gone:
        missing = sorted(set(hold) - held)
        if missing:
            yield StringCommand("apt-mark", "hold", *(QuoteString(p) for p in missing))
        else:
            host.noop(f"{len(install)} package(s) at their versions already, holds in place")
        return
    release = sorted(held & (set(todo) | set(gone) | set(hold)))
    if downgrade is None:
        downgrade = bool(downgraded(installed, {p: v for p, v in todo.items() if v is not None}))
    args = change_arguments(todo, sorted(gone), release, hold, downgrade,
                            first=[p for p in first if p in todo], recommends=recommends)
    yield StringCommand("install", "-d", "-m", "700", SCRIPT_DIR)
    yield write_command(SCRIPT, PACKAGE_CHANGE_SCRIPT, mode="700")
    yield package_change_command(args, require_idle=require_idle)


@operation()
def package_change_settled() -> Generator[StringCommand, None, None]:
    """Before a package change: let one an earlier (dead) session started finish, and repair what
    an interrupted one left (`dpkg --configure -a`). Holds are put back by packages_at_versions."""
    change = host.get_fact(PackageChange)
    if not change.running and not change.audit:
        if change.result not in (None, "success"):
            host.noop(f"the last package change ({UNIT}) ended: {change.result}, exit status {change.status}")
            # said: the failed unit an earlier (dead) session left is not left behind
            yield StringCommand("systemctl", "reset-failed", UNIT)
        else:
            host.noop("no package change is running and dpkg --audit is clean")
        return
    if change.running:
        yield StringCommand(
            "sh", "-c", QuoteString(
                "while case $(systemctl show -p SubState --value " + UNIT + ") in start*|running) true;; "
                "*) false;; esac; do sleep 1; done; echo \"gpufleet: the package change an earlier run started "
                "ended: $(systemctl show -p Result --value " + UNIT + "), exit status "
                "$(systemctl show -p ExecMainStatus --value " + UNIT + ")\""))
    # dpkg half done (a change killed with its unit, a reboot during it): finish its configuration
    yield StringCommand("sh", "-c", QuoteString(
        "dpkg --audit >/dev/null 2>&1 && [ -z \"$(dpkg --audit 2>/dev/null)\" ] || "
        "DEBIAN_FRONTEND=noninteractive dpkg --configure -a"))
