"""What `pyinfra INVENTORY deploys/all.py --dry` plans for the driver and Docker areas on a
simulated Ubuntu 22.04 / 24.04 host (testing/ubuntu_host.py: pyinfra's real operations, facts
answered from tests/fixtures/ubuntu/), for every tier: the repository files written, the keys
fetched and the exact packages installed. Expected values are written out from the cited
sources (compat.yaml S1, S5, S34, S35, S36; Docker's and NVIDIA's install guides)."""
from __future__ import annotations

import re

import pytest

from gpufleet.catalog.tiers import tier_defaults, tier_names
from testing.ubuntu_host import RELEASES, UbuntuHost, canned, make_state, on_host, planned_operations

CODENAME = {"22.04": "jammy", "24.04": "noble"}
KERNEL = {"22.04": "6.8.0-90-generic", "24.04": "6.8.0-60-generic"}
HEADERS_META = {"22.04": "linux-headers-generic-hwe-22.04", "24.04": "linux-headers-generic"}
MOK = "/var/lib/shim-signed/mok/MOK.priv"


def dry_run(tier: str, release: str, machine: str = "x86_64") -> str:
    """All commands driver() and docker() plan for one simulated host, as text."""
    values = tier_defaults(tier)
    count = values["validate_gpu_count"] if isinstance(values["validate_gpu_count"], int) else values["validate_gpu_count"][0]
    data = {"tier": tier, "validate_os_release": f"ubuntu-{release}"}
    files = {}
    if release == "22.04" and tier != "dev":  # Secure Boot is on there: DKMS-built modules need Ubuntu's MOK pair
        data["driver_module_signing_key"] = MOK
        files = {MOK: True, "/var/lib/shim-signed/mok/MOK.der": True}
    host = UbuntuHost(release, [values["validate_gpu_models"][0]] * count,
                      nvswitches=4 if values["validate_nvswitch"] == "required" else 0,
                      rdma=values["validate_rdma"] == "required", files=files, machine=machine)
    name = f"{tier}-{release}"
    state = make_state({name: (host, data)})
    with canned({name: host}):
        with on_host(state, name) as h:
            from gpufleet.deploys.docker import docker
            from gpufleet.deploys.driver import driver

            driver()
            docker()
            ops = planned_operations(state, h)
    return "\n".join(f"## {op}\n" + "\n".join(commands) for op, commands in ops)


