"""The CUDA stack on a host, by its packages: the CUDA toolkit and cuDNN package families (their
names carry the release), how an installed release compares with the resolved one (exact,
pending: the inventory moved it, drift: changed by hand, renamed: another member of the family
installed), the toolkit's components, and the one wording of each for the run output, the
validation gate, the fleet report and the rollout (deploys/driver.py, deploys/upgrade.py,
deploys/rollback.py, gpufleet/checks/validation.py, gpufleet/controller/run_summary.py, gpufleet/rollout/manifest.py).

Which driver, toolkit and cuDNN releases go together is the resolver's (gpufleet/config/resolver.py,
from gpufleet/data); this module reads what a host has against what was resolved."""
from __future__ import annotations

import re
from typing import Any

from gpufleet.versions import upstream_of


def pending_message(installed: str, resolved: str) -> str:
    """The one wording of a driver change all.py leaves to tools/rollout (run output, gate, report)."""
    return f"driver upgrade pending: {installed} -> {resolved}, run tools/rollout"


def stack_pending_message(what: str, installed: str, resolved: str) -> str:
    """The one wording of a CUDA toolkit / cuDNN release the inventory moved and all.py leaves to
    tools/rollout (run output, gate, report)."""
    return f"{what} upgrade pending: {installed} -> {resolved}, run tools/rollout"


def stack_drift_message(package: str, installed: str, recorded: str, resolved: str) -> str:
    """The one wording of a CUDA toolkit / cuDNN package changed since gpufleet installed it."""
    return (f"{package} {installed} (resolved {resolved}) was changed by hand: gpufleet installed "
            f"{recorded}")


def stack_states(wanted: dict[str, str], installed: dict[str, str | None], recorded: dict[str, str]
                 ) -> dict[str, tuple[str, str, str | None]]:
    """{package: (state, installed release, recorded release)} for the CUDA toolkit / cuDNN
    packages of `wanted` (package -> resolved release) that are installed at another release:
    "pending" when it is the release gpufleet installed (the inventory asks for another one),
    "drift" when gpufleet's record says another one (someone changed the package). A package
    gpufleet has no record of (installed before the record existed) counts as pending."""
    out = {}
    for package, want in sorted(wanted.items()):
        have = installed.get(package)
        if not have or is_exact(have, want):
            continue
        release, mine = upstream_of(have), recorded.get(package)
        out[package] = ("pending" if mine in (None, release) else "drift", release, mine)
    return out


def component_drift(components: dict[str, list[Any]], wanted: dict[str, str], installed: dict[str, str | None]
                    ) -> list[str]:
    """Messages for the CUDA toolkit's components (StackPackages.components: package -> [installed,
    the version the toolkit release asks for, held]) at another version than their release names,
    counted only while the toolkit meta package itself is the resolved release (else it is its own
    pending upgrade or drift): moved by hand or by `apt upgrade` past the holds."""
    if not any(p.startswith("cuda-toolkit-") and is_exact(installed.get(p), v) for p, v in wanted.items()):
        return []
    return [f"{name} {upstream_of(have)} (the CUDA toolkit release ships {shipped}) was changed by hand"
            for name, (have, shipped, _) in sorted(components.items())
            if have and shipped and have != shipped and upstream_of(have) != shipped]


def is_exact(debian_version: str | None, upstream: str) -> bool:
    """True when an installed Debian version is exactly the release ``upstream`` (any revision)."""
    return debian_version is not None and "-" in debian_version and upstream_of(debian_version) == upstream


#: The CUDA toolkit and cuDNN package families whose names carry a release (CUDA 13.0 -> 13.1,
#: cuDNN for CUDA 12 -> 13): another member installed is the same library at another release.
STACK_FAMILIES = (("CUDA toolkit", re.compile(r"^cuda-toolkit-\d+-\d+$")),
                  ("cuDNN", re.compile(r"^libcudnn\d+-(?:dev-|headers-)?cuda-\d+$")))
#: dpkg-query globs that find every installed member of those families
STACK_GLOBS = ("cuda-toolkit-[0-9]*", "libcudnn[0-9]*")


def stack_fact_packages(wanted: dict[str, str]) -> list[str]:
    """The StackPackages arguments for the resolved packages `wanted`: them and their families
    (the same list everywhere, so that one remote command answers the deploy, the record and the gate)."""
    return [*sorted(wanted), *STACK_GLOBS] if wanted else []


def _main(packages: list[str]) -> str:
    return next((p for p in sorted(packages) if "-dev-" not in p and "-headers-" not in p), sorted(packages)[0])


def stack_renames(wanted: dict[str, str], installed: dict[str, str | None]
                  ) -> dict[str, tuple[tuple[str, ...], str, str]]:
    """{"cuDNN": (installed packages it replaces, "old-package release", "new-package release")}
    for each of the CUDA toolkit and cuDNN whose resolved package is not installed while another
    member of its family is: a pending upgrade (tools/rollout replaces it), not a second
    install alongside."""
    out = {}
    for what, family in STACK_FAMILIES:
        group = {p: v for p, v in wanted.items() if family.match(p)}
        if not group or any(installed.get(p) for p in group):
            continue
        others = tuple(sorted(p for p, v in installed.items() if v and family.match(p) and p not in group))
        if others:
            old, new = _main(list(others)), _main(list(group))
            out[what] = (others, f"{old} {upstream_of(installed[old] or '')}", f"{new} {group[new]}")
    return out
