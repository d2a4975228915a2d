"""gpufleet's data files against their JSON Schemas (tests/unit/schemas/, checked with the
jsonschema package): compat.yaml's entries carry the fields the resolver reads in their grammar
and cite their sources; tiers.yaml names every key once in `defaults`, prefixed by its area, and
no tier sets a key the defaults do not name."""
from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit
SCHEMAS = Path(__file__).resolve().parent / "schemas"


def data(name: str) -> Any:
    return yaml.safe_load(resources.files("gpufleet").joinpath(f"data/{name}.yaml").read_text(encoding="utf-8"))


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def problems(name: str, document: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator(name).iter_errors(document)]


def tiers_problems(document: Any) -> list[str]:
    """tiers.yaml's schema, plus: a tier sets only keys `defaults` names."""
    found = problems("tiers", document)
    known = set(document.get("defaults", {}))
    for tier, values in document.get("tiers", {}).items():
        found += [f"tiers/{tier}/{key}: not a key of defaults" for key in set(values) - known]
    return found


@pytest.mark.parametrize("name", ["compat", "tiers"])
def test_the_data_matches_its_schema(name):
    assert (tiers_problems if name == "tiers" else lambda d: problems(name, d))(data(name)) == []


def test_compat_sources_cited_are_listed():
    compat = data("compat")
    cited: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "source" or key.endswith("_source"):
                    cited.update(value if isinstance(value, list) else [value])
                elif key != "sources":
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(compat)
    assert cited - set(compat["sources"]) == set()


@pytest.mark.parametrize("name, change, fragment", [
    ("compat", lambda d: d["cuda_releases"]["13.0"].update(toolkit_driver="580"), "cuda_releases/13.0/toolkit_driver"),
    ("compat", lambda d: d["gpus"][0].update(pci_ids=["1eb8"]), "gpus/0/pci_ids/0"),
    ("compat", lambda d: d["gpus"][0].pop("cc"), "'cc' is a required property"),
    ("compat", lambda d: d["driver_branches"]["580"].update(source="the internet"), "driver_branches/580/source"),
    ("tiers", lambda d: d["defaults"].update(gpu_clock_mode="max"), "'gpu_clock_mode' does not match"),
    ("tiers", lambda d: d["tiers"]["dev"].update(validate_gpu_models=[]), "tiers/dev/validate_gpu_models"),
    ("tiers", lambda d: d["tiers"]["dev"].update(driver_branch="R580"), "tiers/dev/driver_branch"),
    ("tiers", lambda d: d["tiers"]["dev"].update(driver_bogus="x"), "tiers/dev/driver_bogus: not a key of defaults"),
])
def test_the_schemas_catch_a_broken_entry(name, change, fragment):
    document = copy.deepcopy(data(name))
    change(document)
    found = tiers_problems(document) if name == "tiers" else problems(name, document)
    assert any(fragment in p for p in found), found
