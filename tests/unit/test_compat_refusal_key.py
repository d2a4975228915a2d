"""A refusal names the key whose change fixes it (issue 34): when every driver branch was tried
(driver_branch auto) and each refused for the same wish, that wish is the key, with the values
of it that fit; gpufleet-compat's --json gives `allowed` as a list, and a partial GPU name gets
a "did you mean"."""
from __future__ import annotations

import json

import pytest

from gpufleet.apps import compat
from gpufleet.errors import Incompatible
from gpufleet.config.resolver import resolve

pytestmark = pytest.mark.unit


def refusal(gpu: str, os_release: str, **wishes: str) -> Incompatible:
    with pytest.raises(Incompatible) as caught:
        resolve([gpu], wishes, os_release)
    return caught.value


def test_an_old_pytorch_on_blackwell_names_pytorch_version_not_a_branch():
    refused = refusal("NVIDIA B200", "ubuntu-24.04", pytorch_version="2.6")
    assert refused.key == "pytorch_version"
    allowed = refused.allowed.split(", ")
    assert allowed[0] == "none" and "2.7" in allowed and "2.6" not in allowed
    for version in allowed[1:]:  # each value named does fit
        assert resolve(["NVIDIA B200"], {"pytorch_version": version}, "ubuntu-24.04").pytorch.version == version


def test_cuda_13_on_volta_names_cuda_version():
    refused = refusal("Tesla V100-SXM2-32GB", "debian-12", cuda_version="13.0")
    assert refused.key == "cuda_version"
    allowed = refused.allowed.split(", ")
    assert "12.9" in allowed and not [v for v in allowed if v.startswith("13")]


def test_a_gpu_no_branch_supports_still_names_driver_branch():
    """Pinning the only branch that does not support the GPU: the branch is the fix."""
    refused = refusal("NVIDIA B200", "debian-12", driver_branch="535")
    assert refused.key == "driver_branch"


def test_compat_json_names_the_key_with_allowed_as_a_list(capsys):
    code = compat.main(["--gpu", "NVIDIA B200", "--pytorch", "2.6", "--os", "ubuntu-24.04", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == compat.REFUSED
    assert out["refused_key"] == "pytorch_version"
    assert isinstance(out["allowed"], list) and out["allowed"][0] == "none" and "2.7" in out["allowed"]


def test_a_partial_gpu_name_gets_did_you_mean(capsys):
    with pytest.raises(SystemExit) as stop:
        compat.main(["--gpu", "H100", "--os", "debian-12"])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert "did you mean 'NVIDIA H100" in err
