"""Reasons not to touch a host's driver, from facts read before the run (gpufleet/plans/driver.py's
first refusals): a module signing key that is not a plain path, Secure Boot
without a MOK and its certificate, DKMS without the running kernel's headers. And the DKMS
drop-in that signs with that MOK."""
from __future__ import annotations

import re
import shlex
from gpufleet.config.settings import Settings
from gpufleet.facts.kernel import DriverStateData

# What DKMS's framework.conf (sourced by bash) may be given as the MOK key: a plain absolute path.
_PLAIN_PATH = re.compile(r"/(?:[A-Za-z0-9_+-][A-Za-z0-9._+-]*/)*[A-Za-z0-9_+-][A-Za-z0-9._+-]*")


def mok_certificate(key: str) -> str:
    """The certificate beside the MOK private key `key`, as each layout names it: Ubuntu's
    shim-signed/update-secureboot-policy key pair is MOK.priv + MOK.der (DER), DKMS's own
    (Debian) mok.key + mok.pub; any other name: the same path ending .pub."""
    stem, dot, ext = key.rpartition(".")
    if not dot or "/" in ext:
        return key + ".pub"
    return stem + (".der" if ext == "priv" else ".pub")


def dkms_signing_conf(key: str) -> str:
    """The DKMS drop-in that signs modules with the MOK private key `key` (certificate: see
    mok_certificate). Only plain paths (see preconditions), and quoted anyway: bash sources it."""
    if not plain_path(key):
        raise ValueError(f"not a plain absolute path: {key!r}")
    return ("# Managed by gpufleet (deploys/driver.py).\n"
            "mok_signing_key=" + shlex.quote(key) + "\n"
            "mok_certificate=" + shlex.quote(mok_certificate(key)) + "\n")


def plain_path(key: str) -> bool:
    """Whether `key` is a path DKMS's shell configuration may be given: absolute, plain, no '..'."""
    return bool(_PLAIN_PATH.fullmatch(key)) and "/../" not in f"{key}/"


def preconditions(settings: Settings, state: DriverStateData, prebuilt: bool, key_present: bool | None,
                  certificate_present: bool | None, headers_offered: bool | None) -> tuple[str, str, str] | None:
    """(key, reason, fix) of the first reason not to touch this host, from facts read before the
    run (`key_present`, `certificate_present`: the MOK's files exist on the host; `headers_offered`:
    the sources offer the running kernel's headers; None: not asked, as not needed).
    `prebuilt`: the kernel modules come prebuilt and signed by the distribution (Ubuntu's
    linux-modules-nvidia-*): Secure Boot loads them without a MOK and DKMS needs no headers."""
    key = settings.driver_module_signing_key
    if key != "none" and not plain_path(key):
        return ("driver_module_signing_key",
                f"{key!r} is not a plain absolute path (DKMS's configuration is a shell file)",
                "set it to none, or to an absolute path of letters, digits and . _ + - without '..'")
    if state.secure_boot == "enabled" and not prebuilt:
        if key == "none":
            return ("driver_module_signing_key",
                    "Secure Boot is enabled and no module signing key is configured: the nvidia module DKMS "
                    "builds would be refused by the kernel",
                    "enroll a MOK (mokutil --import) and set driver_module_signing_key to its private key on "
                    "the host, or disable Secure Boot")
        if not key_present:
            return ("driver_module_signing_key",
                    f"Secure Boot is enabled and the module signing key {key} does not exist on the host",
                    "put the enrolled MOK's private key there, or point driver_module_signing_key at it")
        if not certificate_present:
            return ("driver_module_signing_key",
                    f"Secure Boot is enabled and the certificate of the module signing key, {mok_certificate(key)}, "
                    "does not exist on the host (DKMS signs with the key and embeds that certificate)",
                    f"put the enrolled MOK's certificate at {mok_certificate(key)}")
    if settings.driver_kernel_headers == "require" and not state.kernel_headers and not prebuilt \
            and not headers_offered:
        release = state.kernel_release or "?"
        package = f"linux-headers-{release}"
        return ("driver_kernel_headers",
                f"no kernel headers for the running kernel {release}: /lib/modules/{release}/build is "
                f"missing and the package sources offer no {package}, so DKMS cannot build the nvidia "
                "module",
                "install the headers or boot a kernel that has them (or set "
                "driver_kernel_headers: skip where modules come prebuilt)")
    return None
