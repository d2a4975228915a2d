"""Which hosts go in which batch, how many may be out at once, and when a rollout must stop.

Pure functions: no pyinfra, no I/O; the runner (runner.py) and the unit tests call them.

- The canary batch (the first `canary` hosts) goes first and alone; any failure in it stops the
  rollout, whatever `max_fail` says.
- Then batches of `batch_size` hosts, or `batch_percent` percent of the rollout's hosts (rounded
  up, at least one).
- A batch runs in waves no larger than the room `max_unavailable` leaves: hosts already out
  (failed after their first package change, or waiting for a reboot by hand) take room.
- The rollout stops when more than `max_fail` hosts have failed (a count, or "P%" of the
  rollout's hosts, rounded down).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass


class PlanError(ValueError):
    """A rollout option that cannot work (reported before anything is touched)."""


@dataclass(frozen=True)
class Batch:
    index: int          # 0 = canary
    hosts: tuple[str, ...]

    @property
    def name(self) -> str:
        return "canary" if self.index == 0 else f"batch {self.index}"


def batch_size_for(total: int, batch_size: int | None, batch_percent: float | None, default: int) -> int:
    """Hosts per batch after the canary: an explicit size, a percentage of `total`, or `default`."""
    if batch_size is not None and batch_percent is not None:
        raise PlanError("give --batch-size or --batch-percent, not both")
    if batch_size is not None:
        if batch_size < 1:
            raise PlanError(f"--batch-size must be >= 1, got {batch_size}")
        return batch_size
    if batch_percent is not None:
        if not 0 < batch_percent <= 100:
            raise PlanError(f"--batch-percent must be in (0, 100], got {batch_percent}")
        return max(1, math.ceil(total * batch_percent / 100))
    return max(1, default)


def make_batches(hosts: list[str], canary: int, size: int) -> list[Batch]:
    """The canary batch (first `canary` hosts; none when 0), then batches of `size` hosts, in order."""
    if canary < 0:
        raise PlanError(f"--canary must be >= 0, got {canary}")
    if size < 1:
        raise PlanError(f"batch size must be >= 1, got {size}")
    batches: list[Batch] = []
    rest = list(hosts)
    if canary and rest:
        batches.append(Batch(0, tuple(rest[:canary])))
        rest = rest[canary:]
    for start in range(0, len(rest), size):
        batches.append(Batch(len(batches) + (0 if batches else 1), tuple(rest[start:start + size])))
    return batches


def parse_max_fail(value: str | int, total: int) -> int:
    """`max_fail` as a host count: "2" -> 2, "25%" of 8 hosts -> 2 (rounded down)."""
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)%", text)
    if match:
        percent = float(match.group(1))
        if percent > 100:
            raise PlanError(f"--max-fail {text}: a percentage must be <= 100%")
        return math.floor(total * percent / 100)
    if not text.isdigit():
        raise PlanError(f"--max-fail {text!r}: expected a count (2) or a percentage (25%)")
    return int(text)


def room(max_unavailable: int, unavailable: int) -> int:
    """How many more hosts may be taken out now."""
    return max(0, max_unavailable - unavailable)


def waves(hosts: list[str], max_unavailable: int, unavailable: int) -> list[str]:
    """The hosts of a batch that may start now (the rest wait for the next wave)."""
    return hosts[: room(max_unavailable, unavailable)]


def stop_reason(batch: Batch, failed_in_batch: list[str], failed_total: int, max_fail: int) -> str | None:
    """Why the rollout must stop after a wave of `batch`, or None to carry on."""
    if batch.index == 0 and failed_in_batch:
        return f"the canary failed ({', '.join(failed_in_batch)}): no other host is touched"
    if failed_total > max_fail:
        return f"{failed_total} host(s) failed, more than --max-fail {max_fail}"
    return None
