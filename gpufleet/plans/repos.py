"""The apt repository lines gpufleet writes, in one place: the deploys write exactly these, and the
plan view (deploys/plan.py) prints them per host before anything changes. Pure functions.

- NVIDIA's CUDA repository: a flat `signed-by` source under `driver_repo_url`, one directory per
  OS release (compat.yaml nvidia_repo.os_dirs: debian12, debian13, ubuntu2204, ubuntu2404) and
  architecture: `x86_64`, and `sbsa` (Arm servers: Grace in GH200 and GB200) for aarch64 hosts;
  any other architecture is refused at planning (no directory for it);
- Docker's repository: `<docker_repo_url>/<os id> <codename> stable` (debian bookworm/trixie,
  ubuntu jammy/noble), as Docker's install guide writes it;
- NVIDIA's container toolkit repository: one flat source for every Debian/Ubuntu release
  (apt fills in `$(ARCH)`);
- `driver_source: distro`: no repository of its own, the archive components the driver needs.

With a fleet package cache (`packages_cache_url`) every https URL here, keys' included, is the
cache's form of it (apt_url; http ones go through it by apt's proxy setting:
gpufleet/plans/package_cache.py); the keyrings stay the same.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

from gpufleet.plans.package_cache import via_cache

CUDA_SOURCE = "/etc/apt/sources.list.d/gpufleet-cuda.list"
DOCKER_KEYRING = "/etc/apt/keyrings/gpufleet-docker.gpg"
DOCKER_LIST = "/etc/apt/sources.list.d/gpufleet-docker.list"
TOOLKIT_KEYRING = "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
TOOLKIT_LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
# The toolkit's packages, all pinned to docker_toolkit_version (NVIDIA's install guide pins these four).
TOOLKIT_PACKAGES = ("nvidia-container-toolkit", "nvidia-container-toolkit-base",
                    "libnvidia-container-tools", "libnvidia-container1")


def apt_url(settings: Settings, url: str) -> str:
    """`url` (a repository base or a key) as this host's apt fetches it: through the fleet's package
    cache where the inventory names one."""
    return via_cache(url, settings.packages_cache_url)


def dpkg_arch(machine: str) -> str:
    """`uname -m` -> the Debian architecture name Docker's source line wants."""
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


#: `uname -m` (or Debian's name for it) -> the architecture directory of NVIDIA's CUDA repository.
#: Arm servers use NVIDIA's Server Base System Architecture build, `sbsa` (its `arm64` directories
#: are for Jetson boards, not data-centre GPUs).
CUDA_REPO_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "sbsa", "arm64": "sbsa"}


def cuda_repo_arch(machine: str) -> str | None:
    """The CUDA repository's directory for a host's architecture; None where it has none."""
    return CUDA_REPO_ARCHES.get(machine)


def unsupported_arch(machine: str) -> tuple[str, str, str] | None:
    """(key, reason, fix) when NVIDIA's CUDA repository has no directory for `machine`."""
    if cuda_repo_arch(machine) is not None:
        return None
    return ("driver_source", f"NVIDIA's CUDA repository has no directory for {machine} hosts (only x86_64, "
            "and sbsa for aarch64)", "run the driver deploy on x86_64 or aarch64 hosts only")


def cuda_repo_base(repo_url: str, os_dir: str, machine: str) -> str:
    """The CUDA repository directory for one OS release and architecture, e.g.
    .../repos/ubuntu2404/x86_64, .../repos/ubuntu2404/sbsa on aarch64."""
    arch = cuda_repo_arch(machine)
    if arch is None:
        raise ValueError(unsupported_arch(machine))
    return f"{repo_url.rstrip('/')}/{os_dir}/{arch}"


def cuda_sources_line(repo_url: str, os_dir: str, keyring: str, machine: str) -> str:
    return f"deb [signed-by={keyring}] {cuda_repo_base(repo_url, os_dir, machine)}/ /\n"


def docker_sources_line(repo_url: str, os_id: str, codename: str, arch: str, keyring: str = DOCKER_KEYRING) -> str:
    """Docker's documented line: deb [arch=.. signed-by=..] <url>/<os id> <codename> stable."""
    return f"deb [arch={arch} signed-by={keyring}] {repo_url.rstrip('/')}/{os_id} {codename} stable\n"


def toolkit_sources_line(repo_url: str, keyring: str = TOOLKIT_KEYRING) -> str:
    """NVIDIA's documented flat line; apt substitutes $(ARCH) itself."""
    return f"deb [signed-by={keyring}] {repo_url.rstrip('/')}/stable/deb/$(ARCH) /\n"


def repository_lines(settings: Settings, res: Any, os_id: str | None, codename: str | None, arch: str,
                     data: Any) -> list[tuple[str, str]]:
    """(what, line) for every package source gpufleet sets up on a host with resolution `res`."""
    out: list[tuple[str, str]] = []
    if res is not None and res.source == "nvidia":
        refusal = unsupported_arch(arch)
        out.append((f"driver_repo ({CUDA_SOURCE})", f"none: {refusal[1]}" if refusal else
                    cuda_sources_line(apt_url(settings, settings.driver_repo_url), res.repo_os_dir, data.nvidia_repo["keyring_path"], arch).strip()))
    elif res is not None:
        offer = data.distro_offers[res.os_release]
        archive = "Ubuntu" if res.os_release.startswith("ubuntu") else "Debian"
        out.append(("driver_repo", f"the {archive} archive" + (f" with {' '.join(offer.components)}" if offer.components else "")))
    if settings.docker_source == "docker":
        out.append((f"docker_repo ({DOCKER_LIST})",
                    docker_sources_line(apt_url(settings, settings.docker_repo_url), os_id or "debian", codename or "", arch).strip()))
    else:
        out.append(("docker_repo", "the distribution's archive (docker.io)"))
    out.append((f"toolkit_repo ({TOOLKIT_LIST})", toolkit_sources_line(apt_url(settings, settings.docker_toolkit_repo_url)).strip()))
    return out
