"""The manifest: what a host had before an upgrade, enough to put it back with apt.

Written on the host (`/var/lib/gpufleet/manifests/<id>.json` + `<id>.etc.tar.gz`) and copied
to the controller (`<manifest dir>/<host>/<id>.json`, same tarball) before the first package
change. Pure helpers: building the document, choosing what an upgrade changes, and the rollback
commands (reviewed by unit tests; executed by deploys/upgrade.py and deploys/rollback.py).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from gpufleet.facts.packages import COMPONENT_PREFIXES, NSIGHT_GLOBS, TOOLKIT, component_globs
from gpufleet.catalog.cuda_stack import STACK_FAMILIES, is_exact, stack_renames
from gpufleet.versions import upstream_of

if TYPE_CHECKING:
    from gpufleet.facts.gpu import GpuStateData
    from gpufleet.facts.kernel import DriverStateData

HOST_DIR = "/var/lib/gpufleet/manifests"
FORMAT = 1

#: Installed packages recorded (dpkg-query globs): driver, Fabric Manager, pinning, CUDA, cuDNN,
#: NCCL, DCGM, container toolkit, and the keyring that signs the CUDA repository.
PACKAGE_PATTERNS = (
    "nvidia-*", "cuda-*", "libcuda*", "libnvidia-*", "libcudnn*", "libnccl*",
    "datacenter-gpu-manager*", "libxnvctrl*", "xserver-xorg-video-nvidia*", "firmware-nvidia-*",
    "linux-modules-nvidia-*",   # Ubuntu's prebuilt modules: per kernel ABI and per kernel flavour
)

#: /etc (and keyring) files recorded and archived. Shell globs, expanded on the host.
ETC_FILES = (
    "/etc/apt/sources.list", "/etc/apt/sources.list.d/*", "/etc/apt/preferences", "/etc/apt/preferences.d/*",
    "/etc/apt/keyrings/*", "/etc/apt/trusted.gpg.d/*", "/etc/apt/apt.conf.d/*gpufleet*",
    "/usr/share/keyrings/cuda-archive-keyring.gpg", "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg",
    "/etc/modprobe.d/*nvidia*", "/etc/modprobe.d/*nouveau*", "/etc/modules-load.d/*nvidia*",
    "/etc/gpufleet/*", "/etc/nccl.conf", "/etc/profile.d/*gpufleet*", "/etc/environment.d/*gpufleet*",
    "/etc/systemd/system/*gpufleet*", "/etc/systemd/system/nvidia-*.d/*",
    "/etc/docker/daemon.json", "/etc/nvidia-container-runtime/config.toml", "/etc/cdi/*",
)

#: Packages whose version is the driver's: the ones a driver upgrade moves (Fabric Manager too).
DRIVER_PACKAGE = re.compile(
    r"^(nvidia-open|cuda-drivers(-\d+)?|nvidia-driver(-cuda|-libs|-bin)?|nvidia-kernel-(open-)?dkms|"
    r"nvidia-kernel-support|nvidia-kernel-common(-\d+)?|nvidia-smi|nvidia-persistenced|nvidia-fabricmanager(-\d+)?|"
    r"nvidia-modprobe|nvidia-settings|nvidia-xconfig|libcuda1|libnvidia-[a-z0-9-]+|nvidia-vulkan-icd|"
    r"nvidia-egl-icd|nvidia-opencl-icd|nvidia-suspend-common|nvidia-alternative|nvlsm|"
    # Ubuntu's own series (nvidia-graphics-drivers-580-server): nvidia-utils-580-server, ...
    r"nvidia-(?:utils|compute-utils|kernel-common|kernel-source|dkms|headless|headless-no-dkms|driver)"
    r"-\d+(?:-server)?(?:-open)?)$")
PINNING_PACKAGE = re.compile(r"^nvidia-driver-pinning-(\d+\.\d+(\.\d+)?)$")
#: NVIDIA's packages that never follow the driver version although their names look like it
NOT_DRIVER = re.compile(r"^(libnvidia-container.*|nvidia-container-.*|nvidia-driver-pinning.*|libnvidia-nscq.*)$")


def upstream(version: str | None) -> str | None:
    """'580.95.05-1' -> '580.95.05'; '1:4.4.0-1' -> '4.4.0' (None for a package not installed)."""
    return upstream_of(version) if version else None


def driver_packages(installed: Mapping[str, str | None], driver_version: str) -> list[str]:
    """Installed packages that carry the driver version `driver_version` (what an upgrade moves)."""
    return sorted(name for name, ver in installed.items()
                  if ver and DRIVER_PACKAGE.match(name) and not NOT_DRIVER.match(name)
                  and upstream(ver) == driver_version)


def version_pinning_package(installed: Mapping[str, str | None]) -> str | None:
    """The installed per-version pinning package (nvidia-driver-pinning-580.95.05), if any."""
    for name, ver in installed.items():
        if ver and PINNING_PACKAGE.match(name):
            return name
    return None


# Ubuntu's prebuilt, signed modules (linux-restricted-modules): one package per kernel ABI
# (linux-modules-nvidia-580-server-open-6.8.0-90-generic, versioned as that kernel, not as the
# driver) and a metapackage per kernel flavour (...-generic-hwe-22.04) that brings the build for
# each new kernel of that flavour. Their versions never carry the driver's: each moves to the
# build the archive offers, which is built against the archive's driver (the validation after
# the reboot checks that the loaded module is the target).
MODULES_PACKAGE = re.compile(r"^linux-modules-nvidia-\d+(?:-server)?(?:-open)?-(?P<kernel>[a-z0-9.+~-]+)$")
_KERNEL_ABI = re.compile(r"^\d+\.\d+\.\d+-\d+-")


def kernel_metapackages(installed: Mapping[str, str | None]) -> list[str]:
    """linux-<flavour>, linux-image-<flavour>, linux-headers-<flavour> for the flavour of each
    installed prebuilt modules metapackage: the kernels that move with those modules (held with
    them by deploys/driver.py). Asked of the host as exact names (PackageVersions)."""
    flavours = sorted({m["kernel"] for name, ver in installed.items()
                       if ver and (m := MODULES_PACKAGE.match(name)) and not _KERNEL_ABI.match(m["kernel"])})
    return [f"linux{part}-{flavour}" for flavour in flavours for part in ("", "-image", "-headers")]


def toolkit_component_patterns(installed: Mapping[str, str | None]) -> list[str]:
    """dpkg-query globs for the components of each installed cuda-toolkit-X-Y that PACKAGE_PATTERNS
    does not reach: its -X-Y libraries and GPUDirect Storage tools (libcublas-13-0, libnpp-13-0,
    gds-tools-13-0 ...; the cuda-*-X-Y ones are in "cuda-*") and the release-named Nsight packages
    it may reach (nsight-systems-2025.3.2 ...). deploys/driver.py installs and holds them at the
    release's versions, so the manifest records them and rollback puts them back."""
    suffixes = sorted({m.group(1) for name, ver in installed.items() if ver and (m := TOOLKIT.match(name))})
    globs = component_globs(suffixes, [prefix for prefix in COMPONENT_PREFIXES if prefix != "cuda-"])
    return [*globs, *NSIGHT_GLOBS] if globs else []


