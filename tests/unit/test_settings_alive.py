"""Every key of gpufleet/data/tiers.yaml is read by code: a module of the product (gpufleet/,
deploys/, operations/, facts/) reads it as `settings.KEY`, `x["KEY"]`, `x.get("KEY")`,
`getattr(x, "KEY")`, the resolver's `_wish(x, "KEY", default)`, or from a table of keys a loop
walks (`for key, ... in (("KEY", ...), ...)`). The settings machinery, which handles every key
alike (the schema, the Settings dataclass's field list, the tiers loader, the docs generator),
does not count, nor does a message that merely names the key.

Computed from the source with ast, so a key added to tiers.yaml and forgotten by the code fails
here (test_a_forgotten_key_is_found proves the check can fail)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gpufleet", "deploys", "operations", "facts")
#: handle every key alike: a key named there is not read by anyone for what it means
MACHINERY = {"gpufleet/schema.py", "gpufleet/settings_doc.py", "gpufleet/tiers.py"}
READERS = {"get", "getattr", "_wish", "setdefault", "pop"}


def tier_keys(text: str) -> set[str]:
    data = yaml.safe_load(text)
    keys = set(data.get("defaults") or {})
    for values in (data.get("tiers") or {}).values():
        keys |= set(values or {})
    return keys


def keys_read(source: str, keys: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in keys:
            found.add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in keys:
            found.add(node.slice.value)
        elif isinstance(node, ast.For):  # a table of keys the loop reads one by one
            found |= {c.value for c in ast.walk(node.iter) if isinstance(c, ast.Constant) and c.value in keys}
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in READERS:
                found |= {a.value for a in node.args if isinstance(a, ast.Constant) and a.value in keys}
    return found


def unread_keys(root: Path, keys: set[str]) -> set[str]:
    read: set[str] = set()
    for top in PRODUCT:
        for path in (root / top).rglob("*.py"):
            if str(path.relative_to(root)) not in MACHINERY:
                read |= keys_read(path.read_text(encoding="utf-8"), keys)
    return keys - read


KEYS = tier_keys((ROOT / "gpufleet/data/tiers.yaml").read_text(encoding="utf-8"))


def test_tiers_yaml_has_keys():
    assert {"tier_mismatch", "clock_policy", "tuning_cpu_governor", "validate_min_ram_gb"} <= KEYS


def test_every_key_is_read_by_code():
    assert unread_keys(ROOT, KEYS) == set(), "keys of tiers.yaml no module reads (implement or remove them)"


def test_a_forgotten_key_is_found(tmp_path):
    """The check can fail: a product tree that reads two keys and names a third only in a
    message and in the schema leaves the third unread."""
    text = "defaults:\n  tuning_a: 1\n  tuning_b: 2\ntiers:\n  x:\n    tuning_c: 3\n"
    keys = tier_keys(text)
    assert keys == {"tuning_a", "tuning_b", "tuning_c"}
    (tmp_path / "gpufleet").mkdir()
    (tmp_path / "gpufleet/schema.py").write_text("KEYS = {'tuning_c': int}\nx['tuning_c']\n")
    (tmp_path / "gpufleet/use.py").write_text(
        "def f(settings, data):\n"
        "    raise ValueError('tuning_c')  # a message naming a key reads nothing\n"
        "    return settings.tuning_a + data.get('tuning_b', 0)\n")
    assert unread_keys(tmp_path, keys) == {"tuning_c"}
    (tmp_path / "gpufleet/loop.py").write_text("for key in ('tuning_c',):\n    print(settings[key])\n")
    assert unread_keys(tmp_path, keys) == set()
