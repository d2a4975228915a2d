"""gpufleet/yamlload.py: libyaml's safe loader gives the same data as PyYAML's Python one."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gpufleet import yamlload

DATA = Path(__file__).resolve().parents[2] / "gpufleet" / "data"
SHIPPED = sorted(DATA.rglob("*.yaml"))


def test_libyaml_is_used_where_pyyaml_has_it():
    assert SHIPPED  # the files below are really there
    expected = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader
    assert yamlload.SAFE_LOADER is expected


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(DATA)))
def test_the_same_data_as_the_python_loader(path):
    text = path.read_text(encoding="utf-8")
    assert yamlload.safe_load(text) == yaml.load(text, Loader=yaml.SafeLoader)


@pytest.mark.parametrize("text", ["!!python/object:os.system ls", "a: !!python/name:os.system"])
def test_still_a_safe_loader(text):
    with pytest.raises(yaml.YAMLError):
        yamlload.safe_load(text)