def prebuilt_plan(installed: Mapping[str, str | None], available: Mapping[str, list[str]]
                  ) -> tuple[dict[str, str], list[str]]:
    """(install {pkg: version}, missing) for Ubuntu's prebuilt modules moving with the driver, in
    the same apt transaction: each installed module package and each kernel flavour metapackage
    of theirs (kernel_metapackages; give them in `installed`) to the newest version the archive
    offers. Kernels and their prebuilt modules move together or not at all: a flavour
    metapackage (modules or kernel) the sources do not offer is `missing` and the rollout refuses
    the host. An older kernel's build the archive no longer offers is left as it is: the
    modules' flavour metapackage brings the build for the newest kernel, the one the reboot boots."""
    metas = set(kernel_metapackages(installed))
    install: dict[str, str] = {}
    missing: list[str] = []
    for name, ver in sorted(installed.items()):
        match = MODULES_PACKAGE.match(name)
        if not ver or not (match or name in metas):
            continue
        offered = available.get(name, [])
        if not offered:
            if not (match and _KERNEL_ABI.match(match["kernel"])):
                missing.append(name)
        elif offered[0] != ver:
            install[name] = offered[0]
    return install, missing


def manifest_id(now: float) -> str:
    import time
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))


def build(*, host: str, ident: str, created: float, reason: str, packages: Mapping[str, str | None],
          holds: Iterable[str], etc_files: Mapping[str, str], driver: Mapping[str, Any],
          gpus: list[dict[str, Any]], disk_snapshot: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "id": ident,
        "host": host,
        "created": created,
        "reason": reason,
        "driver": dict(driver),
        "packages": {k: v for k, v in sorted(packages.items()) if v},
        "holds": sorted(holds),
        "etc_files": dict(sorted(etc_files.items())),
        "etc_tarball": f"{HOST_DIR}/{ident}.etc.tar.gz",
        "gpus": gpus,
        "disk_snapshot": dict(disk_snapshot) if disk_snapshot else None,
    }


