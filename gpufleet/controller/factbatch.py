"""One process for many file and unit facts in the prefetch (gpufleet/controller/factcache.py).

A no-op run of deploys/all.py asks about 50 of pyinfra's file facts per host (File, Directory,
Sha1File, Sha256File: every files.put checks its destination and its parent), and each one
starts a `stat` or `sha1sum` of its own on the host: about a fifth of the host's CPU for the
whole prefetch (bench/fact_cost.py). Here each family is asked with one `stat` or one
`sha1sum`/`sha256sum` over all its paths, and each path's output line is handed to the fact's
own process(), so the answers are the ones pyinfra's own command would give:

- a path that does not exist (checked with the shell's `test`, as pyinfra's command does) gets
  the fact's default;
- a path that exists but printed nothing (a directory given to sha1sum, an unreadable file) is
  left out, so pyinfra asks it the normal way.

The same holds for pyinfra's SystemdStatus and SystemdEnabled (every systemd.service asks both,
each a `systemctl show` of its own): one `systemctl show` with both properties for all units,
whose blocks come back one per unit in argument order, each handed to the asking fact.

And for the facts that read dpkg's database (a no-op asks PackageVersions five times,
StackPackages, HeldPackages and pyinfra's DebPackages, `dpkg -l`: each a `dpkg-query` that
parses dpkg's whole status file, about 4-8 ms of host CPU a call): one fixed `dpkg-query -W '*'`
(no name from a plan on its command line) prints every package dpkg knows, installed or not,
with its status, names, version and Depends, and each fact is handed what its own command would
have printed, built from those rows, to its own process() (dpkg 1.19-1.23, src/query/main.c):

- `dpkg-query -W NAMES...` (PackageVersions, StackPackages): the rows of the packages a name
  equals or a glob matches (fnmatch on the package name, every architecture), each once, in
  dpkg's order: the order `'*'` prints them in. Globs are taken only in a small grammar whose
  Python match is fnmatch's (letters, digits, + . -, `*`, `?`, ascending [a-z] [0-9] ranges);
  others keep their own command;
- `dpkg-query -W` with no name (HeldPackages) and `dpkg -l` (DebPackages): the rows whose
  status is not not-installed, as both list them; `dpkg -l`'s row is its first four columns
  (status, name with its architecture where dpkg shows one, version), all pyinfra's pattern
  reads, and the row of an installed package without a version (`<none>`, translated) is left
  to its own command;
- StackPackages' record file is read in the same section, after the rows.

Anything the section cannot vouch for, a row not of the expected shape, dpkg-query failing,
no `dpkg` for `dpkg -l`, no dpkg-query for HeldPackages (its own command then asks apt-mark),
leaves those facts to their own commands. `dpkg --audit` (PackageChange) reads more than the
status file (each package's .list and .md5sums files, the database lock) and keeps its own
command; so does DriverState's script, whose package list is one part of a larger answer.
"""
from __future__ import annotations

import re
import shlex
from functools import lru_cache
from typing import Any

from pyinfra.facts import deb as pyinfra_deb
from pyinfra.facts import files as pyinfra_files
from pyinfra.facts import systemd as pyinfra_systemd

from gpufleet import pyinfra_private
from gpufleet.facts._common import MARK, with_values
from gpufleet.facts.packages import (STACK_RECORD, HeldPackages, PackageVersions, StackPackages,
                                     stack_component_patterns)

_PATH = "::gpufleet-path::"
_MISSING = "::gpufleet-missing::"
# pyinfra's own format, taken from its command: "stat -c '<format>'" (none: no stat batch; the
# prefetch runs only where pyinfra_private says this release has it)
_STAT_FORMAT = (shlex.split(pyinfra_private.linux_stat_command()) + ["", "", ""])[2]
_HASH_TOOLS: dict[type, str] = {pyinfra_files.Sha1File: "sha1sum", pyinfra_files.Sha256File: "sha256sum"}
_HASH_TOOLS_BY_NAME = {tool: tool for tool in _HASH_TOOLS.values()}
# A package name as dpkg-query is asked it: no architecture, no glob
_PLAIN_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]{0,255}")
# A glob whose fnmatch (dpkg's, flags 0) is the regular expression _glob_regex() makes of it: a
# name's characters, * and ?, and bracket sets of those characters and ascending ranges of digits
# or of lower-case letters (no negation, no backslash, no - alone in a set)
_GLOB = re.compile(r"[a-z0-9](?:[a-z0-9+.*?-]|\[(?:[0-9]-[0-9]|[a-z]-[a-z]|[a-z0-9+.])+\]){0,255}")
_GLOB_PART = re.compile(r"\[([^]]+)\]|\*|\?|[a-z0-9+.-]")


