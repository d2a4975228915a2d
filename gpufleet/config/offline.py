"""Air-gapped hosts (`packages_internet: false`): every download gpufleet would make, and the ones
that would reach the internet. Pure; inventory validation (settings.py) refuses such a host
before any host changes, naming the key.

gpufleet cannot know a site's network, so "the internet" is the public upstreams gpufleet itself
knows: the hosts its defaults name (tiers.yaml's URL keys, PyTorch's index in compat.yaml), the
distributions' archives and the public container registries. Any other host is the site's
mirror. apt sources and their keys may also come through the fleet's package cache
(`packages_cache_url`): the host then reaches only the cache, which fetches for it.
"""
from __future__ import annotations

import urllib.parse
from typing import Any, Mapping

from gpufleet.catalog.pytorch import pytorch_data
from gpufleet.catalog.tiers import common_defaults

#: apt downloads (sources and keys), which the package cache can carry
APT_KEYS = ("driver_repo_url", "driver_repo_keyring_url", "docker_repo_url", "docker_toolkit_repo_url")
#: public upstreams besides the hosts of gpufleet's default URLs
PUBLIC_HOSTS = frozenset({
    "deb.debian.org", "security.debian.org", "archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com",
    "pypi.org", "files.pythonhosted.org", "download.pytorch.org",
})
#: public container registries (an image named without one comes from Docker Hub)
PUBLIC_REGISTRIES = frozenset({
    "docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com", "nvcr.io", "ghcr.io",
    "quay.io", "gcr.io", "mirror.gcr.io", "registry.k8s.io", "public.ecr.aws",
})


def public_hosts() -> frozenset[str]:
    defaults = common_defaults()
    hosts = {urllib.parse.urlsplit(str(defaults[key])).hostname for key in APT_KEYS if "://" in str(defaults[key])}
    hosts.add(urllib.parse.urlsplit(pytorch_data().index_url).hostname)
    return PUBLIC_HOSTS | {h for h in hosts if h}


def is_public(url: str) -> bool:
    return (urllib.parse.urlsplit(url).hostname or "").lower() in public_hosts()


def image_registry(image: str) -> str:
    """The registry an image reference pulls from ("docker.io" when it names none)."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def downloads(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(key, URL or image) of every download gpufleet makes for a host with these settings."""
    out: list[tuple[str, str]] = []
    if values["driver_source"] == "nvidia":
        out.append(("driver_repo_url", values["driver_repo_url"]))
        if values["driver_repo_keyring_url"] != "auto":
            out.append(("driver_repo_keyring_url", values["driver_repo_keyring_url"]))
    if values["docker_source"] == "docker":
        out.append(("docker_repo_url", values["docker_repo_url"]))
    out.append(("docker_toolkit_repo_url", values["docker_toolkit_repo_url"]))
    if values["pytorch_runtime"] == "venv" and values["pytorch_wheel_dir"] == "none":
        index = values["pytorch_index_url"]
        out.append(("pytorch_index_url", pytorch_data().index_url if index == "auto" else index))
    if values["docker_smoke_image"] != "none":
        out.append(("docker_smoke_image", values["docker_smoke_image"]))
    if values["docker_registry_mirror"] != "none":
        out.append(("docker_registry_mirror", values["docker_registry_mirror"]))
    return out


def internet_problems(values: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, problem, allowed) for each download that would reach the internet from a host whose
    settings say it has none; [] where packages_internet is true."""
    if values["packages_internet"]:
        return []
    cached = values["packages_cache_url"] != "none"
    said = "packages_internet is false (no route to the internet)"
    problems = []
    for key, what in downloads(values):
        if key in APT_KEYS:
            if not cached and is_public(what):
                problems.append((key, f"{said}, but {what} is a public upstream",
                                 "a site mirror's URL, packages_cache_url (the fleet's package cache fetches for "
                                 "the host), or packages_internet: true"))
        elif key == "pytorch_index_url":
            if is_public(what):
                problems.append((key, f"{said}, but PyTorch's wheels would come from {what}",
                                 "a site mirror's URL, pytorch_wheel_dir (wheels on the host), pytorch_runtime "
                                 "python or none, or packages_internet: true"))
        elif key == "docker_registry_mirror":
            if (urllib.parse.urlsplit(what).hostname or "") in PUBLIC_REGISTRIES or is_public(what):
                problems.append((key, f"{said}, but the registry mirror {what} is public",
                                 "the site's registry mirror, or none"))
        else:
            registry = image_registry(what)
            hub_mirrored = registry == "docker.io" and values["docker_registry_mirror"] != "none"
            if registry in PUBLIC_REGISTRIES and not hub_mirrored:
                problems.append((key, f"{said}, but the image {what} would be pulled from {registry}",
                                 "an image of the site's registry (registry.site:5000/ubuntu:24.04), "
                                 "docker_registry_mirror for Docker Hub images, or none"))
    return problems
