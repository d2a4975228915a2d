"""The fleet's package cache: each byte from upstream once.

Story of a host, part 0.5: before anything is installed, on the host the inventory names
(`packages_cache_serve: true`) Debian's apt-cacher-ng is installed, given gpufleet's drop-in
(its port, the upstream ports it may fetch from) and kept running; and every host whose data has
`packages_cache_url` gets the apt drop-in that sends its http sources through that cache
(gpufleet's https sources name the cache in their URLs: gpufleet/plans/repos.py). The
cache is never trusted: keys stay pinned (signed-by, fingerprints), apt checks every signature
and hash (gpufleet/plans/package_cache.py says how).

Run it first on a new site (`pyinfra INVENTORY deploys/package_cache.py`), or let all.py do it:
its cache host installs apt-cacher-ng before any host's apt is pointed at it.
Settings: gpufleet/data/tiers.yaml (`packages_*`).
"""
from io import StringIO

from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt, files, systemd

from gpufleet.explain import explained
from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.config.settings import host_settings
from gpufleet.plans import package_cache as pc


@deploy("Package cache")
def package_cache() -> None:
    cache = pc.plan(host_settings(host))
    if cache.serve and cache.acng_conf is not None:
        apt.packages(
            name=explained("Install apt-cacher-ng", "Install Debian's apt-cacher-ng, the fleet's package cache"),
            packages=[pc.ACNG_PACKAGE],
            update=True,
            cache_time=APT_CACHE_SECONDS,
            no_recommends=True,
        )
        conf = files.put(
            name=explained("Configure apt-cacher-ng", "Configure the package cache: its port and the upstream ports it "
                                                                  "may fetch from"),
            src=StringIO(cache.acng_conf),
            dest=pc.ACNG_CONF,
            mode="644",
        )
        systemd.service(
            name=explained("Start apt-cacher-ng", "Run the package cache now and at every boot"),
            service=pc.ACNG_SERVICE,
            running=True,
            enabled=True,
        )
        systemd.service(
            name=explained("Restart apt-cacher-ng", "Restart the package cache for its new configuration"),
            service=pc.ACNG_SERVICE,
            restarted=True,
            _if=conf.did_change,
        )
    if cache.apt_conf is not None:
        files.put(
            name=explained("Use the package cache", "Send apt's downloads through the fleet's package cache "
                                                          "(an apt proxy drop-in for the http sources)"),
            src=StringIO(cache.apt_conf),
            dest=pc.APT_PROXY_CONF,
            mode="644",
        )
    else:
        files.file(
            name=explained("No package cache", "No package cache: apt fetches from the sources themselves"),
            path=pc.APT_PROXY_CONF,
            present=False,
        )


# `pyinfra INVENTORY deploys/package_cache.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
