"""Stop one host, not the fleet: a host that must not be changed is failed at planning time,
so none of its operations run, while the other hosts carry on."""
from __future__ import annotations

from typing import Any

from pyinfra import logger


def fail_host(host: Any, key: str, message: str) -> None:
    """Fail `host` with a message naming the host and the setting involved."""
    logger.error(f"{host.print_prefix}gpufleet refuses to change this host: {key}: {message}")
    host.state.fail_hosts({host})


def host_failed(host: Any) -> bool:
    return host in host.state.failed_hosts
