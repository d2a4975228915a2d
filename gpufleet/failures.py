"""Stop one host, not the fleet: a host that must not be changed is failed at planning time,
so none of its operations run, while the other hosts carry on."""
from __future__ import annotations

from typing import Any

from pyinfra import logger


def real_host(host: Any) -> Any:
    """The Host behind pyinfra's `host` context proxy (the proxy follows whichever host is
    current, so it must never be stored)."""
    from pyinfra.context import ctx_host

    return ctx_host.get() if host is ctx_host.context else host


def fail_host(host: Any, key: str, message: str) -> None:
    """Fail `host` with a message naming the host and the setting involved."""
    host = real_host(host)
    logger.error(f"{host.print_prefix}gpufleet refuses to change this host: {key}: {message}")
    host.state.fail_hosts({host})


def host_failed(host: Any) -> bool:
    host = real_host(host)
    return host in host.state.failed_hosts
