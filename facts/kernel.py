"""
NVIDIA driver and kernel state, from one remote command (``DriverState``):
the loaded kernel module (version and open/proprietary flavour), the installed
user-space driver (dpkg, or the libnvidia-ml.so.VERSION file when the driver
was not installed from packages), whether they mismatch, whether a reboot is
pending, Secure Boot, the running kernel and whether its headers are
installed. Needs no modinfo, lsmod or systemctl.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, begin, fail, key_values, nonblank, opt_str, read_files, split_sections, with_values
from .packages import DpkgEntry, dpkg_query_command, parse_dpkg_query

SecureBootState = Literal["enabled", "disabled", "not-efi", "unknown"]
ModuleFlavour = Literal["open", "proprietary"]

# Packages whose version is the user-space driver version, most telling first:
# the NVML library (what nvidia-smi loads), then utilities and metapackages.
# Debian: libnvidia-ml1, nvidia-driver; Ubuntu and the CUDA repository:
# libnvidia-compute-NNN, nvidia-utils-NNN, nvidia-driver-NNN(-open),
# nvidia-open(-NNN), cuda-drivers(-NNN).
USERSPACE_PACKAGES: tuple[str, ...] = (
    "libnvidia-ml1",
    "libnvidia-compute-*",
    "nvidia-utils-*",
    "nvidia-driver*",
    "nvidia-open*",
    "cuda-drivers*",
)
# Also reported (not used for the version): kernel module packages.
MODULE_PACKAGES: tuple[str, ...] = ("nvidia-kernel-*", "nvidia-dkms-*", "linux-modules-nvidia-*")

KERNEL_MODULES: tuple[str, ...] = (
    "nvidia",
    "nvidia_uvm",
    "nvidia_modeset",
    "nvidia_drm",
    "nvidia_peermem",
    "nouveau",
)

_EFI_SECURE_BOOT_VAR = (
    "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
)
# Where distributions put the versioned NVML library (its name carries the
# user-space driver version: libnvidia-ml.so.580.159.04).
_NVML_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.*",
    "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.*",
    "/usr/lib64/libnvidia-ml.so.*",
    "/usr/lib/libnvidia-ml.so.*",
)


@dataclass(frozen=True)
class KernelGpu(JsonMixin):
    """A GPU as the loaded kernel module sees it (/proc/driver/nvidia/gpus)."""

    bus_location: str  # '0000:00:06.0'
    model: str | None  # 'NVIDIA H200'
    uuid: str | None
    video_bios: str | None
    device_minor: int | None  # N in /dev/nvidiaN
    excluded: bool  # "GPU Excluded: Yes" (NVreg_ExcludedGpus)
    firmware: str | None  # GSP firmware version


@dataclass(frozen=True)
class DriverStateData(JsonMixin):
    module_version: str | None = None  # loaded nvidia.ko, '580.159.04'
    module_flavour: ModuleFlavour | None = None
    # Loaded modules among KERNEL_MODULES, with their version when they report one.
    loaded_modules: dict[str, str | None] = field(default_factory=dict)
    # Installed user-space driver version and where it was read from
    # ('dpkg:libnvidia-compute-580', 'file:libnvidia-ml.so.580.159.04').
    userspace_version: str | None = None
    userspace_source: str | None = None
    packages: dict[str, DpkgEntry] = field(default_factory=dict)  # installed NVIDIA packages
    nvml_libraries: list[str] = field(default_factory=list)
    mismatch: bool = False
    reboot_required: bool = False  # /run/reboot-required exists
    reboot_required_packages: list[str] = field(default_factory=list)
    secure_boot: SecureBootState = "unknown"
    kernel_release: str | None = None  # uname -r
    kernel_headers: bool = False  # /lib/modules/$(uname -r)/build exists
    # Kernels installed in /lib/modules (release -> an nvidia module is there for it: DKMS's
    # updates/dkms, or a prebuilt package's); what the next boot may load.
    installed_kernels: dict[str, bool] = field(default_factory=dict)
    # GPUs the loaded module drives; still readable when nvidia-smi fails.
    kernel_gpus: list[KernelGpu] = field(default_factory=list)

    @property
    def module_loaded(self) -> bool:
        return "nvidia" in self.loaded_modules or self.module_version is not None

    @property
    def nouveau_loaded(self) -> bool:
        return "nouveau" in self.loaded_modules

    @property
    def reboot_pending(self) -> bool:
        """A reboot is due: the OS asked for one, or the loaded module is stale."""
        return self.reboot_required or self.mismatch


_PROC_VERSION = re.compile(
    r"^NVRM version: NVIDIA UNIX (?P<open>Open )?.*?Kernel Module\b.*?\s"
    r"(?P<version>\d+\.\d+(?:\.\d+)?)(?:\s|$)"
)


def parse_proc_version(lines: Sequence[str]) -> tuple[str | None, ModuleFlavour | None]:
    """
    Parse /proc/driver/nvidia/version into (version, flavour); (None, None)
    when the file was absent (module not loaded).

    Open:        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
    Proprietary: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.247.01  Tue ..."
    """
    for line in lines:
        if line.startswith("NVRM version:"):
            match = _PROC_VERSION.match(line)
            if not match:
                raise fail("unrecognised NVRM version line", line)
            flavour: ModuleFlavour = "open" if match.group("open") else "proprietary"
            return match.group("version"), flavour
    if nonblank(lines):
        raise fail("/proc/driver/nvidia/version has no 'NVRM version:' line", lines[0])
    return None, None


def parse_proc_gpus(lines: Sequence[str]) -> list[KernelGpu]:
    """
    Parse "== PATH" headers each followed by the contents of
    /proc/driver/nvidia/gpus/SLOT/information ("Key: <tabs> value" lines).
    """
    blocks: list[dict[str, str]] = []
    for line in lines:
        if not line.strip():
            continue
        if line.startswith("== "):
            blocks.append({})
            continue
        if not blocks:
            raise fail("GPU information before any '== PATH' header", line)
        key, sep, value = line.partition(":")
        if not sep:
            raise fail("expected 'Key: value' in GPU information", line)
        blocks[-1][key.strip()] = value.strip()
    gpus = []
    for block in blocks:
        location = block.get("Bus Location")
        if not location:
            raise fail("GPU information without a Bus Location", repr(block)[:200])
        minor = block.get("Device Minor", "")
        gpus.append(
            KernelGpu(
                bus_location=location.lower(),
                model=block.get("Model") or None,
                uuid=block.get("GPU UUID") or None,
                video_bios=block.get("Video BIOS") or None,
                device_minor=int(minor) if minor.isdigit() else None,
                excluded=block.get("GPU Excluded", "No") == "Yes",
                firmware=opt_str(block.get("GPU Firmware", "")),
            )
        )
    return sorted(gpus, key=lambda gpu: gpu.bus_location)


_UPSTREAM = re.compile(r"^(?:\d+:)?(\d+\.\d+(?:\.\d+)?)")


def upstream_version(debian_version: str) -> str | None:
    """'580.95.05-0ubuntu1' -> '580.95.05'; None when it does not look like one."""
    match = _UPSTREAM.match(debian_version)
    return match.group(1) if match else None


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


# Which installed package names carry the user-space driver version, most telling
# first (the globs above also match e.g. nvidia-driver-assistant, whose version
# is its own).
_USERSPACE_NAMES = (
    re.compile(r"libnvidia-ml1"),
    re.compile(r"libnvidia-compute-\d+(-server)?"),
    re.compile(r"nvidia-utils-\d+(-server)?"),
    re.compile(r"nvidia-driver(-\d+)?(-open|-server|-server-open)?"),
    re.compile(r"nvidia-open(-\d+)?"),
    re.compile(r"cuda-drivers(-\d+)?"),
)


def userspace_from_packages(packages: dict[str, DpkgEntry]) -> tuple[str | None, str | None]:
    """(version, source) from the first kind of user-space package installed."""
    for pattern in _USERSPACE_NAMES:
        candidates = [
            (version, entry.name)
            for entry in packages.values()
            if entry.installed
            and pattern.fullmatch(entry.name)
            and (version := upstream_version(entry.version or ""))
        ]
        if candidates:
            # Two branches installed side by side (an upgrade in progress):
            # the newer one is what the next boot will use.
            version, name = max(candidates, key=lambda item: _version_key(item[0]))
            return version, f"dpkg:{name}"
    return None, None


def _secure_boot(fields: dict[str, str]) -> SecureBootState:
    mokutil = fields.get("mokutil", "")
    if "SecureBoot enabled" in mokutil:
        return "enabled"
    if "SecureBoot disabled" in mokutil:
        return "disabled"
    efivar = fields.get("efivar", "").split()
    if efivar:
        if not efivar[-1].isdigit():
            raise fail("expected bytes of the SecureBoot EFI variable", fields["efivar"])
        return "enabled" if efivar[-1] == "1" else "disabled"
    if fields.get("efi") == "no":
        return "not-efi"
    if fields.get("efi") == "yes" and "doesn't support Secure Boot" in mokutil:
        return "disabled"
    return "unknown"


def parse_driver_state(lines: Sequence[str]) -> DriverStateData:
    """Parse the whole output of DRIVER_STATE_COMMAND (see DriverState)."""
    sections, _ = split_sections(lines)
    if nonblank(sections[""]):
        raise fail("unexpected output before the first DriverState section", sections[""][0])
    for name in ("proc-version", "proc-gpus", "modules", "packages", "nvml-libs", "kernel", "secure-boot"):
        if name not in sections:
            raise fail(f"DriverState output lacks the {name} section")

    module_version, flavour = parse_proc_version(sections["proc-version"])

    loaded: dict[str, str | None] = {}
    for line in nonblank(sections["modules"]):
        name, _, version = line.strip().partition(" ")
        if name not in KERNEL_MODULES:
            raise fail("unexpected kernel module name", line)
        loaded[name] = version.strip() or None
    if module_version is None and loaded.get("nvidia"):
        # /proc/driver/nvidia absent but the module reports its version.
        module_version = loaded["nvidia"]

    packages = {
        name: entry
        for name, entry in parse_dpkg_query(sections["packages"]).items()
        if entry.installed
    }

    libraries = sorted({line.strip() for line in nonblank(sections["nvml-libs"])})
    userspace, source = userspace_from_packages(packages)
    if userspace is None:
        versions = [
            (match.group(1), library)
            for library in libraries
            if (match := re.fullmatch(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)", library))
        ]
        if versions:
            version, library = max(versions, key=lambda item: _version_key(item[0]))
            userspace, source = version, f"file:{library}"

    kernel = key_values(sections["kernel"], "DriverState kernel section")
    secure = key_values(sections["secure-boot"], "DriverState secure-boot section")
    reboot_packages = sorted({line.strip() for line in nonblank(sections.get("reboot-pkgs", []))})
    installed_kernels = {}
    for line in nonblank(sections.get("kernels", [])):
        release, _, has = line.strip().partition(" ")
        installed_kernels[release] = has == "nvidia"

    return DriverStateData(
        module_version=module_version,
        module_flavour=flavour,
        loaded_modules=loaded,
        userspace_version=userspace,
        userspace_source=source,
        packages=packages,
        nvml_libraries=libraries,
        mismatch=bool(module_version and userspace and module_version != userspace),
        reboot_required=kernel.get("reboot_required") == "yes",
        reboot_required_packages=reboot_packages,
        secure_boot=_secure_boot(secure),
        kernel_release=kernel.get("release") or None,
        kernel_headers=kernel.get("headers") == "yes",
        installed_kernels=installed_kernels,
        kernel_gpus=parse_proc_gpus(sections["proc-gpus"]),
    )


DRIVER_STATE_COMMAND = with_values("\n".join(
    [
        begin("proc-version"),
        "cat /proc/driver/nvidia/version 2>/dev/null",
        begin("proc-gpus"),
        "for f in /proc/driver/nvidia/gpus/*/information; do",
        '  if [ -r "$f" ]; then echo "== $f"; cat "$f"; fi',
        "done",
        begin("modules"),
        # /sys/module/NAME exists while NAME is loaded; no lsmod needed.
        "for m in $modules; do",  # names without blanks or glob characters
        '  if [ -d "/sys/module/$m" ]; then ' + read_files("/sys/module/$m", version="v") + 'echo "$m $v"; fi',
        "done",
        begin("packages"),
        dpkg_query_command(USERSPACE_PACKAGES + MODULE_PACKAGES),
        begin("nvml-libs"),
        "for f in $nvml_globs; do",  # split, then expanded: globs without blanks
        '  if [ -e "$f" ]; then echo "${f##*/}"; fi',
        "done",
        begin("kernel"),
        'r=$(uname -r 2>/dev/null); echo "release=$r"',
        'if [ -n "$r" ] && [ -e "/lib/modules/$r/build" ]; then echo headers=yes; else echo headers=no; fi',
        "if [ -e /run/reboot-required ]; then echo reboot_required=yes; fi",
        begin("kernels"),
        # An installed kernel has modules.order (or kernel/); headers alone only make build/.
        "for d in /lib/modules/*/; do",
        '  d=${d%/}; [ -e "$d/modules.order" ] || [ -d "$d/kernel" ] || continue; m=none',
        '  for f in "$d"/updates/dkms/nvidia.ko* "$d"/updates/nvidia.ko* "$d"/extra/nvidia.ko* '
        '"$d"/kernel/nvidia*/nvidia.ko* "$d"/kernel/drivers/video/nvidia.ko*; do [ -e "$f" ] && m=nvidia && break; done',
        '  echo "${d##*/} $m"',
        "done",
        begin("reboot-pkgs"),
        "cat /run/reboot-required.pkgs 2>/dev/null",
        begin("secure-boot"),
        "if [ -d /sys/firmware/efi ]; then echo efi=yes; else echo efi=no; fi",
        "if command -v mokutil >/dev/null 2>&1; then",
        '  echo "mokutil=$(mokutil --sb-state 2>&1 | tr \'\\n\' \' \')"',
        "fi",
        # The variable is 4 attribute bytes then the value byte (1 = enabled).
        'if [ -r "$efi_var" ] && command -v od >/dev/null 2>&1; then',
        '  echo "efivar=$(od -An -tu1 "$efi_var" 2>/dev/null | tr \'\\n\' \' \')"',
        "fi",
        "true",
    ]
), modules=" ".join(KERNEL_MODULES), nvml_globs=" ".join(_NVML_GLOBS), efi_var=_EFI_SECURE_BOOT_VAR)


class DriverState(FactBase[DriverStateData]):
    """
    Returns the NVIDIA driver and kernel state, from one remote command:

    .. code:: python

        DriverStateData(
            module_version="580.159.04", module_flavour="open",
            loaded_modules={"nvidia": "580.159.04", "nvidia_uvm": None, ...},
            userspace_version="580.159.04",
            userspace_source="dpkg:libnvidia-compute-580",
            packages={"libnvidia-compute-580": DpkgEntry(...), ...},
            nvml_libraries=["libnvidia-ml.so.1", "libnvidia-ml.so.580.159.04"],
            mismatch=False, reboot_required=False, reboot_required_packages=[],
            secure_boot="disabled", kernel_release="6.8.0-60-generic",
            kernel_headers=True,
            kernel_gpus=[KernelGpu(bus_location="0000:00:06.0", model="NVIDIA H200",
                                   uuid="GPU-517ec679-...", device_minor=0,
                                   excluded=False, firmware="580.159.04", ...)],
        )
    """

    @override
    @staticmethod
    def default() -> DriverStateData:
        return DriverStateData()

    @override
    def command(self) -> str:
        return DRIVER_STATE_COMMAND

    @override
    def process(self, output: list[str]) -> DriverStateData:
        return parse_driver_state(output)


# --- GPUDirect RDMA: nvidia-peermem --------------------------------------------------------------

#: modules-load.d file gpufleet writes so that systemd-modules-load loads nvidia-peermem at boot
PEERMEM_BOOT_FILE = "/etc/modules-load.d/gpufleet-nvidia-peermem.conf"


@dataclass(frozen=True)
class PeermemStateData(JsonMixin):
    """nvidia-peermem (GPUDirect RDMA between the GPUs and the HCAs): the module built for the
    running kernel, whether it is loaded and its version (the driver's: nvidia-peermem.c sets
    MODULE_VERSION(NV_VERSION_STRING)), and which modules-load.d files load it at boot."""

    available_version: str | None = None  # `modinfo -F version nvidia-peermem`, None: no module for this kernel
    loaded: bool = False  # /sys/module/nvidia_peermem exists
    loaded_version: str | None = None  # /sys/module/nvidia_peermem/version
    boot_files: list[str] = field(default_factory=list)  # /etc/modules-load.d/*.conf naming it


_MODULE_VERSION = re.compile(r"\d+\.\d+(?:\.\d+)?")
_BOOT_LINE = re.compile(r"(/etc/modules-load\.d/[A-Za-z0-9._-]+\.conf):\s*nvidia[-_]peermem\s*")


def parse_peermem_state(lines: Sequence[str]) -> PeermemStateData:
    sections, _ = split_sections(lines)
    for name in ("available", "loaded", "boot"):
        if name not in sections:
            raise fail(f"PeermemState output lacks the {name} section")
    available = [line.strip() for line in nonblank(sections["available"])]
    if len(available) > 1 or (available and not _MODULE_VERSION.fullmatch(available[0])):
        raise fail("expected one version from modinfo", available[-1])
    loaded = key_values(sections["loaded"], "PeermemState loaded section")
    version = loaded.get("version") or None
    if version is not None and not _MODULE_VERSION.fullmatch(version):
        raise fail("unexpected nvidia_peermem version", version)
    boot = []
    for line in nonblank(sections["boot"]):
        match = _BOOT_LINE.fullmatch(line.strip())
        if not match:
            raise fail("expected 'FILE:nvidia-peermem' from modules-load.d", line)
        boot.append(match.group(1))
    return PeermemStateData(available_version=available[0] if available else None,
                            loaded=loaded.get("present") == "yes", loaded_version=version,
                            boot_files=sorted(set(boot)))


PEERMEM_STATE_COMMAND = "\n".join([
    begin("available"),
    "modinfo -F version nvidia-peermem 2>/dev/null | head -n1",
    begin("loaded"),
    "if [ -d /sys/module/nvidia_peermem ]; then echo present=yes; else echo present=no; fi",
    "if [ -r /sys/module/nvidia_peermem/version ]; then echo \"version=$(head -n1 /sys/module/nvidia_peermem/version)\"; fi",
    begin("boot"),
    # only whole lines naming the module, comments aside (systemd-modules-load reads them so)
    "grep -sHxE '[[:space:]]*nvidia[-_]peermem[[:space:]]*' /etc/modules-load.d/*.conf",
    "true",
])


class PeermemState(FactBase[PeermemStateData]):
    """
    Returns nvidia-peermem's state:

    .. code:: python

        PeermemStateData(available_version="580.159.04", loaded=True, loaded_version="580.159.04",
                         boot_files=["/etc/modules-load.d/gpufleet-nvidia-peermem.conf"])
    """

    @override
    @staticmethod
    def default() -> PeermemStateData:
        return PeermemStateData()

    @override
    def command(self) -> str:
        return PEERMEM_STATE_COMMAND

    @override
    def process(self, output: list[str]) -> PeermemStateData:
        return parse_peermem_state(output)


# --- GPU performance counters for users (tuning_profiling) -------------------------------------

#: The loaded module's value of NVreg_RestrictProfilingToAdminUsers, as /proc prints it (recorded
#: on a live H200: tests/fixtures/nvidia/h200-x1/proc-params.txt, "RmProfilingAdminOnly: 0").
PARAMS_FILE = "/proc/driver/nvidia/params"
PROFILING_PARAM = "RmProfilingAdminOnly"
PROFILING_OPTION = "NVreg_RestrictProfilingToAdminUsers"
# Where modprobe reads its configuration (modprobe.d(5)); /lib/modprobe.d is /usr/lib/modprobe.d on
# merged-/usr systems (Debian 12+, Ubuntu 22.04+). Every one is root's: no user can write there.
MODPROBE_DIRS = ("/etc/modprobe.d", "/run/modprobe.d", "/usr/lib/modprobe.d")  # as PROFILING_STATE_COMMAND reads them

PROFILING_STATE_COMMAND = "\n".join([
    begin("params"),
    "if [ -r /proc/driver/nvidia/params ]; then echo present=yes; "
    "grep -m1 '^RmProfilingAdminOnly:' /proc/driver/nvidia/params; else echo present=no; fi",
    begin("options"),
    # every modprobe.d line that sets the option for the nvidia module, with its file
    "grep -sHE '^[[:space:]]*options[[:space:]]+nvidia[[:space:]].*NVreg_RestrictProfilingToAdminUsers=' "
    "/etc/modprobe.d/*.conf /run/modprobe.d/*.conf /usr/lib/modprobe.d/*.conf",
    "true",
])

@dataclass(frozen=True)
class ProfilingStateData(JsonMixin):
    """Who may read the GPU performance counters: the loaded nvidia module's RmProfilingAdminOnly
    (1: admins only, the driver's default; 0: every user) and the modprobe.d files that set
    NVreg_RestrictProfilingToAdminUsers for the next load of the module."""

    loaded: bool = False  # /proc/driver/nvidia/params exists: an nvidia module is loaded
    admin_only: int | None = None  # its RmProfilingAdminOnly
    options: dict[str, int] = field(default_factory=dict)  # modprobe.d file -> the value it sets (its last)


_PARAM_LINE = re.compile(rf"{PROFILING_PARAM}: ([0-9]+)")
_OPTION_FILE = re.compile(r"(/(?:etc|run|usr/lib)/modprobe\.d/[A-Za-z0-9._-]+\.conf):(.*)")
_OPTION_VALUE = re.compile(rf"(?:^|\s){PROFILING_OPTION}=([0-9]+)(?=\s|$)")


def parse_profiling_state(lines: Sequence[str]) -> ProfilingStateData:
    sections, _ = split_sections(lines)
    for name in ("params", "options"):
        if name not in sections:
            raise fail(f"ProfilingState output lacks the {name} section")
    params = nonblank(sections["params"])
    if not params or params[0].strip() not in ("present=yes", "present=no"):
        raise fail("expected present=yes|no first", params[0] if params else "")
    loaded = params[0].strip() == "present=yes"
    admin_only = None
    for line in params[1:]:
        match = _PARAM_LINE.fullmatch(line.strip())
        if not match:
            raise fail(f"unexpected line from {PARAMS_FILE}", line)
        admin_only = int(match.group(1))
    options: dict[str, int] = {}
    for line in nonblank(sections["options"]):
        match = _OPTION_FILE.fullmatch(line.strip())
        if not match:
            raise fail("expected 'FILE:options nvidia ...' from modprobe.d", line)
        values = _OPTION_VALUE.findall(match.group(2).split("#", 1)[0])
        if values:  # a later option line (or word) wins, as the module parses them in order
            options[match.group(1)] = int(values[-1])
    return ProfilingStateData(loaded=loaded, admin_only=admin_only, options=dict(sorted(options.items())))


class ProfilingState(FactBase[ProfilingStateData]):
    """
    Returns who may read the GPU performance counters, now and after the next module load:

    .. code:: python

        ProfilingStateData(loaded=True, admin_only=1,
                           options={"/etc/modprobe.d/gpufleet-nvidia-profiling.conf": 0})
    """

    @override
    @staticmethod
    def default() -> ProfilingStateData:
        return ProfilingStateData()

    @override
    def command(self) -> str:
        return PROFILING_STATE_COMMAND

    @override
    def process(self, output: list[str]) -> ProfilingStateData:
        return parse_profiling_state(output)
