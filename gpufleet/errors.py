"""Exceptions raised by gpufleet.

They derive from pyinfra's PyinfraError so the pyinfra CLI prints the message cleanly and stops
before it changes anything on a host.
"""

from __future__ import annotations

from pyinfra.api.exceptions import PyinfraError


class GpufleetError(PyinfraError):
    """Base class of every gpufleet error."""


class CompatDataError(GpufleetError):
    """The packaged YAML data (compat.yaml / tiers.yaml) is malformed: a bug in gpufleet itself."""


class Incompatible(GpufleetError):
    """The resolver refuses a combination of GPUs, wishes and operating system.

    ``key`` names the setting most responsible (so validation can point at it) and ``allowed``
    lists what would have worked, when that is known.
    """

    def __init__(self, reason: str, key: str | None = None, allowed: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.key = key
        self.allowed = allowed


class InventoryError(GpufleetError):
    """One or more hosts have invalid gpufleet settings; one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        count = len(self.problems)
        header = f"gpufleet: {count} problem{'s' if count != 1 else ''} in the inventory:"
        super().__init__("\n".join([header, *(f"  {line}" for line in self.problems)]))