# The families whose facts ask about names (units, packages), and the argument that holds them
_NAMES_ARGUMENT = {"systemctl": "services", "dpkg": "packages"}
_DPKG_LISTS = (HeldPackages, pyinfra_deb.DebPackages)  # facts without arguments, reading all packages


@lru_cache(maxsize=1024)
def _glob_regex(spec: str) -> re.Pattern[str] | None:
    """The package names `spec` stands for to dpkg-query (a name, or a glob of _GLOB), as a
    regular expression; None when it is outside that grammar (its fact keeps its own command)."""
    if _PLAIN_PACKAGE.fullmatch(spec):
        return re.compile(re.escape(spec))
    if not _GLOB.fullmatch(spec):
        return None
    parts = []
    for match in _GLOB_PART.finditer(spec):
        token, bracket = match.group(0), match.group(1)
        if bracket is not None:
            ranges = re.findall(r"(.)-(.)|(.)", bracket)
            if any(low and low > high for low, high, _ in ranges):
                return None
            parts.append("[" + "".join(f"{low}-{high}" if low else re.escape(one) for low, high, one in ranges) + "]")
        else:
            parts.append({"*": ".*", "?": "."}.get(token, re.escape(token)))
    return re.compile("".join(parts), re.DOTALL)


def _names(value: Any) -> Any:
    """A fact's names argument as a list: one name may be given as a string."""
    return [value] if isinstance(value, str) else value


def family(cls: type, kwargs: dict[str, Any]) -> str | None:
    """The batch a fact asked with these arguments can join, or None to run it on its own."""
    if cls in (pyinfra_systemd.SystemdStatus, pyinfra_systemd.SystemdEnabled):
        plain = not kwargs.get("user_mode") and kwargs.get("machine") is None and kwargs.get("user_name") is None
        names = _names(kwargs.get("services"))
        if plain and isinstance(names, list) and names and all(
                isinstance(n, str) and n and "*" not in n and "\n" not in n for n in names):
            return "systemctl"
        return None
    if cls in _DPKG_LISTS:
        return "dpkg" if not kwargs else None
    if cls in (PackageVersions, StackPackages):
        # StackPackages reads a string's characters as names for its toolkits: a list only
        names = _names(kwargs.get("packages")) if cls is PackageVersions else kwargs.get("packages")
        if set(kwargs) == {"packages"} and isinstance(names, list) and names and all(
                isinstance(n, str) and _glob_regex(n) is not None for n in names):
            return "dpkg"
        return None
    path = kwargs.get("path")
    if set(kwargs) != {"path"} or not isinstance(path, str) or not path.startswith("/") \
            or any(c in path for c in "\n\\"):
        return None  # relative, ~ and odd paths: left to pyinfra's own command
    if cls in (pyinfra_files.File, pyinfra_files.Directory):
        return "stat" if _STAT_FORMAT else None
    return _HASH_TOOLS.get(cls)


def keys(name: str, kwargs: dict[str, Any]) -> list[str]:
    """What one fact of family `name` asks about: its path, or its units or packages."""
    if name in _NAMES_ARGUMENT:
        return list(_names(kwargs.get(_NAMES_ARGUMENT[name], [])))
    return [kwargs["path"]]


def command(name: str, paths: list[str]) -> str:
    """Shell answering one family for all `paths` (units for systemctl): missing paths first,
    then one tool run."""
    args = " ".join(["set --", *(shlex.quote(p) for p in paths)])  # the paths, each one quoted word
    if name == "systemctl":
        return args + "\n" + _SYSTEMCTL
    if name == "dpkg":  # every package: the names are picked on the controller
        return with_values(_DPKG_ALL, mark=_DPKG_MARK, fmt=_DPKG_ROW_FORMAT, record=STACK_RECORD)
    script = _MISSING_LOOP + (_STAT if name == "stat" else _HASH)
    return args + "\n" + with_values(script, missing=_MISSING, fmt=_PATH + "%n\\n" + _STAT_FORMAT + "\\n",
                                     tool=_HASH_TOOLS_BY_NAME.get(name, "false"))


