"""A converged real test host, as the plans see it: its settings and its facts, taken from the
controller's no-op recording (tests/fixtures/controller/noop-recording.json, recorded by
bench/controller.py --record from a host deploys/all.py had converged), each fact processed by
its own class (or answered from the recorded dpkg rows as the run's prefetch answers it,
gpufleet/controller/factbatch.py). The plans' unit tests read it: a plan made from these facts
must be the host as it is (its /etc/nftables.conf, its sshd -T, its daemon.json)."""
from __future__ import annotations

import json
from functools import cache
from typing import Any

from pyinfra.api import FactBase

from gpufleet.config.settings import Settings
from gpufleet.controller import factbatch
from gpufleet.facts.packages import PackageVersions
from testing import replay


@cache
def recording() -> dict[str, Any]:
    return json.loads(replay.RECORDING.read_text())


def lines(command_part: str) -> list[str]:
    """The recorded output of the one prefetch section whose command holds `command_part`."""
    [section] = [s for s in recording()["sections"] if command_part in s["text"]]
    return list(section["lines"])


def fact(cls: type[FactBase], command_part: str) -> Any:
    return cls().process(lines(command_part))


def package_versions(packages: list[str]) -> dict[str, str | None]:
    """PackageVersions(packages=...) as the run's prefetch answers it from the recorded dpkg rows."""
    found = factbatch._dpkg_split(lines("mark=::gpufleet-dpkg::"))
    known, value = factbatch.answer(PackageVersions(), packages, set(), found)
    assert known
    return dict(value)


def settings(**over: Any) -> Settings:
    """The recorded host's settings (its inventory data), with `over` on top."""
    from gpufleet.config.settings import host_settings
    from tests.unit.test_settings import inventory

    data = {k: v for k, v in recording()["data"].items() if not k.startswith("ssh_")}
    return host_settings(inventory({**data, **over}).get_host("gpu-a01"))
