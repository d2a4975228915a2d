"""What the driver deploy installs, as the resolver decides it: package names, exact versions,
version locks, Fabric Manager, DCGM; and the refusals the deploy turns into planning-time stops."""
from __future__ import annotations

import pytest

from gpufleet.catalog.compat import compat_data
from gpufleet.errors import Incompatible
from gpufleet.config.resolver import resolve

DEBIAN12, DEBIAN13, UBUNTU = "debian-12", "debian-13", "ubuntu-24.04"
T4, H100, B200, NVSWITCH, V100 = "0x1eb8", "0x2330", "0x2901", "0x22a3", "Tesla V100-PCIE-32GB"


def wish(**overrides) -> dict:
    return {"driver_source": "nvidia", "driver_branch": "580", "driver_version": "auto", "driver_flavour": "auto",
            "cuda_version": "none", "cuda_driver_compat": "toolkit", "cudnn_version": "none",
            "clock_policy": "default", "driver_dcgm": False, **overrides}


def test_r580_fabric_manager_is_the_unversioned_package_at_the_driver_version():
    r = resolve([H100] * 8 + [NVSWITCH] * 4, wish(driver_version="580.95.05"), DEBIAN12)
    assert r.fabricmanager_package == "nvidia-fabricmanager"  # -580 is only a virtual name
    assert r.fabricmanager_version == r.driver_version == "580.95.05"
    assert r.package_versions == {"nvidia-open": "580.95.05", "nvidia-fabricmanager": "580.95.05"}


def test_exact_driver_is_locked_with_nvidia_pinning_package():
    r = resolve([H100], wish(driver_version="580.126.09"), DEBIAN12)
    assert r.pinning_package == "nvidia-driver-pinning-580.126.09"
    assert r.driver_packages == ("nvidia-open",)
    assert "nvidia-driver-pinning" not in " ".join(r.driver_packages)
    assert resolve([H100], wish(driver_flavour="open"), UBUNTU).repo_os_dir == "ubuntu2404"


def test_proprietary_flavour_is_cuda_drivers_and_refused_on_blackwell():
    assert resolve([H100], wish(driver_flavour="proprietary"), DEBIAN12).driver_packages == ("cuda-drivers",)
    with pytest.raises(Incompatible) as info:
        resolve([B200] * 8, wish(driver_flavour="proprietary"), DEBIAN12)
    assert info.value.key == "driver_flavour" and "must use the open kernel modules" in info.value.reason
    assert info.value.allowed == "open, auto"


def test_cuda_too_new_for_the_driver_names_the_key():
    with pytest.raises(Incompatible) as info:
        resolve([H100], wish(driver_version="580.65.06", cuda_version="13.0.2"), DEBIAN12)
    assert info.value.key == "cuda_version" and "needs driver >= 580.95.05" in info.value.reason
    assert "13.0.0" in info.value.allowed  # the GA update is what 580.65.06 drives (S1 Table 3)
    assert resolve([H100], wish(driver_version="580.65.06", cuda_version="13.0"), DEBIAN12).cuda_release == "13.0.0"


def test_distro_versions_per_package_debian12():
    r = resolve([T4], wish(driver_source="distro", driver_branch="auto"), DEBIAN12)
    assert r.flavour == "proprietary" and r.pinning_package is None and r.repo_os_dir is None
    assert r.package_versions == {"nvidia-driver": "535.309.01", "nvidia-kernel-dkms": "535.309.01",
                                  "nvidia-smi": "535.309.01", "nvidia-persistenced": "535.171.04"}
    assert compat_data().distro_offers[DEBIAN12].components == ("contrib", "non-free", "non-free-firmware")


def test_distro_debian13_is_r550():
    r = resolve([T4], wish(driver_source="distro", driver_branch="auto"), DEBIAN13)
    assert r.driver_version.startswith("550.") and set(r.package_versions.values()) == {r.driver_version}


@pytest.mark.parametrize("release", ["ubuntu-22.04", "ubuntu-24.04"])
def test_ubuntu_distro_is_the_580_server_series_as_ubuntu_drivers_gpgpu_installs_it(release):
    # S35 (packages.ubuntu.com) and S36 (ubuntu-drivers --gpgpu): headless userspace without DKMS,
    # nvidia-utils, the modules prebuilt per kernel or DKMS; all userspace at the archive's version
    r = resolve([T4], wish(driver_source="distro", driver_branch="auto"), release)
    assert (r.source, r.driver_branch, r.driver_version, r.flavour) == ("distro", "580", "580.173.02", "open")
    assert r.driver_packages == ("nvidia-headless-no-dkms-580-server-open", "nvidia-utils-580-server")
    assert dict(r.package_versions) == {p: "580.173.02" for p in r.driver_packages}
    assert r.prebuilt_modules == "linux-modules-nvidia-580-server-open-{kernel}"
    assert r.dkms_modules == "nvidia-dkms-580-server-open" and r.repo_os_dir is None
    v100 = resolve([V100], wish(driver_source="distro", driver_branch="auto"), release)  # pre-Turing: proprietary
    assert v100.driver_packages[0] == "nvidia-headless-no-dkms-580-server"
    assert (v100.prebuilt_modules, v100.dkms_modules) == ("linux-modules-nvidia-580-server-{kernel}", "nvidia-dkms-580-server")
    assert compat_data().distro_offers[release].components == ("restricted",)
    with pytest.raises(Incompatible) as info:  # Ubuntu's own toolkit has no verified row: NVIDIA's repo for that
        resolve([T4], wish(driver_source="distro", driver_branch="auto", cuda_version="12.4"), release)
    assert info.value.key == "cuda_version" and info.value.allowed == "none"


def test_dcgm_follows_the_cuda_major():
    r = resolve([H100], wish(driver_dcgm=True, cuda_version="13.0"), DEBIAN12)
    assert r.dcgm_packages == ("datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda13")
    assert resolve([H100], wish(driver_dcgm=True), DEBIAN12).dcgm_packages[-1] == "datacenter-gpu-manager-4-cuda13"
    with pytest.raises(Incompatible) as info:
        resolve([T4], wish(driver_source="distro", driver_branch="auto", driver_dcgm=True), DEBIAN12)
    assert info.value.key == "driver_dcgm"


def test_keyring_data_for_the_signed_source():
    repo = compat_data().nvidia_repo
    assert repo["keyring_path"] == "/usr/share/keyrings/cuda-archive-keyring.gpg"
    assert len(repo["key_fingerprint"]) == 40 and repo["keyring_package_file"].endswith(".deb")