# The fixed scripts of command(): the paths (units) are "$@".
_SYSTEMCTL = 'systemctl show --all --property Id --property SubState --property UnitFileState -- "$@"'
# Every package dpkg knows ('*': installed or not, as a name or glob asked prints them), its
# status and exit status, whether `dpkg` is there, then StackPackages' record file
_DPKG_ALL = ('if command -v dpkg-query >/dev/null 2>&1; then echo "${mark}rows"; '
             'dpkg-query -W -f="$fmt" \'*\' 2>/dev/null; echo "${mark}status $?"; '
             'if command -v dpkg >/dev/null 2>&1; then echo "${mark}dpkg"; fi; fi; '
             'echo "${mark}record"; cat "$record" 2>/dev/null; echo "${mark}end"')
_DPKG_MARK = "::gpufleet-dpkg::"
# status (want, state, error: 'ii ', 'hi ', 'un ', 'rc ', 'iUR'), name, name as `dpkg -l` shows it
# (with its architecture for Multi-Arch: same and foreign ones), version, Depends
_DPKG_ROW_FORMAT = r"${db:Status-Abbrev}\t${Package}\t${binary:Package}\t${Version}\t${Depends}\n"
_DPKG_ROW = re.compile(r"([uihrp][ncHUFWti][ R])\t([a-z0-9][a-z0-9+._-]{0,255})\t(\2(?::[a-z0-9-]{1,64})?)"
                       r"\t([^\t\s]{0,256})\t([^\t]*)")
_MISSING_LOOP = 'for p in "$@"; do [ -e "$p" ] || [ -L "$p" ] || echo "$missing$p"; done; '
_STAT = 'stat --printf "$fmt" -- "$@" 2>/dev/null; true'
_HASH = '"$tool" -- "$@" 2>/dev/null; true'


def split(name: str, paths: list[str], lines: list[str]) -> tuple[set[str], dict[str, Any]]:
    """(missing paths, {path or unit: its output lines}) from the output of command() (for the
    dpkg family, the parts _dpkg_split() names)."""
    missing = {line[len(_MISSING):] for line in lines if line.startswith(_MISSING)}
    found: dict[str, Any] = {}
    if name == "systemctl":
        blocks: list[list[str]] = [[]]
        for line in lines:
            if line.strip():
                blocks[-1].append(line)
            elif blocks[-1]:
                blocks.append([])
        blocks = [b for b in blocks if b]
        if len(blocks) == len(paths):  # one block per unit, in order; otherwise trust none
            found = dict(zip(paths, blocks))
    elif name == "dpkg":
        found = _dpkg_split(lines)
    elif name == "stat":
        current = None
        for line in lines:
            if line.startswith(_PATH):
                current = line[len(_PATH):]
            elif current is not None and not line.startswith(_MISSING):
                found[current] = [line]
                current = None
    else:
        for line in lines:
            digest, sep, path = line.partition("  ")
            if sep and not line.startswith(_MISSING):
                found[path] = [line]
    return missing, found


def answer(fact: Any, asked: list[str], missing: set[str], found: dict[str, Any]) -> tuple[bool, Any]:
    """(known, value) for one fact of a batch, given what it asked (keys()); known is False
    when pyinfra must ask it itself."""
    if len(asked) == 1 and asked[0] in missing:
        return True, fact.default()
    if isinstance(fact, (PackageVersions, StackPackages, *_DPKG_LISTS)):
        output = _dpkg_output(fact, asked, found)
        return (False, None) if output is None else (True, fact.process(output))
    if all(key in found for key in asked):
        lines: list[str] = []
        for key in asked:
            lines += [*found[key], ""]  # blocks apart, as systemctl show prints them
        return True, fact.process(lines[:-1])
    return False, None


