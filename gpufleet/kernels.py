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
