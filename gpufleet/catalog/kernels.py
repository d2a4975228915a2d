"""Kernel flavours: which headers metapackage follows the running kernel (pure, unit-tested).

DKMS builds the NVIDIA module for a kernel only when that kernel's headers are installed. The
headers of the *running* kernel (linux-headers-<release>) cover today; kernels that unattended
upgrades install later arrive through the image metapackage (Debian: linux-image-amd64,
linux-image-cloud-amd64, linux-image-rt-amd64; Ubuntu: linux-image-generic, -aws, ...), and
come with headers only where the matching headers metapackage (linux-headers-<flavour>) is
installed too: without it the next boot has no nvidia module.

The flavour is read from the release string (`uname -r`):

    6.1.0-27-amd64            -> amd64          (Debian 12)
    6.1.0-27-cloud-amd64      -> cloud-amd64
    6.12.48+deb13-rt-amd64    -> rt-amd64       (Debian 13)
    6.12.12+bpo-amd64         -> amd64          (backports)
    6.8.0-45-generic          -> generic        (Ubuntu)
    6.8.0-1015-aws            -> aws
    6.18.44-fc-v1045          -> None           (a custom kernel: no metapackage to follow)
"""
from __future__ import annotations

import re

# Debian's kernel flavours (the last part of the release), per architecture, and the prefixes
# of its featureset variants.
DEBIAN_ARCH_FLAVOURS = ("amd64", "arm64", "686", "686-pae", "armmp", "armmp-lpae", "marvell", "rpi",
                        "powerpc64le", "s390x", "loong64", "riscv64", "4kc-malta", "5kc-malta",
                        "mips32r2el", "mips64r2el", "octeon")
DEBIAN_VARIANTS = ("cloud", "rt")
# Ubuntu's kernel flavours (linux-image-<flavour> metapackages exist for these).
UBUNTU_FLAVOURS = ("generic", "generic-64k", "lowlatency", "aws", "azure", "gcp", "gke", "oracle",
                   "nvidia", "nvidia-64k", "ibm", "kvm", "raspi")

_DEBIAN = re.compile(
    r"^\d+\.\d+(?:\.\d+)?(?:-\d+|\+deb\d+|\+bpo)"
    rf"-(?P<flavour>(?:(?:{'|'.join(DEBIAN_VARIANTS)})-)?(?:{'|'.join(map(re.escape, DEBIAN_ARCH_FLAVOURS))}))$")
_UBUNTU = re.compile(rf"^\d+\.\d+\.\d+-\d+-(?P<flavour>{'|'.join(map(re.escape, UBUNTU_FLAVOURS))})$")


def kernel_flavour(release: str | None) -> str | None:
    """The flavour of a Debian or Ubuntu kernel release string; None for any other kernel."""
    release = (release or "").strip()
    for pattern in (_DEBIAN, _UBUNTU):
        match = pattern.match(release)
        if match:
            return match["flavour"]
    return None


def headers_metapackage(release: str | None) -> str | None:
    """linux-headers-<flavour> for the kernel `release`, or None (no flavour known)."""
    flavour = kernel_flavour(release)
    return f"linux-headers-{flavour}" if flavour else None


def image_metapackage(release: str | None) -> str | None:
    """linux-image-<flavour>: the metapackage through which that flavour's new kernels arrive."""
    flavour = kernel_flavour(release)
    return f"linux-image-{flavour}" if flavour else None


# Ubuntu's hardware-enablement kernels: same release-string flavour (6.8.0-90-generic on 22.04),
# but they arrive through linux-image-<flavour>-hwe-<release> and have their own headers and
# prebuilt NVIDIA module metapackages (linux-headers-generic-hwe-22.04,
# linux-modules-nvidia-580-server-open-generic-hwe-22.04). Installing the plain -generic ones
# there would pull the GA kernel's (5.15) packages and leave the running kernel without any.
UBUNTU_HWE_FLAVOURS = ("generic", "generic-64k", "lowlatency")


def image_metapackage_candidates(release: str | None, os_name: str) -> list[str]:
    """The image metapackages that can bring kernels of this flavour on `os_name` (Ubuntu: the
    plain one and its -hwe-<version>); asked in one dpkg-query by the driver deploy."""
    flavour = kernel_flavour(release)
    if not flavour:
        return []
    out = [f"linux-image-{flavour}"]
    if os_name.startswith("ubuntu-") and flavour in UBUNTU_HWE_FLAVOURS:
        out.append(f"linux-image-{flavour}-hwe-{os_name.split('-', 1)[1]}")
    return out


def package_flavour(release: str | None, os_name: str, installed: dict[str, str | None]) -> str | None:
    """The flavour the kernel packages follow: that of the installed -hwe image metapackage on
    Ubuntu (as ubuntu-drivers reads it from the installed linux-image-* metapackage), else the
    release string's."""
    flavour = kernel_flavour(release)
    for meta in reversed(image_metapackage_candidates(release, os_name)[1:]):
        if installed.get(meta):
            return meta.removeprefix("linux-image-")
    return flavour


def module_packages(prebuilt: str | None, dkms: str | None, release: str | None, flavour: str | None,
                    abi_build: bool) -> tuple[list[str], bool]:
    """(packages, prebuilt?) for a driver whose modules are packaged apart (Ubuntu), with
    `ubuntu-drivers install --gpgpu` semantics: the prebuilt, signed modules' flavour metapackage
    when a build for the running kernel's ABI exists (`abi_build`), else the DKMS package."""
    if prebuilt and release and flavour and abi_build:
        return [prebuilt.format(kernel=flavour), prebuilt.format(kernel=release)], True
    return ([dkms] if dkms else []), False


def kernel_metapackages(release: str | None, os_name: str) -> list[str]:
    """The Ubuntu metapackages through which kernels of this flavour arrive: linux-<flavour>,
    linux-image-<flavour> and linux-headers-<flavour>, for the plain flavour and its -hwe one.
    With prebuilt NVIDIA modules they are held with the driver: a kernel they brought in would
    boot without a module build unless the modules' flavour metapackage moved with it."""
    return [f"linux{part}-{image.removeprefix('linux-image-')}"
            for image in image_metapackage_candidates(release, os_name) for part in ("", "-image", "-headers")]
