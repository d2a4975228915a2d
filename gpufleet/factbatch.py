"""One process for many file and unit facts in the prefetch (gpufleet/factcache.py).

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

And for gpufleet's PackageVersions asked with plain package names (a no-op asks it five times,
each a `dpkg-query` that parses dpkg's whole status file: about 4 ms of host CPU a call): one
`dpkg-query` over every name asked, in the fact's own format; each fact is handed its own want
line and the lines dpkg-query printed for its names (dpkg-query prints a line per package, the
name first; filtering by it gives what the fact's own call prints, in the same order per name).
Names with an architecture (`foo:amd64`) or a glob print lines that do not start with the name
asked: those facts keep their own command.
"""
from __future__ import annotations

import re
import shlex
from typing import Any

from pyinfra.facts import files as pyinfra_files
from pyinfra.facts import systemd as pyinfra_systemd

from gpufleet import pyinfra_private
from gpufleet.facts._common import MARK, with_values
from gpufleet.facts.packages import DPKG_FORMAT, PackageVersions

_PATH = "::gpufleet-path::"
_MISSING = "::gpufleet-missing::"
# pyinfra's own format, taken from its command: "stat -c '<format>'" (none: no stat batch; the
# prefetch runs only where pyinfra_private says this release has it)
_STAT_FORMAT = (shlex.split(pyinfra_private.linux_stat_command()) + ["", "", ""])[2]
_HASH_TOOLS: dict[type, str] = {pyinfra_files.Sha1File: "sha1sum", pyinfra_files.Sha256File: "sha256sum"}
_HASH_TOOLS_BY_NAME = {tool: tool for tool in _HASH_TOOLS.values()}
# A package name dpkg-query prints as asked (${Package}): no architecture, no glob
_PLAIN_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]{0,255}")


# The families whose facts ask about names (units, packages), and the argument that holds them
_NAMES_ARGUMENT = {"systemctl": "services", "dpkg-query": "packages"}


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
    if cls is PackageVersions:
        names = _names(kwargs.get("packages"))
        if set(kwargs) == {"packages"} and isinstance(names, list) and names and all(
                isinstance(n, str) and _PLAIN_PACKAGE.fullmatch(n) for n in names):
            return "dpkg-query"
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
        return list(_names(kwargs[_NAMES_ARGUMENT[name]]))
    return [kwargs["path"]]


def command(name: str, paths: list[str]) -> str:
    """Shell answering one family for all `paths` (units for systemctl): missing paths first,
    then one tool run."""
    args = " ".join(["set --", *(shlex.quote(p) for p in paths)])  # the paths, each one quoted word
    if name == "systemctl":
        return args + "\n" + _SYSTEMCTL
    if name == "dpkg-query":
        return args + "\n" + with_values(_DPKG_QUERY, fmt=DPKG_FORMAT)
    script = _MISSING_LOOP + (_STAT if name == "stat" else _HASH)
    return args + "\n" + with_values(script, missing=_MISSING, fmt=_PATH + "%n\\n" + _STAT_FORMAT + "\\n",
                                     tool=_HASH_TOOLS_BY_NAME.get(name, "false"))


# The fixed scripts of command(): the paths (units) are "$@".
_SYSTEMCTL = 'systemctl show --all --property Id --property SubState --property UnitFileState -- "$@"'
# PackageVersions' own call, for all names at once (no dpkg-query: no lines, every name None)
_DPKG_QUERY = 'if command -v dpkg-query >/dev/null 2>&1; then dpkg-query -W -f="$fmt" "$@" 2>/dev/null; fi; true'
_MISSING_LOOP = 'for p in "$@"; do [ -e "$p" ] || [ -L "$p" ] || echo "$missing$p"; done; '
_STAT = 'stat --printf "$fmt" -- "$@" 2>/dev/null; true'
_HASH = '"$tool" -- "$@" 2>/dev/null; true'


def split(name: str, paths: list[str], lines: list[str]) -> tuple[set[str], dict[str, list[str]]]:
    """(missing paths, {path or unit: its output lines}) from the output of command()."""
    missing = {line[len(_MISSING):] for line in lines if line.startswith(_MISSING)}
    found: dict[str, list[str]] = {}
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
    elif name == "dpkg-query":
        asked = set(paths)
        found = {package: [] for package in paths}
        for line in lines:
            package = line.split(" ", 1)[0]
            if package in asked:
                found[package].append(line)
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


def answer(fact: Any, asked: list[str], missing: set[str], found: dict[str, list[str]]) -> tuple[bool, Any]:
    """(known, value) for one fact of a batch, given what it asked (keys()); known is False
    when pyinfra must ask it itself."""
    if len(asked) == 1 and asked[0] in missing:
        return True, fact.default()
    if isinstance(fact, PackageVersions):
        if not all(key in found for key in asked):
            return False, None
        # what its own command prints: the names asked, then dpkg-query's lines for them
        return True, fact.process([" ".join([MARK + " want", *asked]), MARK + " begin dpkg",
                                   *(line for key in dict.fromkeys(asked) for line in found[key])])
    if all(key in found for key in asked):
        lines: list[str] = []
        for key in asked:
            lines += [*found[key], ""]  # blocks apart, as systemctl show prints them
        return True, fact.process(lines[:-1])
    return False, None
