"""arm64 hosts (Grace: GH200, GB200) get NVIDIA's `sbsa` CUDA repository, x86_64 hosts its
`x86_64` one; an architecture the repository has no directory for is refused at planning
(issue 34 item 7). The deploys' real operations on simulated Ubuntu hosts (testing/ubuntu_host.py)."""
from __future__ import annotations

import pytest

from gpufleet.plans.repos import cuda_repo_arch, cuda_repo_base, unsupported_arch
from tests.unit.test_ubuntu_dry import dry_run

pytestmark = pytest.mark.unit
REPOS = "https://developer.download.nvidia.com/compute/cuda/repos"


@pytest.mark.parametrize("machine, folder", [("x86_64", "x86_64"), ("amd64", "x86_64"), ("aarch64", "sbsa"),
                                             ("arm64", "sbsa"), ("ppc64le", None), ("armv7l", None)])
def test_the_repository_folder_of_each_architecture(machine, folder):
    assert cuda_repo_arch(machine) == folder
    if folder:
        assert cuda_repo_base(REPOS + "/", "ubuntu2404", machine) == f"{REPOS}/ubuntu2404/{folder}"
        assert unsupported_arch(machine) is None
    else:
        with pytest.raises(ValueError):
            cuda_repo_base(REPOS, "ubuntu2404", machine)
        assert unsupported_arch(machine)[0] == "driver_source"


def test_an_aarch64_host_gets_the_sbsa_repository_its_key_and_arm64_docker():
    text = dry_run("hgx", "24.04", machine="aarch64")
    base = f"{REPOS}/ubuntu2404/sbsa"
    assert f"{base}/cuda-keyring_1.1-1_all.deb /usr/share/keyrings/cuda-archive-keyring.gpg" in text
    assert f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {base}/ /\n" in text
    assert "/x86_64" not in text
    assert "deb [arch=arm64 signed-by=/etc/apt/keyrings/gpufleet-docker.gpg]" in text
    assert "libnvidia-container/stable/deb/$(ARCH) /" in text  # apt picks the toolkit's arm64 packages


def test_an_x86_64_host_keeps_the_x86_64_repository():
    text = dry_run("hgx", "24.04")
    assert f"{REPOS}/ubuntu2404/x86_64/ /\n" in text and "/sbsa" not in text


def test_an_architecture_without_a_repository_folder_is_refused_before_any_change(caplog):
    from pyinfra.api.exceptions import PyinfraError

    with pytest.raises(PyinfraError, match="No hosts remaining"):  # the only host was refused
        dry_run("hgx", "24.04", machine="ppc64le")
    assert ("[hgx-24.04] refused (driver_source): NVIDIA's CUDA repository has no directory for ppc64le hosts"
            in caplog.text)
