"""Issue 47 item 6: gpufleet/versions.py's Debian order (debian_compare, written by hand) proven
against dpkg's own (`dpkg --compare-versions`, the oracle) over every version string gpufleet
meets: compat.yaml's versions (driver releases, CUDA updates, package builds, and the Debian
versions its notes quote), the stand-in CUDA repository (testing/aptrepo.py: versions and the
versions in its relations, an epoch among them), and the recorded Ubuntu archive versions
(tests/fixtures/ubuntu: `~22.04.1` backports). Each also with an epoch and with a `~` pre-release
of itself, so both rules meet real strings.

The proof: sorted by debian_compare, every adjacent pair is the same (lt / eq) for dpkg, and
debian_compare is consistent with that order over all pairs; a total order that agrees on every
adjacent pair agrees on all of them.
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpufleet.versions import debian_compare
from testing import aptrepo

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not shutil.which("dpkg"), reason="no dpkg to compare with")]

ROOT = Path(__file__).resolve().parents[2]
#: a Debian version as gpufleet meets them: [epoch:]upstream[-revision]
DEBIAN = re.compile(r"(?<![\w.:~+-])(?:\d+:)?\d[\w.+~]*(?:-[\w.+~]+)?(?![\w.:~+-])")


def _walk(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [s for k, v in node.items() for s in (*_walk(k), *_walk(v))]
    if isinstance(node, list):
        return [s for v in node for s in _walk(v)]
    return [node] if isinstance(node, str) else []


def _compat_versions() -> set[str]:
    import yaml

    raw = yaml.safe_load((ROOT / "gpufleet" / "data" / "compat.yaml").read_text(encoding="utf-8"))
    found = set()
    for text in _walk(raw):
        found.update(v for v in DEBIAN.findall(text) if "." in v and not re.search(r"[a-z]{4,}\.", v))
    return found


def _stand_in_versions() -> set[str]:
    found = set()
    for pkg in aptrepo.default_packages():
        found.add(pkg.version)
        for relation in (*pkg.depends, *pkg.provides, *pkg.conflicts):
            found.update(re.findall(r"\((?:<<|<=|=|>=|>>) ([^)]+)\)", relation))
    return found


def _recorded_ubuntu_versions() -> set[str]:
    found = set()
    for path in (ROOT / "tests" / "fixtures" / "ubuntu").rglob("*.txt"):
        for line in path.read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.split("|")] if "|" in line else line.split()
            found.update(c for c in cells if re.fullmatch(r"(?:\d+:)?\d[\w.+~]*-[\w.+~]+|\d+(?:\.\d+)+[\w.+~]*", c))
    return found


@functools.lru_cache(maxsize=1)
def versions() -> tuple[str, ...]:
    base = _compat_versions() | _stand_in_versions() | _recorded_ubuntu_versions()
    derived = set()
    for v in base:
        epoch, colon, rest = v.partition(":")
        rest = rest if colon else v
        upstream, dash, revision = rest.rpartition("-")
        upstream = upstream if dash else rest
        derived.add(f"1:{rest}")                                               # an epoch
        derived.add(f"{upstream}~rc1" + (f"-{revision}" if dash else ""))     # a pre-release of it
    return tuple(sorted(base | derived))


def dpkg(a: str, op: str, b: str) -> bool:
    return subprocess.run(["dpkg", "--compare-versions", a, op, b], check=False).returncode == 0


def test_the_oracle_sees_every_kind_of_version():
    vs = versions()
    assert len(vs) > 100
    assert any(":" in v for v in _stand_in_versions())                  # a real epoch (DCGM 1:4.4.0-1)
    assert any("~" in v for v in _recorded_ubuntu_versions())           # real tildes (6.8.0-90.91~22.04.1)
    assert "580.173.02-0ubuntu0.22.04.1" in vs and "535.309.01-0+deb12u1" in vs and "9.17.0.29-1" in vs
    assert {"595.71.05", "13.2.2", "570.26"} <= set(vs)


def test_debian_compare_orders_every_version_as_dpkg_does():
    ordered = sorted(versions(), key=functools.cmp_to_key(debian_compare))
    # consistent: the sort's order is debian_compare's over every pair
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            assert debian_compare(a, b) <= 0 and debian_compare(b, a) >= 0, (a, b)
    # and dpkg's, pair by adjacent pair
    wrong = []
    for a, b in zip(ordered, ordered[1:]):
        ours = debian_compare(a, b)
        if not dpkg(a, "lt" if ours < 0 else "eq", b):
            wrong.append((a, "lt" if ours < 0 else "eq", b))
    assert not wrong, wrong
