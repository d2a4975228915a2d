"""
Helpers shared by the gpufleet facts: the parse error type, the section markers
our multi-part commands print, and small value converters.

Nothing here runs on a remote host; everything is pure and unit-tested through
the facts that use it.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Iterable, Sequence
from typing import Any

from pyinfra.api.exceptions import FactProcessError

# Every multi-part command prints lines starting with this prefix to separate its
# parts. It cannot collide with nvidia-smi, /proc or /sys output (none of them
# prints a line starting with "::").
MARK = "::gpufleet::"


# Fixed shell text that sets $pids (processes holding a GPU device node open) and $apps
# (nvidia-smi's compute processes, empty when nvidia-smi cannot answer, e.g. during a
# driver/library mismatch): GPU work is running when either is non-empty. The one test of "the
# GPUs are idle" that the commands which interrupt GPU work (operations/drain.py's idle_check) and
# the facts that load the GPUs (facts/dcgm_diag.py) put first in their own command.
# The device nodes are found by their fd links matched whole (find -lname), not in `ls -l` text:
# a file a user names "x -> /dev/nvidia0" must not make a host look busy.
# (The names in $apps, which their users chose, are for the refusal's message alone, on one line.)
GPU_HOLDERS = (
    "find /proc/[0-9]*/fd -maxdepth 1 -lname '/dev/nvidia[0-9]*' -printf '%h\\n' 2>/dev/null "
    "| sed -n 's|^/proc/\\([0-9][0-9]*\\)/fd$|\\1|p' | sort -un"
)
GPU_WORK = (
    "pids=$(" + GPU_HOLDERS + "); "
    "apps=$(nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader 2>/dev/null) || apps="
)


class FactParseError(FactProcessError, ValueError):
    """
    Raised when a command printed something a parser does not understand.

    It is a pyinfra ``FactProcessError`` so that pyinfra logs it and fails only
    the host that printed it (any other exception would abort the whole run),
    and a ``ValueError`` so that plain-Python callers can catch it as such.
    """


def fail(what: str, line: str | None = None) -> FactParseError:
    """Build a FactParseError naming what was unexpected (and the offending line)."""
    if line is None:
        return FactParseError(what)
    return FactParseError(f"{what}: {line!r}")


class JsonMixin:
    """
    Lets pyinfra's CLI (``pyinfra HOST fact ...``) print our dataclasses:
    its JSON encoder calls ``to_json()`` on objects it does not know.
    """

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


# Values nvidia-smi (and some /sys files) print when a value is unavailable. Values
# wrapped in brackets ("[N/A]", "[Not Supported]", "[Requested functionality has
# been deprecated]", "[Unknown Error]", "[Insufficient Permissions]") are always
# "no value"; the unbracketed forms below are printed by other nvidia-smi modes.
_UNAVAILABLE = {
    "",
    "n/a",
    "not supported",
    "requested functionality has been deprecated",
    "not found",
    "unknown error",
    "insufficient permissions",
}


def unavailable(value: str) -> bool:
    v = value.strip()
    if v.startswith("[") and v.endswith("]"):
        return True
    return v.lower() in _UNAVAILABLE


def opt_str(value: str) -> str | None:
    """Strip a value; None when it is one of the 'no value' spellings."""
    return None if unavailable(value) else value.strip()


_NUMBER_WITH_UNIT = re.compile(r"^(-?\d+(?:\.\d+)?)(?:\s*[A-Za-z/%]+)?$")


def opt_int(value: str, what: str) -> int | None:
    """
    Parse '1980', '1980 MHz' or '143771 MiB' as an int; None for 'no value'
    spellings; FactParseError naming ``what`` for anything else.
    """
    if unavailable(value):
        return None
    match = _NUMBER_WITH_UNIT.match(value.strip())
    if not match:
        raise fail(f"expected a number for {what}", value)
    number = match.group(1)
    if "." in number:
        as_float = float(number)
        if not as_float.is_integer():
            raise fail(f"expected a whole number for {what}", value)
        return int(as_float)
    return int(number)


def split_sections(lines: Iterable[str], strict: bool = False) -> tuple[dict[str, list[str]], dict[str, str]]:
    """
    Split the output of a multi-part command.

    The command prints ``::gpufleet:: begin NAME`` before each part and
    ``::gpufleet:: KEY VALUE...`` for single values (exit codes, statuses).
    Returns ``(sections, values)``: lines per section, and the single values by
    key (``"rc query-gpu": "0"`` is stored as ``values["rc query-gpu"] = "0"``;
    the last word is the value, the words before it the key).
    Lines before the first section marker are kept under the key ``""``.
    ``strict``: a section or a value that comes twice is a FactParseError (a script that
    prints each once: a second one is text that is not the script's own, e.g. a forged marker).
    """
    sections: dict[str, list[str]] = {"": []}
    values: dict[str, str] = {}
    current = ""
    for line in lines:
        if line.startswith(MARK):
            words = line[len(MARK) :].split()
            if not words:
                raise fail("empty section marker", line)
            if words[0] == "begin":
                if len(words) != 2:
                    raise fail("malformed section marker", line)
                current = words[1]
                if strict and current in sections:
                    raise fail("a section marker repeated", line)
                sections.setdefault(current, [])
                continue
            key, value = (words[0], "") if len(words) == 1 else (" ".join(words[:-1]), words[-1])
            if strict and key in values:
                raise fail("a value marker repeated", line)
            values[key] = value
            continue
        sections[current].append(line)
    return sections, values


def with_values(script: str, **values: object) -> str:
    """A fixed `script` given its values as shell variables set before it, each quoted: how a
    fact's command takes arguments (no value is ever pasted into shell text)."""
    lines = []
    for name, value in values.items():
        if not name.isidentifier() or not isinstance(value, (str, int)):
            raise ValueError(f"not a shell variable and its value: {name!r}")
        lines.append(name + "=" + shlex.quote(str(value)))
    return "\n".join([*lines, script])


def begin(name: str) -> str:
    """Shell snippet printing the marker that starts section ``name``."""
    return "echo " + shlex.quote(MARK + " begin " + name)


def nonblank(lines: Sequence[str]) -> list[str]:
    return [line for line in lines if line.strip()]


def checked_lines(lines: Iterable[str], pattern: re.Pattern[str], what: str) -> list[str]:
    """The stripped non-blank lines, each of which must match ``pattern``; a FactParseError
    saying what was expected (and naming the line) otherwise."""
    out = []
    for line in lines:
        value = line.strip()
        if not value:
            continue
        if not pattern.match(value):
            raise fail(f"expected {what}", line)
        out.append(value)
    return out


def key_values(lines: Iterable[str], what: str) -> dict[str, str]:
    """Parse 'KEY=VALUE' lines (as printed by our /sys loops) into a dict."""
    result: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            continue
        key, sep, value = line.partition("=")
        if not sep or not key or " " in key:
            raise fail(f"expected KEY=VALUE in {what}", line)
        result[key] = value
    return result


def read_files(directory: str, **files_to_vars: str) -> str:
    """Shell that reads the first line of each file in `directory` into a variable, empty when
    the file is missing or unreadable, with the shell's own `read` (no process started)."""
    return "".join(f'{var}=; read -r {var} 2>/dev/null < "{directory}/{name}"; '
                   for name, var in files_to_vars.items())
