"""The fleet's package cache: what a host's apt sends through it, and what the cache host runs.
Pure functions; deploys/package_cache.py writes them.

The cache is Debian's apt-cacher-ng on a host the inventory names (`packages_cache_serve`); every
host with `packages_cache_url` fetches through it:

- every http source (the distribution's, in the host's own sources.list, and gpufleet's own
  where upstream is http, such as a site mirror) and every key apt fetches over http, by apt's
  `Acquire::http::Proxy` in APT_PROXY_CONF;
- gpufleet's own https sources (CUDA, Docker, the container toolkit: gpufleet/plans/repos.py)
  and their keys by apt-cacher-ng's URL form for them, `http://cache:3142/HTTPS///<host>/<path>`
  (the cache fetches it over TLS; apt's CONNECT through a proxy would tunnel it past the cache
  uncached); the cache itself is reached DIRECT. (Its other URL form, `/<host>:<port>/<path>`
  for http upstreams, loses the port in apt-cacher-ng 3.7: measured, "503 Connection refused".)

The cache is never a trust anchor: every source keeps its `signed-by` keyring, every key is
still checked against its pinned fingerprint before it is installed, and apt checks the
InRelease signature and each file's hash, so a cache (or anyone between) that alters a byte
makes apt refuse it. What the cache sees is public packages.
"""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

APT_PROXY_CONF = "/etc/apt/apt.conf.d/01gpufleet-package-cache"
ACNG_CONF = "/etc/apt-cacher-ng/zz_gpufleet.conf"
ACNG_PACKAGE = "apt-cacher-ng"
ACNG_SERVICE = "apt-cacher-ng.service"
HEADER = "# Managed by gpufleet (deploys/package_cache.py). Do not edit: changes are reverted.\n"
NONE = "none"
KEY_FILES = "VfilePatternEx: (/gpgkey|/gpg|\\.asc)$\n"


def via_cache(url: str, cache: str) -> str:
    """`url` as apt asks the package cache for it: an https URL in the cache's HTTPS/// form; an
    http URL unchanged (apt's proxy setting sends it through the cache); everything unchanged
    when `cache` is none."""
    if cache == NONE:
        return url
    cache = cache.rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        return f"{cache}/HTTPS///{parts.netloc}{parts.path}"
    return url


def apt_proxy_conf(cache: str) -> str | None:
    """The apt drop-in that sends the distribution's http sources through the cache; None
    without a cache (the drop-in is then removed)."""
    if cache == NONE:
        return None
    host = urllib.parse.urlsplit(cache).hostname
    return (HEADER
            + f'Acquire::http::Proxy "{cache.rstrip("/")}/";\n'
            # the HTTPS/// URLs name the cache itself: asked of it directly
            + f'Acquire::http::Proxy::{host} "DIRECT";\n')


def acng_conf(port: int, upstream_ports: Sequence[int]) -> str:
    """apt-cacher-ng's drop-in (read after acng.conf, so it wins): its port, the upstream ports it
    may fetch from (its default is 80 only; a site mirror on another port is added here), and the
    repositories' signing keys (Docker's /gpg, the toolkit's /gpgkey, .asc), which it otherwise
    refuses ("403 Forbidden file type"), as volatile files: asked upstream again each time (a key
    may be rotated; the host checks its fingerprint anyway)."""
    ports = " ".join(str(p) for p in sorted(set(upstream_ports)))
    return HEADER + f"Port: {port}\nAllowUserPorts: {ports}\n" + KEY_FILES


@dataclass(frozen=True)
class CachePlan:
    """What deploys/package_cache.py makes of one host."""

    serve: bool                      # install and run apt-cacher-ng here
    acng_conf: str | None            # its drop-in (serve only)
    apt_conf: str | None             # the apt proxy drop-in; None = absent


def plan(settings: Settings) -> CachePlan:
    serve = bool(settings.packages_cache_serve)
    return CachePlan(
        serve=serve,
        acng_conf=acng_conf(settings.packages_cache_port, settings.packages_cache_upstream_ports) if serve else None,
        apt_conf=apt_proxy_conf(settings.packages_cache_url),
    )


def summary(settings: Settings) -> str:
    """The plan view's `packages:` line."""
    parts = [f"apt through the package cache {settings.packages_cache_url}" if settings.packages_cache_url != NONE
             else "apt straight to the sources"]
    if settings.packages_cache_serve:
        parts.append(f"serves the fleet's cache (apt-cacher-ng on port {settings.packages_cache_port}, upstream ports "
                     + " ".join(str(p) for p in settings.packages_cache_upstream_ports) + ")")
    if settings.docker_registry_mirror != NONE:
        parts.append(f"Docker Hub images through {settings.docker_registry_mirror}")
    parts.append("internet: yes" if settings.packages_internet else
                 "internet: none (every download from the cache or a site mirror, checked at planning)")
    return "; ".join(parts)


def registry_mirrors(existing: Any, mirror: str) -> list[str] | None:
    """daemon.json `registry-mirrors` with the tier's mirror first and the operator's others kept;
    None when the tier names none (the key is then left as the operator has it)."""
    if mirror == NONE:
        return None
    others = [m for m in existing if isinstance(m, str) and m.rstrip("/") != mirror.rstrip("/")] \
        if isinstance(existing, list) else []
    return [mirror, *others]
