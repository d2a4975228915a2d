"""The settings reference (docs/settings.md), generated from gpufleet/data/tiers.yaml.

tiers.yaml is the one documented place for every tunable; this page is made from it (its
comments become the descriptions), and a unit test fails when the page is stale, so the docs
cannot drift from the defaults. Regenerate with `tools/settings-doc`.
"""
from __future__ import annotations

import json
import re
from importlib import resources

from gpufleet.config.schema import KEYS
from gpufleet.catalog.tiers import common_defaults, raw_tier, tier_names

_LINE = re.compile(r"^  ([a-z][a-z0-9_]*):.*?#\s*(.+)$")


def _comments() -> dict[str, str]:
    text = resources.files("gpufleet").joinpath("data/tiers.yaml").read_text(encoding="utf-8")
    block = text.split("\ntiers:", 1)[0]
    return {m[1]: m[2].strip() for m in map(_LINE.match, block.splitlines()) if m}


def _cell(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return "`" + text.replace("|", "\\|") + "`"


def render() -> str:
    comments = _comments()
    tiers = tier_names()
    lines = [
        "# Settings reference",
        "",
        "Generated from `gpufleet/data/tiers.yaml` by `tools/settings-doc`; do not edit by hand.",
        "Every setting can be overridden per group or per host in the inventory with the same key.",
        "Accepted values are checked at planning time (`gpufleet/config/schema.py`).",
        "",
        "| key | default | " + " | ".join(tiers) + " | what it does |",
        "| --- | --- | " + " | ".join("---" for _ in tiers) + " | --- |",
    ]
    defaults = common_defaults()
    for key in KEYS:
        if key == "tier":
            continue
        per_tier = [_cell(raw_tier(t)[key]) if key in raw_tier(t) else "" for t in tiers]
        lines.append(f"| `{key}` | {_cell(defaults.get(key, ''))} | " + " | ".join(per_tier)
                     + f" | {comments.get(key, '').replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"