def dumps(manifest: Mapping[str, Any]) -> str:
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


# --- rollback -----------------------------------------------------------------------------------


def rollback_installs(manifest: Mapping[str, Any], installed: Mapping[str, str | None]) -> list[str]:
    """`pkg=version` for every recorded driver/CUDA/cuDNN/toolkit package whose installed version
    differs, the recorded pinning package first (it decides which versions apt may pick)."""
    recorded: Mapping[str, str] = manifest["packages"]
    todo = [f"{name}={ver}" for name, ver in sorted(recorded.items()) if installed.get(name) != ver]
    todo.sort(key=lambda item: not PINNING_PACKAGE.match(item.split("=", 1)[0]))
    return todo


def rollback_removals(manifest: Mapping[str, Any], installed: Mapping[str, str | None]) -> list[str]:
    """Driver packages installed since the manifest (e.g. a newer per-version pinning package)."""
    recorded = manifest["packages"]
    return sorted(name for name, ver in installed.items()
                  if ver and name not in recorded
                  and (PINNING_PACKAGE.match(name) or (DRIVER_PACKAGE.match(name) and not NOT_DRIVER.match(name))))


def apt_install_command(specs: list[str], downgrade: bool = False) -> str:
    opts = ["-y", "-q", "-o", "Dpkg::Options::=--force-confold", "-o", "Dpkg::Use-Pty=0"]
    if downgrade:
        opts.append("--allow-downgrades")
    return "DEBIAN_FRONTEND=noninteractive apt-get install " + " ".join(shlex.quote(o) for o in opts + specs)


# --- the upgrade itself: what deploys/upgrade.py checks (its change: gpufleet/rollout/moves.py) ---


def validation_problems(target: str, driver: DriverStateData, gpus: GpuStateData, holds: list[str],
                        manifest: dict[str, Any] | None, stack: dict[str, str] | None = None,
                        stack_installed: dict[str, Any] | None = None, stack_held: bool = False,
                        mig_on: frozenset[str] = frozenset()) -> list[str]:
    """What is wrong with an upgraded host (empty = healthy). `stack`: the CUDA toolkit / cuDNN
    releases it must have; with `stack_held`, the ones the rollout moved (other than in the
    manifest) must be held. `mig_on`: UUIDs of GPUs in MIG mode, whose clocks are not compared
    (not settable in MIG mode; a MIG mode change resets them)."""
    installed = stack_installed or {}
    problems = [f"{p} is {upstream(installed[p])}, not {want}" for p, want in sorted((stack or {}).items())
                if installed.get(p) and not is_exact(installed[p], want)]
    problems += [f"{new} is not installed; {old} still is" for _, old, new in stack_renames(stack or {}, installed).values()]
    if stack_held and manifest:
        moved = [p for p in (stack or {}) if installed.get(p) and manifest.get("packages", {}).get(p) != installed[p]]
        loose = sorted(p for p in moved if p not in holds)
        if loose:
            problems.append(f"not held after the upgrade: {', '.join(loose)}")
    if driver.module_version != target:
        problems.append(f"loaded driver module is {driver.module_version}, not {target}")
    if driver.userspace_version != target:
        problems.append(f"installed driver is {driver.userspace_version}, not {target}")
    if not gpus.ok:
        problems.append(f"nvidia-smi is not healthy: {gpus.status} {gpus.error or ''}".strip())
    elif gpus.driver_version != target:
        problems.append(f"nvidia-smi reports driver {gpus.driver_version}, not {target}")
    if manifest:
        before = manifest.get("gpus", [])
        if gpus.ok and len(gpus.gpus) != len(before):
            problems.append(f"{len(gpus.gpus)} GPU(s) visible, {len(before)} before the upgrade")
        now = {g.uuid: g for g in gpus.gpus}
        for want in before:
            gpu = now.get(want["uuid"])
            if gpu is None:
                continue
            if want.get("persistence") and not gpu.persistence:
                problems.append(f"GPU {want['index']}: persistence mode is off (was on)")
            if want.get("app_clocks") and gpu.app_clocks and list(gpu.app_clocks) != want["app_clocks"] \
                    and gpu.uuid not in mig_on:
                problems.append(f"GPU {want['index']}: application clocks {list(gpu.app_clocks)}, "
                                f"were {want['app_clocks']}")
        lost = sorted(set(manifest.get("holds", [])) - set(holds) - {p for p in manifest.get("holds", [])
                                                                       if PINNING_PACKAGE.match(p)}
                      # a CUDA toolkit / cuDNN package the rollout replaced by its new name
                      - {p for p in manifest.get("holds", []) if _stack_family(p) and stack_installed is not None
                         and not installed.get(p)})
        if lost:
            problems.append(f"holds missing after the upgrade: {', '.join(lost)}")
    return problems