def _dpkg_split(lines: list[str]) -> dict[str, Any]:
    """The dpkg section's parts: "rows" (each checked, split into its fields; "index": each
    name's rows), "record" (StackPackages' record file, when it ended in a newline), "dpkg"
    (present when `dpkg` is), "no dpkg-query" (present when it is not); no rows when dpkg-query
    failed or printed a row of another shape."""
    found: dict[str, Any] = {}
    try:
        record = lines.index(_DPKG_MARK + "record")
    except ValueError:
        return found
    if lines[-1:] == [_DPKG_MARK + "end"]:
        found["record"] = lines[record + 1:-1]
    if lines[:1] != [_DPKG_MARK + "rows"]:
        found["no dpkg-query"] = []
        return found
    rows, rest = lines[1:record], []
    for at, line in enumerate(rows):
        if line.startswith(_DPKG_MARK):
            rows, rest = rows[:at], rows[at:]
            break
    if rest[:1] != [_DPKG_MARK + "status 0"] or rest[1:] not in ([], [_DPKG_MARK + "dpkg"]):
        return found  # dpkg-query failed (or listed nothing: it then says so with status 1)
    if not all(_DPKG_ROW.fullmatch(row) for row in rows):
        return found
    # split once per host, and indexed by name: each fact then picks its rows without a scan (a
    # no-op hands these rows to nine facts; scanning 650 rows per fact and pattern cost the
    # controller 13 ms a host, bench/controller.py)
    parsed = [row.split("\t") for row in rows]
    index: dict[str, list[int]] = {}
    for at, row in enumerate(parsed):
        index.setdefault(row[1], []).append(at)
    found["rows"], found["index"] = parsed, index
    if rest[1:]:
        found["dpkg"] = []
    return found


def _dpkg_output(fact: Any, asked: list[str], found: dict[str, Any]) -> list[str] | None:
    """What the fact's own command would have printed, from the dpkg section's rows (None: ask
    it with its own command)."""
    if "rows" not in found and "no dpkg-query" not in found:
        return None   # dpkg-query failed, or printed what the section cannot vouch for
    rows: list[list[str]] = found.get("rows", [])
    index: dict[str, list[int]] = found.get("index", {})
    if isinstance(fact, HeldPackages):
        if "rows" not in found:
            return None   # without dpkg-query its own command asks apt-mark
        # `dpkg-query -W -f='${db:Status-Want} ${Package}\n' | sed -n 's/^hold //p'`
        return [name for status, name, *_ in rows if status[1] != "n" and status[0] == "h"]
    if isinstance(fact, pyinfra_deb.DebPackages):
        if "rows" not in found or "dpkg" not in found:
            return None
        listed = [(status, shown, version) for status, _, shown, version, _ in rows if status[1] != "n"]
        if any(status[:2] in ("ii", "hi") and not version for status, _, version in listed):
            return None   # `<none>` (translated) in dpkg -l: left to its own command
        # dpkg -l's first columns: what pyinfra's pattern reads (^[i|h]i\s+name:?arch\s+version.+$)
        return [f"{status} {shown} {version} -" for status, shown, version in listed]
    components = stack_component_patterns(asked) if isinstance(fact, StackPackages) else []
    if any(_glob_regex(spec) is None for spec in [*asked, *components]):
        return None   # a pattern whose dpkg match this module cannot reproduce: its own command

    def matching(specs: list[str]) -> list[list[str]]:
        """The rows a name equals or a glob matches, each once, in dpkg's order."""
        picked: set[int] = set()
        for spec in specs:
            if _PLAIN_PACKAGE.fullmatch(spec):
                picked.update(index.get(spec, ()))
            else:
                pattern = _glob_regex(spec)
                assert pattern is not None  # every spec was checked above
                picked.update(at for at, row in enumerate(rows) if pattern.fullmatch(row[1]))
        return [rows[at] for at in sorted(picked)]

    # PackageVersions' own output: the names it echoes, then dpkg-query's lines in DPKG_FORMAT
    output = [" ".join([MARK + " want", *(n for n in asked if not set("*?[") & set(n))]), MARK + " begin dpkg",
              *(f"{name} {version} {status}" for status, name, _, version, _ in matching(asked))]
    if isinstance(fact, StackPackages):
        if "record" not in found:
            return None
        output += [MARK + " begin record", *found["record"]]
        if components:
            output += [MARK + " begin components",
                       *(f"{name}\t{version}\t{status}\t{depends}"
                         for status, name, _, version, depends in matching(components))]
    return output
