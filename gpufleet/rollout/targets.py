"""What each host is rolled out to: the inventory is the only source of truth.

Without --driver-version a host's target is what deploys/all.py resolves for it (tier, group
and host data against its GPUs and OS: driver, flavour, CUDA floor, Fabric Manager). With it,
the version is an override that goes through the same resolver per host, as if the inventory
said `driver_version: X` (and `driver_branch` X's branch): a host it does not fit is refused,
naming the key and what is allowed, before any host is touched.

After a rollout with an override the inventory still says something else: `inventory_lines`
tells the operator which line to set so that the inventory and the hosts agree again (then a
following deploys/all.py is a no-op, and never reports a pending upgrade back).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from gpufleet.errors import Incompatible
from gpufleet.versions import branch_of

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings
    from gpufleet.controller.inventory_source import InventorySource


def wishes(settings: Settings, override: str | None) -> Any:
    """The host's settings, with the override put in the inventory's place."""
    if not override:
        return settings
    return dataclasses.replace(settings, driver_version=override, driver_branch=branch_of(override))


def rollable_source(source: str, os_release: str) -> bool:
    """Whether tools/rollout moves this host's driver: NVIDIA's repository's, or Ubuntu's own
    (`distro` on Ubuntu: the 580-server series with its prebuilt modules, and the kernels they
    follow). Debian's own driver is left to the Debian archive."""
    return source == "nvidia" or (source == "distro" and os_release.startswith("ubuntu-"))


def rollable(survey: dict[str, Any]) -> bool:
    """A surveyed host (runner.survey_and_resolve) whose driver source tools/rollout moves."""
    return rollable_source(survey["driver_source"], survey.get("os") or "")


def resolve_host(host: Any, override: str | None) -> dict[str, Any]:
    """{"target", "resolution"} or {"error": (key, reason, allowed)} for `host` (facts: PCI, nvidia-smi, OS)."""
    from gpufleet.config.hostfacts import hardware, os_name
    from gpufleet.config.resolver import resolve
    from gpufleet.config.settings import host_settings

    settings = host_settings(host)
    try:
        hw = hardware(host)
        if not hw.models:
            raise Incompatible(f"no supported NVIDIA GPU found on the host ({hw.summary})", key=None)
        res = resolve(list(hw.models), wishes(settings, override), os_name(host), nvswitch=hw.nvswitch)
    except Incompatible as refused:
        return {"error": (refused.key or "driver_version", refused.reason, refused.allowed or "")}
    if res.source != "nvidia" and not rollable_source(res.source, os_name(host)):
        return {"error": ("driver_source", f"driver_source is {res.source}: tools/rollout upgrades drivers "
                                           "from NVIDIA's repository, or Ubuntu's own", "nvidia")}
    return {"target": res.driver_version, "resolution": res.describe(), "stack": res.stack_versions}


def refusal_line(host: str, error: tuple[str, str, str], override: str | None) -> str:
    key, reason, allowed = error
    if override and key in ("driver_version", "driver_branch"):
        key = f"--driver-version {override} (as {key})"
    else:
        key = f"key '{key}'"
    return f"host {host}: {key}: {reason}" + (f"; allowed: {allowed}" if allowed else "")


def _source(inventory: Any, host: Any, key: str) -> tuple[str, Any]:
    """Where `key` of `host` comes from: ("host", v) | ("group NAME", v) | ("inventory", v) | ("tier T", v)."""
    if key in (inventory.get_host_data(host.name) or {}):
        return "host", inventory.get_host_data(host.name)[key]
    for group in reversed(host.groups or []):
        data = inventory.get_group_data(group) or {}
        if key in data:
            return f"group {group}", data[key]
    if key in (inventory.get_data() or {}):
        return "inventory", inventory.get_data()[key]
    from gpufleet.catalog.tiers import tier_defaults

    tier = host.data.get("tier")
    return f"tier {tier}", tier_defaults(tier).get(key)


def inventory_lines(inventory_path: InventorySource | str, hosts: list[str], override: str) -> list[str]:
    """The inventory lines to set after a rollout to `override`, so that the inventory says
    what the hosts now run (one line per place the value comes from)."""
    from gpufleet.controller.inventory_source import load_inventory

    inventory = load_inventory(inventory_path)
    wanted = {"driver_version": override, "driver_branch": branch_of(override)}
    places: dict[tuple[str, str, Any], list[str]] = {}
    for host in inventory:
        if host.name not in hosts:
            continue
        for key, value in wanted.items():
            where, now = _source(inventory, host, key)
            if str(now) == value or (key == "driver_branch" and str(now) == "auto"):
                continue
            places.setdefault((key, where, now), []).append(host.name)
    lines = []
    for (key, where, now), names in places.items():
        if where == "host":
            for name in names:
                lines.append(f'{inventory_path}: host {name}: set {key}: "{wanted[key]}" (now {now!r})')
        elif where.startswith("group "):
            lines.append(f'{inventory_path}: the data of {where} ({len(names)} host(s)): set {key}: '
                         f'"{wanted[key]}" (now {now!r})')
        elif where == "inventory":
            lines.append(f'{inventory_path}: inventory-wide data: set {key}: "{wanted[key]}" (now {now!r})')
        else:
            lines.append(f'{inventory_path}: add {key}: "{wanted[key]}" to the data of '
                         f'{", ".join(names)} (or their group): {where} says {now!r}')
    return lines
