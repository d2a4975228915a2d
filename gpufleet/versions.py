"""Parsing and comparing dotted NVIDIA version strings ("580", "580.95.05", "13.0", "9.17.0")."""

from __future__ import annotations

import re
from typing import TypeGuard

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
