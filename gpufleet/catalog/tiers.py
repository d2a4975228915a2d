"""Loads gpufleet/data/tiers.yaml: tier names and each tier's default settings."""

from __future__ import annotations

from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, Mapping

from gpufleet import yamlload
from gpufleet.errors import CompatDataError

SUPPORTED_SCHEMA = 1


def _freeze(data: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(data))


@lru_cache(maxsize=1)
def _load() -> tuple[Mapping[str, Any], Mapping[str, Mapping[str, Any]]]:
    text = resources.files("gpufleet").joinpath("data/tiers.yaml").read_text(encoding="utf-8")
    data = yamlload.safe_load(text)
    if data.get("schema_version") != SUPPORTED_SCHEMA:
        raise CompatDataError(f"tiers.yaml: schema_version {data.get('schema_version')!r}; allowed: {SUPPORTED_SCHEMA}")
    defaults = data.get("defaults") or {}
    tiers = data.get("tiers") or {}
    if not tiers:
        raise CompatDataError("tiers.yaml: no tiers defined")
    return _freeze(defaults), _freeze({name: _freeze(values or {}) for name, values in tiers.items()})


def tier_names() -> tuple[str, ...]:
    """Tier names in file order."""
    return tuple(_load()[1])


def tier_defaults(tier: str) -> Mapping[str, Any]:
    """Merged defaults for ``tier`` (the `defaults` block overlaid by the tier's own block).

    Raises KeyError for an unknown tier; validation reports that case with the list of tiers.
    """
    defaults, tiers = _load()
    merged = dict(defaults)
    merged.update(tiers[tier])
    merged["tier"] = tier
    return MappingProxyType(merged)


def raw_tier(tier: str) -> Mapping[str, Any]:
    """Only the keys the tier sets itself (for documentation and tests)."""
    return _load()[1][tier]


def common_defaults() -> Mapping[str, Any]:
    return _load()[0]


def managed_marker(tier: str) -> str:
    """/etc/gpufleet/managed: written by deploys/base.py, compared line by line by the validation gate."""
    return (
        "# Managed by gpufleet. Do not edit: gpufleet rewrites this file.\n"
        f"tier: {tier}\n"
    )
