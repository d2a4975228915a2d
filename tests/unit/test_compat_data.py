"""compat.yaml is well-formed, keeps its sources, and carries the facts the resolver relies on."""

from __future__ import annotations

import re
from importlib import resources

import pytest
import yaml

from gpufleet.catalog.compat import compat_data
from gpufleet.facts.gpu import ClockPair
from gpufleet.catalog.gpus import catalog, is_nvswitch_pci, model_for_name, model_for_pci, normalise_pci_id

pytestmark = pytest.mark.unit

STATUSES = {"verified", "secondary", "derived", "maintainer", "unverified"}


def _raw(name: str) -> dict:
    return yaml.safe_load(resources.files("gpufleet").joinpath(f"data/{name}").read_text())


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def test_versioned():
    raw = _raw("compat.yaml")
    assert raw["schema_version"] == 1
    assert re.fullmatch(r"\d{4}\.\d{2}\.\d+", raw["data_version"])
    assert compat_data().data_version == raw["data_version"]


def test_every_status_is_known():
    for path, node in _walk(_raw("compat.yaml")):
        for key in ("status", "min_driver_status", "fabricmanager_status", "nvlsm_status", "cudnn_package_status"):
            if key in node:
                assert node[key] in STATUSES, f"{path}.{key}"


def test_source_tags_exist_and_come_from_the_reference():
    raw = _raw("compat.yaml")
    reference = yaml.safe_load(resources.files("gpufleet").joinpath("data/reference/compat-data.yaml").read_text())
    known = set(raw["sources"])
    added_here = {"S32", "S33", "S34", "S35", "S36", "S37", "S38", "S39", "S40", "S41", "S43", "S44", "PT1", "PT2", "PT3", "PT4", "PT5"}  # PT*: PyTorch wheel data, read for gpufleet (compat.yaml pytorch)
    assert known - added_here <= set(reference["sources"])
    for path, node in _walk(raw):
        tags = node.get("source") if isinstance(node, dict) else None
        for tag in [tags] if isinstance(tags, str) else tags or []:
            assert tag in known, f"{path}: unknown source {tag}"


def test_versions_are_strings():
    raw = _raw("compat.yaml")
    for cuda, row in raw["cuda_releases"].items():
        assert isinstance(cuda, str) and isinstance(row["toolkit_driver"], str)
    for row in raw["cudnn_releases"]:
        assert isinstance(row["version"], str)
        assert all(isinstance(v, str) for v in row["cuda_versions"] + row["compute_capabilities"])


def test_representative_driver_versions():
    branches = compat_data().driver_branches
    for version in ("535.247.01", "550.163.01", "570.195.03", "580.95.05", "580.159.04", "595.45.04"):
        assert version in branches[version.split(".")[0]].versions
    # which are taken from sources and which are maintainer-supplied is recorded
    assert branches["580"].versions["580.95.05"] == "verified"
    assert branches["595"].versions["595.45.04"] == "verified"
    assert branches["570"].versions["570.195.03"] == "maintainer"


def test_unverified_branches_are_not_usable():
    data = compat_data()
    for branch in ("545", "555", "615", "620"):
        assert not data.driver_branches[branch].usable
    assert "580" in data.usable_branches


def test_pci_ids_lowercase_hex_and_unique():
    seen = set()
    for model in catalog():
        for pci in model.pci_ids:
            assert re.fullmatch(r"0x[0-9a-f]{4}", pci), pci
            assert pci not in seen, pci
            seen.add(pci)


@pytest.mark.parametrize(
    "pci, name, default, maximum",
    [
        ("0x2335", "NVIDIA H200", ClockPair(3201, 1980), ClockPair(3201, 1980)),
        ("0x2330", "NVIDIA H100 80GB HBM3", ClockPair(2619, 1980), ClockPair(2619, 1980)),
        ("0x20b0", "NVIDIA A100-SXM4-40GB", ClockPair(1215, 1095), ClockPair(1215, 1410)),
        ("0x1eb8", "Tesla T4", None, ClockPair(5001, 1590)),
        ("0x1db1", "Tesla V100-SXM2-16GB", ClockPair(877, 1312), ClockPair(877, 1530)),
    ],
)
def test_gpu_catalog_clocks(pci, name, default, maximum):
    model = model_for_pci(pci)
    assert model is not None and model.name == name
    assert model.default_clocks == default
    assert model.max_clocks == maximum


def test_h100_supported_memory_clocks():
    assert model_for_name("NVIDIA H100 80GB HBM3").supported_memory_mhz == (2619, 1593)


def test_unverified_clocks_are_dropped():
    # the reference only has a hint (1593) for the A100 80GB memory clock
    assert model_for_name("NVIDIA A100-SXM4-80GB").max_clocks is None


def test_pci_lookup_forms():
    assert normalise_pci_id("2335") == normalise_pci_id("0X2335") == normalise_pci_id(0x2335) == "0x2335"
    assert model_for_pci("0x9999") is None
    assert model_for_pci("not-hex") is None
    assert model_for_name("nvidia h200").name == "NVIDIA H200"
    assert model_for_name("H100 SXM5").name == "NVIDIA H100 80GB HBM3"


def test_nvswitch_ids():
    assert is_nvswitch_pci("0x1af1") and is_nvswitch_pci("22a3")
    assert not is_nvswitch_pci("0x2335")
    assert compat_data().nvswitch_pci_ids["0x22a3"].startswith("GH100")


def test_architectures_and_compute_capabilities():
    assert model_for_name("NVIDIA B200").arch == "blackwell"
    assert model_for_name("NVIDIA B200").open_required
    assert model_for_name("NVIDIA GH200 120GB").open_required  # Grace platform
    assert model_for_name("Tesla T4").compute_capability == "7.5"
    assert not model_for_name("NVIDIA H200").open_required
