"""apt holds: keep packages that must move together from being upgraded behind the operator's back."""
from __future__ import annotations

from collections.abc import Generator

from pyinfra import host
from pyinfra.api import StringCommand, QuoteString, operation

from gpufleet.facts.packages import HeldPackages


@operation()
def held(packages: list[str], present: bool = True) -> Generator[StringCommand, None, None]:
    """Hold (or, with present=False, release) `packages`; only those not already so are touched.

    + packages: package names (holds on packages that are not installed are recorded by dpkg too)
    + present: True = hold, False = unhold
    """
    current = {*host.get_fact(HeldPackages)}
    todo = sorted(set(packages) - current) if present else sorted(set(packages) & current)
    if not todo:
        host.noop(f"{'held' if present else 'not held'} already: {', '.join(sorted(packages)) or 'nothing'}")
        return
    yield StringCommand("apt-mark", "hold" if present else "unhold", *(QuoteString(p) for p in todo))