def stack_moves(installed: dict[str, Any], wanted: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """{package: (installed release, resolved release)} of the installed CUDA toolkit / cuDNN
    packages that are not at their resolved release (an inventory change, or a hand change: the
    rollout moves both). Packages not installed are left to deploys/all.py."""
    return {p: (upstream(installed[p]), want) for p, want in sorted(wanted.items())
            if installed.get(p) and not is_exact(installed[p], want)}


def _stack_family(package: str) -> bool:
    return any(family.match(package) for _, family in STACK_FAMILIES)


def renamed_packages(installed: dict[str, Any], wanted: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """({new package: release}, [old packages]) where the resolved CUDA toolkit / cuDNN has
    another package name than the installed one (CUDA 13.0 -> 13.1, cuDNN for CUDA 12 -> 13):
    the rollout installs the new ones and removes the old ones in one apt transaction."""
    renames = stack_renames(wanted, installed)
    new = {p: v for what, family in STACK_FAMILIES if what in renames for p, v in wanted.items() if family.match(p)}
    return new, sorted(p for old, _, _ in renames.values() for p in old)


def stack_changes(installed: dict[str, Any], wanted: dict[str, str]) -> list[str]:
    """What the rollout changes of the CUDA toolkit / cuDNN, one line each (plan, manifest reason)."""
    return ([f"{p} {have} -> {want}" for p, (have, want) in stack_moves(installed, wanted).items()]
            + [f"{old} -> {new} (replaces {', '.join(gone)})"
               for gone, old, new in stack_renames(wanted, installed).values()])


def purpose(survey: dict[str, Any], target: str) -> str:
    """What the rollout takes a surveyed host out of service for, in the words of its Slurm drain
    reason and reboot message: the driver upgrade, else the CUDA toolkit / cuDNN move, else the
    reboot that loads the nvidia module with the tier's tuning_profiling, else the MIG layout
    (nothing else changes)."""
    if survey.get("installed") != target or survey.get("loaded") != target or not survey:
        return f"driver upgrade to {target}"
    if survey.get("stack_moves"):
        return f"CUDA toolkit / cuDNN move (driver {target} stays)"
    if survey.get("profiling_pending"):
        return f"reboot for tuning_profiling (driver {target} and packages stay)"
    if survey.get("mig_changes"):
        return "MIG change (gpu_mig)"
    return f"driver upgrade to {target}"


class ManifestError(ValueError):
    """A manifest gpufleet did not write as it stands: refused before anything is restored."""


_ID = re.compile(r"\d{8}T\d{6}Z")
_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]*(:[a-z0-9-]+)?")
_VERSION = re.compile(r"[A-Za-z0-9.+~:-]{1,128}")
_ETC_PATH = re.compile(r"(/[A-Za-z0-9_+@-][A-Za-z0-9_.+@-]*)+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_REQUIRED: dict[str, type | tuple[type, ...]] = {"format": int, "id": str, "host": str, "created": (int, float), "reason": str, "driver": dict,
             "packages": dict, "holds": list, "etc_files": dict, "etc_tarball": str}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {"gpus": list, "disk_snapshot": (dict, type(None))}


def is_manifest_tarball(path: Any) -> bool:
    """Whether `path` is an /etc archive gpufleet writes on a host: HOST_DIR/<id>.etc.tar.gz."""
    return isinstance(path, str) and path.startswith(HOST_DIR + "/") and path.endswith(".etc.tar.gz") \
        and _ID.fullmatch(path[len(HOST_DIR) + 1:-len(".etc.tar.gz")]) is not None


def manifest_problems(doc: Any, host: str | None = None) -> list[str]:
    """What is wrong with a manifest, as gpufleet's snapshot step writes one (mf.build), before a
    rollback acts on it as root: its keys and their types; `etc_tarball` the archive gpufleet
    wrote next to it in the host's manifest folder (HOST_DIR/<id>.etc.tar.gz), nothing else;
    recorded /etc paths absolute, without `.` or `..`, and among ETC_FILES; package names,
    versions and holds as dpkg spells them. Empty: a manifest gpufleet may use."""
    from fnmatch import fnmatchcase

    if not isinstance(doc, dict):
        return ["not a JSON object"]
    problems = [f"unknown key {key!r}" for key in sorted(set(doc) - set(_REQUIRED) - set(_OPTIONAL))]
    problems += [f"missing key {key!r}" for key in sorted(set(_REQUIRED) - set(doc))]
    for key, kind in {**_REQUIRED, **_OPTIONAL}.items():
        if key in doc and (not isinstance(doc[key], kind) or isinstance(doc[key], bool)):
            problems.append(f"{key} is not {getattr(kind, '__name__', 'of the right type')}")
    if problems:
        return problems
    if doc["format"] != FORMAT:
        problems.append(f"format {doc['format']} (this gpufleet reads {FORMAT})")
    if not _ID.fullmatch(doc["id"]):
        problems.append(f"id {doc['id']!r} is not a manifest id (YYYYMMDDTHHMMSSZ)")
    elif doc["etc_tarball"] != f"{HOST_DIR}/{doc['id']}.etc.tar.gz":
        problems.append(f"etc_tarball {doc['etc_tarball']!r} is not the archive gpufleet wrote for it "
                        f"({HOST_DIR}/{doc['id']}.etc.tar.gz)")
    if host is not None and doc["host"] != host:
        problems.append(f"host {doc['host']!r} is not {host!r}")
    for name, version in doc["packages"].items():
        if not isinstance(name, str) or not _PACKAGE.fullmatch(name) or not isinstance(version, str) \
                or not _VERSION.fullmatch(version):
            problems.append(f"package {name!r}={version!r} is not a dpkg package and version")
    for name in doc["holds"]:
        if not isinstance(name, str) or not _PACKAGE.fullmatch(name):
            problems.append(f"hold {name!r} is not a dpkg package name")
    for path, sha in doc["etc_files"].items():
        parts = path.split("/") if isinstance(path, str) else []
        if not isinstance(path, str) or not _ETC_PATH.fullmatch(path) or any(p in (".", "..") for p in parts) \
                or not any(fnmatchcase(path, pattern) for pattern in ETC_FILES):
            problems.append(f"etc_files path {path!r} is not one gpufleet records (absolute, among {', '.join(ETC_FILES[:3])}...)")
        elif not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            problems.append(f"etc_files {path}: {sha!r} is not a sha256")
    driver = doc["driver"]
    if set(driver) - {"loaded", "installed", "flavour"} or not all(v is None or isinstance(v, str) for v in driver.values()):
        problems.append("driver is not {loaded, installed, flavour} (strings)")
    elif isinstance(driver.get("installed"), str) and not _VERSION.fullmatch(driver["installed"]):
        problems.append(f"driver installed {driver.get('installed')!r} is not a version")
    disk = doc.get("disk_snapshot")
    if disk is not None and not all(isinstance(k, str) and (v is None or isinstance(v, (str, int, float)))
                                    for k, v in disk.items()):
        problems.append("disk_snapshot is not a record of names and values")
    if not all(isinstance(g, dict) for g in doc.get("gpus") or []):
        problems.append("gpus is not a list of records")
    return problems


def check_manifest(doc: Any, source: str, host: str | None = None) -> dict[str, Any]:
    """`doc`, or ManifestError naming `source` and every problem."""
    problems = manifest_problems(doc, host)
    if problems:
        raise ManifestError(f"{source}: not a manifest gpufleet wrote, refused (nothing restored): "
                            + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else ""))
    checked: dict[str, Any] = doc
    return checked


def load_manifest(path: str | Path, host: str | None = None) -> dict[str, Any]:
    """A manifest file on the controller, checked: ours (gpufleet.controller.controller_files.read: not a symbolic
    link, not another user's, not writable by others, in folders of ours) and well formed
    (manifest_problems). ManifestError otherwise."""
    from gpufleet.controller import controller_files

    try:
        data = controller_files.read(path)
    except controller_files.UnsafePath as exc:
        raise ManifestError(str(exc)) from None
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    return check_manifest(doc, str(path), host)


def gpu_record(state: Any) -> list[dict[str, Any]]:
    """The GPUs of a GpuState as the manifest records them (persistence and clocks to restore)."""
    return [{"index": g.index, "uuid": g.uuid, "name": g.name, "persistence": g.persistence,
             "app_clocks": list(g.app_clocks) if g.app_clocks else None} for g in state.gpus]
