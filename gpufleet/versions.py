"""Parsing and comparing dotted NVIDIA version strings ("580", "580.95.05", "13.0", "9.17.0"), and
Debian package versions in dpkg's order (debian_compare)."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Mapping, TypeGuard

_VERSION = re.compile(r"^\d+(\.\d+)*$")


def is_version(text: object) -> TypeGuard[str]:
    return isinstance(text, str) and bool(_VERSION.match(text))


def parse(text: str) -> tuple[int, ...]:
    """"580.95.05" -> (580, 95, 5). Raises ValueError on anything else."""
    if not is_version(text):
        raise ValueError(f"not a dotted version: {text!r}")
    return tuple(int(part) for part in text.split("."))


def at_least(version: str, minimum: str) -> bool:
    """True when ``version`` >= ``minimum``; a bare branch minimum ("580") matches all 580.x."""
    return parse(version) >= parse(minimum)


def branch_of(version: str) -> str:
    """"580.95.05" -> "580"."""
    return version.split(".", 1)[0]


def normalise_branch(value: object) -> str | None:
    """Accept 580, "580" or "R580"; return "580", or None when it is not a branch at all."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        text = value.strip()
        if text[:1] in ("R", "r"):
            text = text[1:]
        if text.isdigit():
            return text
    return None


def major(version: str) -> str:
    return version.split(".", 1)[0]


def major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# --- Debian package versions (dpkg's order: deb-version(7), lib/dpkg/version.c) -----------------


def _order(char: str) -> int:
    """dpkg's weight of one non-digit character: '~' before the end, letters before the rest."""
    if char == "~":
        return -1
    if char.isalpha():
        return ord(char)
    return ord(char) + 256


def _compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: alternating non-digit runs (by _order, the end counting 0) and digit runs
    (numerically)."""
    i = j = 0
    while i < len(a) or j < len(b):
        first_diff = 0
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return -1 if ac < bc else 1
            i, j = i + 1, j + 1
        while i < len(a) and a[i] == "0":
            i += 1
        while j < len(b) and b[j] == "0":
            j += 1
        while i < len(a) and a[i].isdigit() and j < len(b) and b[j].isdigit():
            if not first_diff:
                first_diff = (a[i] > b[j]) - (a[i] < b[j])
            i, j = i + 1, j + 1
        if i < len(a) and a[i].isdigit():
            return 1
        if j < len(b) and b[j].isdigit():
            return -1
        if first_diff:
            return first_diff
    return 0


def _split_debian(version: str) -> tuple[int, str, str]:
    epoch, colon, rest = version.partition(":")
    if not colon:
        epoch, rest = "0", version
    if not epoch.isdigit():
        raise ValueError(f"not a Debian version (epoch): {version!r}")
    upstream, dash, revision = rest.rpartition("-")
    if not dash:
        upstream, revision = rest, ""
    if not upstream or not upstream[0].isdigit():
        raise ValueError(f"not a Debian version (upstream must start with a digit): {version!r}")
    return int(epoch), upstream, revision


def debian_compare(a: str, b: str) -> int:
    """-1, 0 or 1 as Debian version `a` sorts before, equal to or after `b` (`dpkg
    --compare-versions`): epoch numerically, then upstream, then revision with dpkg's rules
    ('~' before anything, even the end: 1.0~rc1 < 1.0; a missing revision is ''). Raises
    ValueError on a string that is not a Debian version."""
    ea, ua, ra = _split_debian(a)
    eb, ub, rb = _split_debian(b)
    if ea != eb:
        return -1 if ea < eb else 1
    return _compare_part(ua, ub) or _compare_part(ra, rb)


def debian_older(version: str, than: str) -> bool:
    """True when Debian version `version` sorts before `than` (moving to it is a downgrade)."""
    return debian_compare(version, than) < 0


def downgraded(installed: Mapping[str, str | None], targets: Mapping[str, str]) -> list[str]:
    """The packages of `targets` ({package: Debian version}) that would move to an older version
    than the one installed (apt needs --allow-downgrades for those). Packages not installed are
    installs, never downgrades."""
    return sorted(name for name, version in targets.items()
                  if (have := installed.get(name)) and debian_older(version, have))


def upstream_of(debian_version: str) -> str:
    """'1:9.17.0.29-1' -> '9.17.0.29': the whole upstream part (no epoch, no Debian revision)."""
    return debian_version.split(":", 1)[-1].rsplit("-", 1)[0]


def offered_at(release: str, offered: Iterable[str]) -> str | None:
    """The newest of the Debian versions `offered` whose upstream part (no epoch, no revision)
    is `release`, or which is `release` itself without its epoch (a toolkit's component asked
    for with `>= 13.0.88-1`): None when the sources offer none. Never a version that merely
    starts like it (9.17.0.29 is not 9.17.0.2)."""
    fits = [v for v in offered if v.split(":", 1)[-1] == release or upstream_of(v) == release]
    return max(fits, key=functools.cmp_to_key(debian_compare)) if fits else None
