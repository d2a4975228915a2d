"""Facts the driver deploy needs besides DriverState: the fingerprints in an apt keyring, what
apt could install (candidates), and which archive components the Debian sources enable.

All read-only: nothing here writes to the host (gpg gets a throw-away home in /dev/shm or /tmp
that is removed again; keyring facts are read only after the host passed its preconditions).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import GPU_HOLDERS, checked_lines, fail

_PID = re.compile(r"^[0-9]+$")


@dataclass(frozen=True)
class SourceEntry:
    path: str
    line: int  # 1-based line of the one-line entry, or of the deb822 Components: field
    uri: str
    components: tuple[str, ...]


# A one-line entry: deb [options] URI SUITE COMPONENT...
_ONE_LINE = re.compile(r"^\s*deb\s+(?:\[[^\]]*\]\s+)?(?P<uri>\S+)\s+(?P<suite>\S+)(?P<components>(?:\s+[^\s#]+)*)")


class DebianArchiveSources(FactBase[list[SourceEntry]]):
    """
    The `deb` entries of /etc/apt/sources.list, sources.list.d/*.list and *.sources (deb822)
    with their components, for editing components in place:

    .. code:: python

        [SourceEntry(path="/etc/apt/sources.list", line=1, uri="http://deb.debian.org/debian",
                     components=("main",))]
    """

    @override
    @staticmethod
    def default() -> list[SourceEntry]:
        return []

    @override
    def command(self) -> str:
        return (
            "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do "
            '[ -f "$f" ] && grep -n -E "^[[:space:]]*deb[[:space:]]" "$f" | sed "s|^|L $f:|"; done; '
            "for f in /etc/apt/sources.list.d/*.sources; do "
            '[ -f "$f" ] && awk -v f="$f" \'/^[[:space:]]*$/{u="";t=""} /^URIs:/{u=$2} /^Types:/{t=$0} '
            '/^Components:/{ if (t ~ /deb( |$)/) { sub(/^Components:[[:space:]]*/, ""); print "S " f ":" FNR ":" u " " $0 } }\' "$f"; '
            "done; true"
        )

    @override
    def process(self, output: list[str]) -> list[SourceEntry]:
        entries = []
        for line in output:
            if not line.strip():
                continue
            kind, _, rest = line.partition(" ")
            path, _, rest = rest.partition(":")
            number, _, text = rest.partition(":")
            if kind not in ("L", "S") or not number.isdigit():
                raise fail("unexpected sources line", line)
            if kind == "L":
                match = _ONE_LINE.match(text)
                if not match or match["suite"].endswith("/"):
                    continue  # flat repositories (suite "/") have no components
                entries.append(SourceEntry(path, int(number), match["uri"], tuple(match["components"].split())))
            else:
                uri, _, comps = text.partition(" ")
                entries.append(SourceEntry(path, int(number), uri, tuple(comps.split())))
        return entries



class GpuDeviceUsers(FactBase[list[int]]):
    """
    PIDs of processes holding a GPU device node (/dev/nvidiaN) open: GPU work that is running,
    also when nvidia-smi cannot tell (driver/library mismatch, NVML not installed):

    .. code:: python

        [4242, 4243]
    """

    @override
    @staticmethod
    def default() -> list[int]:
        return []

    @override
    def command(self) -> str:
        # the fd links matched whole by find (the test GPU_WORK makes), never `ls -l` text: a file
        # a user names "x -> /dev/nvidia0", or with a newline and a PID after it, names nothing
        return GPU_HOLDERS + "; true"

    @override
    def process(self, output: list[str]) -> list[int]:
        return sorted(int(pid) for pid in checked_lines(output, _PID, "a PID"))
