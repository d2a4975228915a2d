"""YAML through libyaml's parser where PyYAML was built with it.

PyYAML's pure-Python SafeLoader took 70 ms to parse gpufleet/data/compat.yaml (50 KB), which a
run of deploys/all.py then parsed three times (now once, gpufleet/catalog/compat.py's packaged_mapping),
and tiers.yaml once: a quarter of a second of the controller's fixed cost per run
(bench/controller.py's profile). CSafeLoader is the same safe
constructor and resolver over libyaml's scanner (9x faster here); tests/unit/test_yamlload.py
checks that both give the same data for every YAML file gpufleet ships.
"""
from __future__ import annotations

from typing import IO, Any

import yaml

#: libyaml's safe loader when PyYAML has it (the wheels on PyPI do), else the Python one
SAFE_LOADER: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(stream: str | bytes | IO[str] | IO[bytes]) -> Any:
    """yaml.safe_load, parsed by SAFE_LOADER."""
    return yaml.load(stream, Loader=SAFE_LOADER)  # noqa: S506 - a safe loader
