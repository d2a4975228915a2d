"""Unit tests for facts.kernel on real recorded /proc output and hand-written samples."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.facts.kernel import (
    DriverState,
    parse_driver_state,
    parse_proc_gpus,
    parse_proc_version,
    upstream_version,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"


def lines(*parts: str) -> list[str]:
    return FIXTURES.joinpath(*parts).read_text().splitlines()


def driver_output(
    proc_version=(),
    proc_gpus=(),
    modules=(),
    packages=(),
    libs=(),
    kernel=("release=6.8.0-60-generic", "headers=yes"),
    reboot_pkgs=(),
    secure_boot=("efi=no",),
) -> list[str]:
    """Output in the layout DRIVER_STATE_COMMAND prints."""
    out = []
    for name, part in [
        ("proc-version", proc_version),
        ("proc-gpus", proc_gpus),
        ("modules", modules),
        ("packages", packages),
        ("nvml-libs", libs),
        ("kernel", kernel),
        ("reboot-pkgs", reboot_pkgs),
        ("secure-boot", secure_boot),
    ]:
        out += [f"::gpufleet:: begin {name}", *part]
    return out


@pytest.mark.parametrize("host", ["h200-x1", "h200-x2"])
def test_proc_version_recorded_open_module(host):
    assert parse_proc_version(lines(host, "proc-version.txt")) == ("580.159.04", "open")


def test_proc_version_proprietary_module():
    assert parse_proc_version(lines("samples", "proc-version-proprietary.txt")) == (
        "535.247.01",
        "proprietary",
    )


def test_proc_version_absent_and_malformed():
    assert parse_proc_version([]) == (None, None)
    with pytest.raises(ValueError, match="unrecognised NVRM version line"):
        parse_proc_version(["NVRM version: something else entirely"])
    with pytest.raises(ValueError, match="no 'NVRM version:' line"):
        parse_proc_version(["garbage"])


def test_proc_gpus_recorded_h200_x2():
    gpus = parse_proc_gpus(lines("h200-x2", "proc-gpus.txt"))
    assert [gpu.bus_location for gpu in gpus] == ["0000:00:06.0", "0000:00:07.0"]
    assert [gpu.device_minor for gpu in gpus] == [0, 1]
    assert gpus[1].uuid == "GPU-01a2546d-e3a6-eb7c-7d1e-f99be35fe827"
    assert all(gpu.model == "NVIDIA H200" for gpu in gpus)
    assert all(gpu.excluded is False for gpu in gpus)
    assert all(gpu.firmware == "580.159.04" for gpu in gpus)
    assert gpus[0].video_bios == "96.00.a5.00.1a"


def test_proc_gpus_recorded_h200_x1():
    (gpu,) = parse_proc_gpus(lines("h200-x1", "proc-gpus.txt"))
    assert gpu.uuid == "GPU-fe9201e0-3cd1-adde-0e21-6fe16b45d6f5"


def test_proc_gpus_malformed():
    with pytest.raises(ValueError, match="before any '== PATH' header"):
        parse_proc_gpus(["Model: NVIDIA H200"])


@pytest.mark.parametrize(
    "version, upstream",
    [("580.95.05-0ubuntu1", "580.95.05"), ("535.247.01-1~deb12u1", "535.247.01"), ("1:580.82-1", "580.82"), ("abc", None)],
)
def test_upstream_version(version, upstream):
    assert upstream_version(version) == upstream


def test_driver_state_recorded_h200_module_ubuntu_packages():
    state = DriverState().process(
        driver_output(
            proc_version=lines("h200-x2", "proc-version.txt"),
            proc_gpus=lines("h200-x2", "proc-gpus.txt"),
            modules=["nvidia 580.159.04", "nvidia_uvm 580.159.04", "nvidia_modeset 580.159.04"],
            packages=[
                "libnvidia-compute-580 580.159.04-0ubuntu1 ii ",
                "nvidia-utils-580 580.159.04-0ubuntu1 ii ",
                "nvidia-driver-assistant 0.22.65.06-1 ii ",
                "nvidia-kernel-common-580 580.159.04-0ubuntu1 ii ",
                "nvidia-driver-535  un ",
            ],
            libs=["libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"],
        )
    )
    assert state.module_version == "580.159.04"
    assert state.module_flavour == "open"
    assert state.module_loaded and not state.nouveau_loaded
    assert state.userspace_version == "580.159.04"
    assert state.userspace_source == "dpkg:libnvidia-compute-580"
    assert "nvidia-driver-535" not in state.packages  # 'un': not installed
    assert state.nvml_libraries == ["libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"]
    assert state.mismatch is False
    assert state.reboot_required is False and state.reboot_pending is False
    assert state.kernel_release == "6.8.0-60-generic" and state.kernel_headers is True
    assert state.secure_boot == "not-efi"
    assert [gpu.bus_location for gpu in state.kernel_gpus] == ["0000:00:06.0", "0000:00:07.0"]


def test_driver_state_mismatch_after_upgrade_means_reboot_pending():
    state = parse_driver_state(
        driver_output(
            proc_version=lines("samples", "proc-version-proprietary.txt"),
            modules=["nvidia 535.247.01"],
            packages=["libnvidia-ml1 580.95.05-1 ii ", "nvidia-driver 580.95.05-1 hi "],
            kernel=["release=6.1.0-37-amd64", "headers=no", "reboot_required=yes"],
            reboot_pkgs=["linux-image-6.1.0-38-amd64", "nvidia-kernel-dkms"],
            secure_boot=["efi=yes", "mokutil=SecureBoot enabled "],
        )
    )
    assert (state.module_version, state.module_flavour) == ("535.247.01", "proprietary")
    assert state.userspace_version == "580.95.05"
    assert state.userspace_source == "dpkg:libnvidia-ml1"
    assert state.packages["nvidia-driver"].held is True
    assert state.mismatch is True
    assert state.reboot_required is True and state.reboot_pending is True
    assert state.reboot_required_packages == ["linux-image-6.1.0-38-amd64", "nvidia-kernel-dkms"]
    assert state.kernel_headers is False
    assert state.secure_boot == "enabled"


def test_driver_state_side_by_side_branches_pick_newest():
    state = parse_driver_state(
        driver_output(
            packages=["libnvidia-compute-570 570.172.08-0ubuntu1 ii ", "libnvidia-compute-580 580.95.05-0ubuntu1 ii "]
        )
    )
    assert state.userspace_version == "580.95.05"
    # No module loaded: nothing to mismatch with, nothing loaded.
    assert state.module_version is None and not state.module_loaded and state.mismatch is False


def test_driver_state_without_packages_uses_the_nvml_library_file():
    # e.g. a runfile or Nix-built driver (the recorded hosts' module was built by nixbld).
    state = parse_driver_state(
        driver_output(
            proc_version=lines("h200-x1", "proc-version.txt"),
            libs=["libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"],
        )
    )
    assert state.userspace_version == "580.159.04"
    assert state.userspace_source == "file:libnvidia-ml.so.580.159.04"
    assert state.mismatch is False


def test_driver_state_nouveau_loaded():
    state = parse_driver_state(driver_output(modules=["nouveau "]))
    assert state.nouveau_loaded and not state.module_loaded
    assert state.loaded_modules == {"nouveau": None}


@pytest.mark.parametrize(
    "secure_boot, expected",
    [
        (["efi=no"], "not-efi"),
        (["efi=no", "mokutil=EFI variables are not supported on this system "], "not-efi"),
        (["efi=yes", "mokutil=SecureBoot disabled Platform is in Setup Mode "], "disabled"),
        (["efi=yes", "efivar=   6   0   0   0   1 "], "enabled"),
        (["efi=yes", "efivar=   6   0   0   0   0 "], "disabled"),
        (["efi=yes", "mokutil=This system doesn't support Secure Boot "], "disabled"),
        (["efi=yes"], "unknown"),
    ],
)
def test_secure_boot(secure_boot, expected):
    assert parse_driver_state(driver_output(secure_boot=secure_boot)).secure_boot == expected


def test_driver_state_malformed():
    with pytest.raises(ValueError, match="lacks the secure-boot section"):
        parse_driver_state(driver_output()[:-2])
    with pytest.raises(ValueError, match="unexpected kernel module name"):
        parse_driver_state(driver_output(modules=["ext4"]))
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_driver_state(driver_output(kernel=["6.8.0-60-generic"]))
    with pytest.raises(ValueError, match="unexpected output before the first"):
        parse_driver_state(["oops", *driver_output()])


def test_driver_state_lists_installed_kernels_and_their_nvidia_module():
    # Recorded on a Debian 12 test host (stand-in driver: DKMS builds nothing) after
    # `apt-get install linux-image-cloud-amd64`, the way unattended upgrades bring a kernel.
    state = DriverState().process(lines("samples", "driver-state-kernel-installed-later.txt"))
    assert state.kernel_release == "6.18.44-fc-v1045" and not state.kernel_headers
    assert state.installed_kernels == {"6.1.0-57-cloud-amd64": False}
    built = driver_output(kernel=("release=6.1.0-27-amd64", "headers=yes"))
    built[built.index("::gpufleet:: begin reboot-pkgs"):0] = ["::gpufleet:: begin kernels", "6.1.0-27-amd64 nvidia",
                                                               "6.1.0-28-amd64 none"]
    state = DriverState().process(built)
    assert state.installed_kernels == {"6.1.0-27-amd64": True, "6.1.0-28-amd64": False}
    assert DriverState().process(driver_output()).installed_kernels == {}  # an older recording: none known
