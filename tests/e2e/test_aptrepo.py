"""End-to-end: real apt on bookworm and trixie test hosts against the served stand-in NVIDIA repo.

Proves what the driver/docker deploy tests rely on: the flat signed-by source works, the signature
is really checked, the packages install, and Fabric Manager cannot stay behind a driver upgrade.
"""
from __future__ import annotations

import base64
import shlex

import pytest

from testing import testhosts
from testing.aptrepo import DRIVERS, aptrepo  # noqa: F401  (session fixture)

pytestmark = pytest.mark.e2e

OLD, NEW = (f"{d}-1" for d in DRIVERS[:2])
DISTRO = {"bookworm": "debian12", "trixie": "debian13"}
KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
APT = "DEBIAN_FRONTEND=noninteractive apt-get -q -o Dpkg::Use-Pty=0"


def sh(host, cmd: str, check: bool = True, timeout: float = 300):
    r = testhosts.ssh(host, cmd, check=False, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{cmd}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def installed(host, pkg: str) -> str:
    return sh(host, f"dpkg-query -W -f='${{db:Status-Abbrev}}${{Version}}' {pkg} 2>/dev/null || true").stdout.strip()


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def host(request, hostpool, aptrepo):  # noqa: F811
    release = request.param
    (h,) = hostpool.get(f"aptrepo-{release}", 1, release=release)
    distro = DISTRO[release]
    b64 = base64.b64encode(aptrepo.keyring.read_bytes()).decode()
    sh(h, f"echo {b64} | base64 -d > {KEYRING} && chmod 644 {KEYRING}")
    line = aptrepo.sources_line(distro, KEYRING)
    sh(h, f"echo {shlex.quote(line)} > /etc/apt/sources.list.d/cuda-{distro}-x86_64.list")
    return h, distro


def _updated(h) -> None:
    """apt knows the stand-in repository's packages (test_update_verifies_the_signature did
    that, unless this test was selected without it)."""
    if OLD not in sh(h, "apt-cache madison nvidia-open", check=False).stdout:
        sh(h, f"{APT} update")


def _old_driver_installed(h) -> None:
    """The old driver, CUDA, cuDNN and Fabric Manager installed, as in production after a first
    run with the old pin (what test_install_old_driver_cuda_cudnn_fabric_manager checks)."""
    _updated(h)
    if installed(h, "nvidia-fabricmanager") == f"ii {OLD}" and installed(h, "nvidia-open") == f"ii {OLD}":
        return
    sh(h, f"{APT} install -y nvidia-driver-pinning-{DRIVERS[0]}")
    sh(h, f"{APT} install -y nvidia-open={OLD} cuda-toolkit-13-0 libcudnn9-cuda-13 nvidia-fabricmanager={OLD}")


def test_update_verifies_the_signature(host, aptrepo):  # noqa: F811
    h, distro = host
    r = sh(h, f"{APT} update")
    assert f"{aptrepo.base_url(distro).rstrip('/')}  InRelease" in r.stdout  # fetched the signed index
    assert "NO_PUBKEY" not in r.stderr and "not signed" not in r.stderr
    policy = sh(h, "apt-cache policy nvidia-open nvidia-fabricmanager").stdout
    assert OLD in policy and NEW in policy and aptrepo.base_url(distro).rstrip("/") in policy
    # the production pin file's selector matches the stand-in repo's Release label
    assert "l=NVIDIA CUDA" in sh(h, "apt-cache policy").stdout


# bookworm's gpgv says NO_PUBKEY, trixie's sqv says "Missing key"
@pytest.mark.parametrize("variant,expect", [("wrongkey", ("NO_PUBKEY", "Missing key")),
                                            ("unsigned", ("is not signed",))])
def test_update_fails_for_a_wrongly_signed_or_unsigned_repo(host, aptrepo, variant, expect):  # noqa: F811
    h, distro = host
    url = aptrepo.variant_url(variant, distro)
    # An isolated source list and lists dir, so the host's real state is untouched.
    sh(h, f"rm -rf /tmp/neg && mkdir -p /tmp/neg/lists/partial && "
          f"echo 'deb [signed-by={KEYRING}] {url} /' > /tmp/neg/sources.list")
    r = sh(h, f"{APT} update -o Dir::Etc::SourceList=/tmp/neg/sources.list -o Dir::Etc::SourceParts=/nonexistent "
              f"-o Dir::State::Lists=/tmp/neg/lists", check=False)
    assert r.returncode != 0, r.stdout + r.stderr
    assert any(e in r.stdout + r.stderr for e in expect), r.stdout + r.stderr
    assert not sh(h, "ls /tmp/neg/lists | grep -e Packages -e Release || true").stdout.strip()


def test_old_driver_with_old_fabric_manager_needs_pinning(host):
    h, _ = host
    _updated(h)
    # The meta package's >= relations pull the newest libraries in; FM's exact dependency then fails.
    r = sh(h, f"{APT} install -s nvidia-open={OLD} nvidia-fabricmanager={OLD}", check=False)
    assert r.returncode != 0
    assert f"nvidia-driver-cuda (= {OLD})" in r.stdout + r.stderr
    # The R580+ branch name is only a virtual package: versioned install of it fails (gpu-driver-container#451)
    r = sh(h, f"{APT} install -s nvidia-fabricmanager-580={OLD}", check=False)
    assert r.returncode != 0 and "virtual package" in r.stdout + r.stderr, r.stdout + r.stderr


def test_install_old_driver_cuda_cudnn_fabric_manager(host):
    h, _ = host
    _old_driver_installed(h)
    for pkg in ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager"):
        assert installed(h, pkg) == f"ii {OLD}", pkg
    assert installed(h, "cuda-toolkit-13-0").startswith("ii 13.0.")
    assert installed(h, "libcudnn9-cuda-13").startswith("ii 9.")
    assert sh(h, "nv-fabricmanager --version").stdout.strip() == f"Fabric Manager version is : {DRIVERS[0]}"
    assert "release 13.0" in sh(h, "/usr/local/cuda-13.0/bin/nvcc --version").stdout
    assert "stand-in" in sh(h, "cat /usr/share/doc/nvidia-open/STAND-IN").stdout
    assert sh(h, "systemctl cat nvidia-fabricmanager.service").returncode == 0


def test_upgrade_drags_fabric_manager_along(host):
    h, _ = host
    _old_driver_installed(h)  # on its own too, not only after the test above
    sh(h, f"{APT} install -y nvidia-driver-pinning-{DRIVERS[1]}")  # conflicts with, and replaces, the old pin
    assert not installed(h, f"nvidia-driver-pinning-{DRIVERS[0]}").startswith("ii")
    # Fabric Manager held at the old version cannot stay with the new driver.
    sh(h, "apt-mark hold nvidia-fabricmanager")
    r = sh(h, f"{APT} install -y nvidia-open={NEW}", check=False)
    assert r.returncode != 0, r.stdout
    assert installed(h, "nvidia-driver-cuda") == f"ii {OLD}"  # nothing was changed
    sh(h, "apt-mark unhold nvidia-fabricmanager")
    sh(h, f"{APT} install -y nvidia-open={NEW}")
    for pkg in ("nvidia-open", "nvidia-driver-cuda", "nvidia-fabricmanager"):
        assert installed(h, pkg) == f"ii {NEW}", pkg
    assert sh(h, "nv-fabricmanager --version").stdout.strip() == f"Fabric Manager version is : {DRIVERS[1]}"


def test_cuda_keyring_deb_and_container_toolkit(host, aptrepo):  # noqa: F811
    h, distro = host
    url = aptrepo.base_url(distro)
    # The production flow: fetch cuda-keyring from the repo root and dpkg -i it.
    sh(h, f"python3 -c 'import urllib.request,sys; sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1]).read())' "
          f"{url}cuda-keyring_1.1-1_all.deb > /tmp/cuda-keyring.deb && dpkg -i /tmp/cuda-keyring.deb")
    assert url in sh(h, f"cat /etc/apt/sources.list.d/cuda-{distro}-x86_64.list").stdout
    line = f"deb [signed-by={KEYRING}] {aptrepo.container_url()} /"
    sh(h, f"echo {shlex.quote(line)} > /etc/apt/sources.list.d/nvidia-container-toolkit.list")
    sh(h, f"{APT} update")
    sh(h, f"{APT} install -y nvidia-container-toolkit=1.17.8-1 nvidia-container-toolkit-base=1.17.8-1")
    assert "version 1.17.8" in sh(h, "nvidia-ctk --version").stdout
    sh(h, f"{APT} install -y nvidia-container-toolkit")
    assert "version 1.18.0" in sh(h, "nvidia-ctk --version").stdout
    assert installed(h, "libnvidia-container1") == "ii 1.18.0-1"
