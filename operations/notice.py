"""Messages from inside an operation: visible when the operation runs, quiet while planning."""
from __future__ import annotations

from pyinfra import host, logger


def executing() -> bool:
    return bool(getattr(host.state, "is_executing", False))


def say(message: str) -> None:
    """A visible line (warning level) at execution time; a debug noop while planning."""
    if executing():
        logger.warning(f"{host.print_prefix}{message}")
    else:
        host.noop(message)
