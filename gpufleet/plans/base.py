"""What deploys/base.py makes true on every host, and the gate's base checks compare with: the
tier's diagnostics packages (sysstat collecting activity data when it is one of them) and the
record that gpufleet manages the host, and from which tier."""
from __future__ import annotations

from dataclasses import dataclass

from gpufleet.catalog.tiers import managed_marker
from gpufleet.config.settings import Settings

#: Anyone logged in can tell what manages the host; the gate compares it line by line.
MARKER_PATH = "/etc/gpufleet/managed"


@dataclass(frozen=True)
class BasePlan:
    packages: tuple[str, ...]   # extra_packages, installed without recommends
    sysstat: bool               # sysstat is one of them: collect activity data, run at every boot
    marker: str                 # MARKER_PATH's text

    @property
    def marker_lines(self) -> list[str]:
        return self.marker.splitlines()


def plan_base(settings: Settings) -> BasePlan:
    packages = tuple(settings.extra_packages)
    return BasePlan(packages, "sysstat" in packages, managed_marker(settings.tier))