def packages_args(text: str) -> str:
    """The package change script's argument words (after the script, which the package change
    unit runs), one string with a space at its end: install=P=V (exact versions, decided on the
    controller from the index; the index of a fresh host is a stand-in, UbuntuHost), install=P
    (installed as the sources offer it), first=P (the version lock, on its own first), hold=P."""
    m = re.search(r"' gpufleet-package-change /var/lib/gpufleet/libexec/package-change (.*)", text)
    assert m, text
    return m[1] + " "


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("tier", tier_names())
def test_dry_run_repositories_and_packages(tier, release):
    text = dry_run(tier, release)
    codename, kernel = CODENAME[release], KERNEL[release]
    # NVIDIA's container toolkit: one flat source, key fingerprint-checked, four packages pinned
    assert ("upload /etc/apt/sources.list.d/nvidia-container-toolkit.list\ndeb [signed-by=/usr/share/keyrings/"
            "nvidia-container-toolkit-keyring.gpg] https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n") in text
    assert "https://nvidia.github.io/libnvidia-container/gpgkey C95B321B61E88C1809C4F759DDCAE044F796ECB0" in text
    assert ("install --no-install-recommends --allow-change-held-packages --allow-downgrades nvidia-container-toolkit=1.18.0-1 "
            "nvidia-container-toolkit-base=1.18.0-1 libnvidia-container-tools=1.18.0-1 libnvidia-container1=1.18.0-1") in text
    args = packages_args(text)
    if tier == "dev":
        # Ubuntu's own 580-server driver, ubuntu-drivers --gpgpu style, from `restricted`
        assert "## Driver stack | Enable restricted (Ubuntu archive)" in text
        assert "cuda-keyring" not in text and "gpufleet-cuda.list" not in text
        assert "install=nvidia-headless-no-dkms-580-server-open=580.173.02-1 " in args
        assert "install=nvidia-utils-580-server=580.173.02-1 " in args
        assert "norecommends" in args
        hold = re.search(r"^apt-mark hold (.*)$", text, re.M)[1].split()
        if release == "22.04":  # prebuilt, signed modules for the running HWE kernel: no DKMS, no headers
            assert ("install=linux-modules-nvidia-580-server-open-6.8.0-90-generic "
                    "install=linux-modules-nvidia-580-server-open-generic-hwe-22.04 ") in args
            assert "nvidia-dkms" not in text and "mok_certificate" not in text
            assert not re.search(r"install [^\n]*linux-headers", text)  # no headers installed
            assert "linux-modules-nvidia-580-server-open-6.8.0-90-generic" in hold
            # kernels and their prebuilt modules move together or not at all: the modules' flavour
            # metapackage and the installed kernel flavour metapackages are held with the driver
            # (an unattended kernel upgrade would otherwise boot without an nvidia module)
            for meta in ("linux-modules-nvidia-580-server-open-generic-hwe-22.04", "linux-generic-hwe-22.04",
                         "linux-image-generic-hwe-22.04", "linux-headers-generic-hwe-22.04"):
                assert meta in hold, meta
            assert "linux-image-generic" not in hold and "linux-generic" not in hold  # not installed there
            # the one-line sources.list: every archive entry without restricted gets it, in place
            for line in (4, 5, 6, 7, 10, 11):
                assert f"sed -i '{line}s/^\\([^#]*[^#[:space:]]\\)/\\1 restricted/' /etc/apt/sources.list" in text
        else:  # no prebuilt build for 6.8.0-60: DKMS, and its headers
            assert "install=nvidia-dkms-580-server-open " in args and "linux-modules" not in args
            # DKMS builds the module for each new kernel: its kernel metapackages are not held
            assert not {"linux-generic", "linux-image-generic"} & set(hold), hold
            assert f"install --no-install-recommends linux-headers-{kernel}" in text
            assert f"install --no-install-recommends {HEADERS_META[release]}" in text
            for line in (4, 10):  # deb822: the Components: line of each stanza
                assert (f"sed -i '{line}s/^\\([^#]*[^#[:space:]]\\)/\\1 restricted/' "
                        "/etc/apt/sources.list.d/ubuntu.sources") in text
        assert "install --no-install-recommends docker.io" in text and "download.docker.com" not in text
        return
    # NVIDIA's CUDA repository for this release, its key pinned by fingerprint, trusted for it only
    base = f"https://developer.download.nvidia.com/compute/cuda/repos/ubuntu{release.replace('.', '')}/x86_64"
    assert (f"{base}/cuda-keyring_1.1-1_all.deb /usr/share/keyrings/cuda-archive-keyring.gpg "
            "EB693B3035CD5710E231E123A4B469963BF863CC /usr/share/keyrings/cuda-archive-keyring.gpg") in text
    assert ("upload /etc/apt/sources.list.d/gpufleet-cuda.list\n# Managed by gpufleet (deploys/driver.py). Do not edit: "
            f"changes are reverted.\ndeb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {base}/ /\n") in text
    assert "first=nvidia-driver-pinning-580.159.04 " in args and "install=nvidia-open=580.159.04-1 " in args
    values = tier_defaults(tier)
    if values["cuda_version"] != "none":
        assert "install=cuda-toolkit-13-0=13.0.2-1 " in args
    else:
        assert "cuda-toolkit" not in args
    for package in ("libcudnn9-cuda-13", "libcudnn9-dev-cuda-13", "libcudnn9-headers-cuda-13"):
        assert (f"install={package}=9.17.0.29-1 " in args) == (values["cudnn_version"] != "none"), (package, args)
    assert ("install=nvidia-fabricmanager=580.159.04-1 " in args) == (values["validate_nvswitch"] == "required")
    # NVIDIA's modules are DKMS-built: the running kernel's headers and the metapackage its kernels follow
    assert f"install --no-install-recommends linux-headers-{kernel}" in text
    assert f"install --no-install-recommends {HEADERS_META[release]}" in text
    if release == "22.04":
        assert "mok_signing_key=/var/lib/shim-signed/mok/MOK.priv\nmok_certificate=/var/lib/shim-signed/mok/MOK.der\n" in text
    # Docker's repository for the Ubuntu codename, key checked against Docker's fingerprint
    assert ("upload /etc/apt/sources.list.d/gpufleet-docker.list\ndeb [arch=amd64 signed-by=/etc/apt/keyrings/"
            f"gpufleet-docker.gpg] https://download.docker.com/linux/ubuntu {codename} stable\n") in text
    assert "https://download.docker.com/linux/ubuntu/gpg 9DC858229FC7DD38854AE2D88D81803C0EBFCD88" in text
    assert "install --no-install-recommends docker-ce docker-ce-cli containerd.io" in text


