"""End-to-end for the fleet's package cache and air-gapped hosts (issue 48 items 1-2), on real
Debian 12 test hosts (systemd-nspawn), GPUs SIMULATED (testing/gpusim), NVIDIA's container
toolkit repository as the tests' signed STAND-IN (testing/aptrepo.py, the "upstream", whose own
access log counts what it served), the distribution's packages from Debian's archive.

- The cache: one host runs deploys/package_cache.py (`packages_cache_serve`: Debian's real
  apt-cacher-ng); three fresh hosts then converge base + docker with `packages_cache_url`: their
  toolkit source names the cache, the stand-in serves each package file once, apt-cacher-ng
  fetched docker.io's .deb from Debian's archive once and served it three times; a second run
  changes nothing. A fifth fresh host whose cache is down fails with apt's error naming the
  cache, and its packages are exactly what they were (nothing half-installed).
- Air-gapped: a host in a network namespace of its own (no route anywhere: only relays to the
  Debian archive, the site's "mirror" here, and to the stand-in) with `packages_internet: false`
  converges from its mirror; the same host without the mirror in the inventory is refused at
  planning, naming host and key, and nothing on it changes.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from testing import aptrepo as standin
from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
TOOLKIT = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
           "libnvidia-container1")
TOOLKIT_VERSION = "1.18.0-1"
TOOLKIT_LIST = "/etc/apt/sources.list.d/nvidia-container-toolkit.list"
PORT = 3142
MIRROR = "http://127.0.0.1:5000"  # a registry mirror for daemon.json (nothing pulls from it here)
DEPLOY = textwrap.dedent("""\
    from pyinfra import host, state
    from gpufleet.deploys.package_cache import package_cache
    from gpufleet.deploys.base import base
    from gpufleet.deploys.docker import docker
    from gpufleet.config.failures import host_failed
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    package_cache()
    if not host_failed(host):
        base()
    if not host_failed(host):
        docker()
    """)


def sh(host, cmd: str) -> str:
    return testhosts.ssh(host, cmd).stdout


def _data(host, **extra) -> dict:
    return {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn",
            "docker_smoke_image": "none", **extra}


def _packages(host) -> str:
    return sh(host, "dpkg-query -W -f='${Package} ${db:Status-Abbrev} ${Version}\\n' | sort")


@pytest.fixture(scope="module")
def aptrepo(tmp_path_factory):
    """This module's own stand-in "upstream": on a port apt-cacher-ng fetches from (below 32768,
    see testing/aptrepo.serve), with an access log of its own."""
    missing = standin._missing_tools()
    if missing:
        pytest.skip(f"the stand-in apt repository needs {', '.join(missing)}")
    repo = standin.serve(tmp_path_factory.mktemp("upstream"), low_port=True)
    yield repo
    repo.stop()


def _fresh(hostpool) -> list:
    """The three clients and the host whose cache is down, booted together (one wait for the
    four): the fourth is in no inventory until its own test, as fresh as a host booted then."""
    return hostpool.get("pkgcache-fresh", 4, release="bookworm", gpu="t4")


@pytest.fixture(scope="module")
def site(hostpool, aptrepo, tmp_path_factory):
    cache = hostpool.get("pkgcache-server", 1, release="bookworm")[0]
    clients = _fresh(hostpool)[:3]
    url = f"http://{cache.address}:{PORT}"
    tmp = tmp_path_factory.mktemp("package_cache")
    deploy = tmp / "deploy.py"
    deploy.write_text(DEPLOY)
    server_inv = write_inventory(tmp / "server.py", [cache], data={cache.name: _data(
        cache, packages_cache_serve=True, packages_cache_upstream_ports=[80, 443, aptrepo.port])})
    served = pyinfra(server_inv, "deploys/package_cache.py")
    client_data = {h.name: _data(h, packages_cache_url=url, docker_registry_mirror=MIRROR,
                                 docker_toolkit_repo_url=aptrepo.container_repo_base(),
                                 docker_toolkit_repo_fingerprint=aptrepo.fingerprint) for h in clients}
    inventory = write_inventory(tmp / "clients.py", clients, data=client_data)
    before = aptrepo.fetches(".deb")
    first = pyinfra(inventory, str(deploy))
    after = aptrepo.fetches(".deb")
    second = pyinfra(inventory, str(deploy))
    for name, run in (("served", served), ("first", first), ("second", second)):
        (tmp / f"{name}.log").write_text(run.output)  # kept under pytest's basetemp for reading
    return {"cache": cache, "clients": clients, "url": url, "served": served, "first": first, "second": second,
            "fetched": {path: after.get(path, 0) - before.get(path, 0) for path in after}, "tmp": tmp,
            "deploy": deploy}


def test_the_cache_host_runs_debians_apt_cacher_ng(site):
    served, cache = site["served"], site["cache"]
    assert served.returncode == 0, served.output[-3000:]
    assert sh(cache, "dpkg-query -W -f='${db:Status-Abbrev}' apt-cacher-ng").startswith("ii")
    assert sh(cache, "systemctl is-active apt-cacher-ng").strip() == "active"
    assert sh(cache, "systemctl is-enabled apt-cacher-ng").strip() == "enabled"
    assert f":{PORT}" in sh(cache, "ss -ltn")


def test_three_fresh_hosts_converge_through_the_cache(site, aptrepo):
    first = site["first"]
    assert first.returncode == 0, first.output[-4000:]
    origin = aptrepo.container_repo_base()  # http: through the cache by apt's proxy setting
    for h in site["clients"]:
        status = dict(line.split(None, 1) for line in sh(h, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}${Version}\\n' "
                                                            "docker.io " + " ".join(TOOLKIT)).splitlines())
        for pkg in ("docker.io", *TOOLKIT):
            assert status[pkg].startswith("hi"), (h.name, pkg, status[pkg])
        for pkg in TOOLKIT:
            assert status[pkg].endswith(TOOLKIT_VERSION), (pkg, status[pkg])
        # the keyring stays pinned (the cache is no trust anchor)
        assert sh(h, f"cat {TOOLKIT_LIST}") == (
            f"deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] {origin}/stable/deb/$(ARCH) /\n")
        fprs = sh(h, "gpg --with-colons --show-keys /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg "
                     "| awk -F: '$1==\"fpr\"{print $10}'").split()
        assert fprs[0] == aptrepo.fingerprint
        # the distribution's sources through the proxy drop-in
        conf = sh(h, "cat /etc/apt/apt.conf.d/01gpufleet-package-cache")
        assert f'Acquire::http::Proxy "{site["url"]}/";' in conf
        # the registry mirror reached the running dockerd
        assert json.loads(sh(h, "cat /etc/docker/daemon.json"))["registry-mirrors"][0] == MIRROR
        assert MIRROR in sh(h, "docker info --format '{{json .RegistryConfig.Mirrors}}'")


def test_each_package_file_comes_from_upstream_once(site, aptrepo):
    fetched = site["fetched"]
    toolkit = [p for p in aptrepo.packages if p.name in TOOLKIT and p.version == TOOLKIT_VERSION]
    assert len(toolkit) == len(TOOLKIT)
    for pkg in toolkit:
        path = f"/libnvidia-container/stable/deb/amd64/{pkg.filename}"
        assert fetched.get(path) == 1, (path, fetched)  # three hosts installed it; the stand-in served it once
    # apt-cacher-ng's own log, I = fetched upstream, O = served to a host: the stand-in's files
    # went through it, and Debian's archive's too
    log = sh(site["cache"], "cat /var/log/apt-cacher-ng/apt-cacher.log")
    for pkg in toolkit:
        mine = [line.split("|")[1] for line in log.splitlines() if line.endswith("/" + pkg.filename)]
        assert mine.count("I") == 1 and mine.count("O") >= 3, (pkg.filename, mine)
    lines = [line.split("|") for line in log.splitlines() if "/docker.io_" in line and line.endswith(".deb")]
    assert [f[1] for f in lines].count("I") == 1, lines
    assert [f[1] for f in lines].count("O") == 3, lines


def test_second_run_changes_nothing(site):
    second = site["second"]
    assert second.returncode == 0, second.output[-3000:]
    assert changed_operations(second) == [], second.output


def test_a_host_whose_cache_is_down_fails_with_apts_error_and_nothing_half_installed(site, hostpool, aptrepo):
    host = _fresh(hostpool)[3]
    assert host not in site["clients"]
    inventory = write_inventory(site["tmp"] / "down.py", [host], data={host.name: _data(
        host, packages_cache_url=site["url"], docker_toolkit_repo_url=aptrepo.container_repo_base(),
        docker_toolkit_repo_fingerprint=aptrepo.fingerprint)})
    before = _packages(host)
    testhosts.ssh(site["cache"], "systemctl stop apt-cacher-ng")
    try:
        run = pyinfra(inventory, str(site["deploy"]))
    finally:
        testhosts.ssh(site["cache"], "systemctl start apt-cacher-ng")
    (site["tmp"] / "down.log").write_text(run.output)
    assert run.returncode != 0, run.output[-3000:]
    cache = site["url"].removeprefix("http://")
    assert f"Could not connect to {cache}" in run.output or "Connection refused" in run.output, run.output[-3000:]
    assert _packages(host) == before  # not one package more, none unpacked or half-configured
    assert sh(host, "dpkg --audit").strip() == ""


# --------------------------------------------------------------------------------------------
# Air-gapped
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def airgapped(hostpool, aptrepo, tmp_path_factory):
    host = hostpool.get("pkgcache-airgap", 1, release="bookworm", gpu="t4", private_network=True,
                        forward=(aptrepo.port,))[0]
    tmp = tmp_path_factory.mktemp("airgap")
    deploy = tmp / "deploy.py"
    deploy.write_text(DEPLOY)
    offline = {"packages_internet": False}
    mirrored = write_inventory(tmp / "mirrored.py", [host], data={host.name: _data(
        host, **offline, docker_toolkit_repo_url=aptrepo.container_repo_base(),
        docker_toolkit_repo_fingerprint=aptrepo.fingerprint)})
    bare = write_inventory(tmp / "bare.py", [host], data={host.name: _data(host, **offline)})
    before = _packages(host)
    refused = pyinfra(bare, str(deploy), netns=host.netns)
    after_refusal = _packages(host)
    list_after_refusal = testhosts.ssh(host, f"test -e {TOOLKIT_LIST}", check=False).returncode == 0
    first = pyinfra(mirrored, str(deploy), netns=host.netns)
    second = pyinfra(mirrored, str(deploy), netns=host.netns)
    for name, run in (("refused", refused), ("first", first), ("second", second)):
        (tmp / f"{name}.log").write_text(run.output)
    return {"host": host, "refused": refused, "first": first, "second": second, "before": before,
            "after_refusal": after_refusal, "list_after_refusal": list_after_refusal}


def test_the_air_gapped_host_has_no_route_out(airgapped):
    host = airgapped["host"]
    assert "default" not in sh(host, "ip route")
    assert testhosts.ssh(host, "timeout 5 /usr/lib/apt/apt-helper download-file "
                               "https://nvidia.github.io/libnvidia-container/gpgkey /tmp/k", check=False).returncode != 0


def test_without_the_mirror_it_is_refused_at_planning(airgapped):
    refused, host = airgapped["refused"], airgapped["host"]
    assert refused.returncode != 0
    assert (f"host {host.name}: key 'docker_toolkit_repo_url': packages_internet is false (no route to the "
            "internet), but https://nvidia.github.io/libnvidia-container is a public upstream") in refused.output, \
        refused.output[-3000:]
    assert airgapped["after_refusal"] == airgapped["before"]
    assert not airgapped["list_after_refusal"]


def test_with_the_mirror_it_converges(airgapped):
    first, second, host = airgapped["first"], airgapped["second"], airgapped["host"]
    assert first.returncode == 0, first.output[-4000:]
    for pkg in ("docker.io", *TOOLKIT):
        assert sh(host, f"dpkg-query -W -f='${{db:Status-Abbrev}}' {pkg}").startswith("hi"), pkg
    assert second.returncode == 0, second.output[-3000:]
    assert changed_operations(second) == [], second.output