def standalone_run(area: str, monkeypatch, needrestart: bool = True) -> list[tuple[str, list[str]]]:
    """What `pyinfra INVENTORY deploys/<area>.py` plans on a fresh simulated Ubuntu 22.04 dev host:
    deploys/standalone.py's run_alone as pyinfra's exec of that file reaches it."""
    from gpufleet.controller import factcache
    from gpufleet.controller import hostlock
    from gpufleet.deploys.standalone import run_alone
    from testing.ubuntu_host import REPO

    # the fact cache and host lock patch pyinfra for the whole process: not in a unit test
    for module, attr in ((factcache, "install"), (hostlock, "install"), (factcache, "prefetch_all")):
        monkeypatch.setattr(module, attr, lambda *a: None)
    host = UbuntuHost("22.04", [tier_defaults("dev")["validate_gpu_models"][0]], needrestart=needrestart)
    name = f"{area}-alone"
    state = make_state({name: (host, {"tier": "dev", "validate_os_release": "ubuntu-22.04"})})
    path = REPO / "deploys" / f"{area}.py"
    with canned({name: host}):
        with on_host(state, name) as h:
            state.current_exec_filename = str(path)
            run_alone("<pyinfra exec>", str(path))
            return planned_operations(state, h)


def test_standalone_driver_deploy_quiets_needrestart_before_any_apt(monkeypatch):
    ops = standalone_run("driver", monkeypatch)
    acting = [(n, c) for n, c in ops if c]
    first_name, first = acting[0]
    # the first command of the run writes needrestart's conf.d file (never prompt, never restart)
    assert "needrestart" in first_name, acting[:3]
    [upload] = [c for c in first if c.startswith("upload ")]
    assert upload.startswith("upload /etc/needrestart/conf.d/50-gpufleet.conf\n")
    assert "$nrconf{restart} = 'l';" in upload
    runs_apt = re.compile(r"(^|[;&|(] *|DEBIAN_FRONTEND=\S+ )apt(-get)? |gpufleet-package-change")
    apt = [i for i, (_, c) in enumerate(acting) if any(runs_apt.search(x) for x in c)]
    assert apt and apt[0] > 0, "the driver deploy runs apt"
    assert sum("needrestart" in n for n, _ in ops) == 1  # planned once


def test_standalone_without_needrestart_writes_nothing_and_the_checks_never_write(monkeypatch):
    assert not any("needrestart" in n for n, _ in standalone_run("driver", monkeypatch, needrestart=False))
    assert not any("needrestart" in n for n, _ in standalone_run("validate", monkeypatch))
    assert not any("needrestart" in n for n, _ in standalone_run("preflight", monkeypatch))
    # an area that runs apt and is run alone writes it too (the same hook for every deploy file)
    assert any("needrestart" in n for n, c in standalone_run("docker", monkeypatch) if c)
