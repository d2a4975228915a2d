"""Ubuntu 22.04 and 24.04, proven on recorded output: the plan view (deploys/plan.py, run by
pyinfra's own machinery for each host) on simulated hosts whose facts are Ubuntu's
(testing/ubuntu_host.py, tests/fixtures/ubuntu/SOURCES.md), for every tier of tiers.yaml.

The expected lines are written out here from the cited sources, not computed by the code under
test: NVIDIA's CUDA repository layout (repos/ubuntu2204|ubuntu2404/x86_64, cuda-keyring,
cuda-toolkit-13-0 at 13.0.2, libcudnn9-*-cuda-13 at 9.17.0.29; compat.yaml S1, S5, S34), Ubuntu's
own 580-server driver as `ubuntu-drivers install --gpgpu` installs it (S35, S36), Docker's
repository per codename (download.docker.com/linux/ubuntu jammy|noble stable) and NVIDIA's
container toolkit repository (one flat source for all releases).
"""
from __future__ import annotations

import re
import runpy

import pytest

from gpufleet.catalog.tiers import tier_defaults, tier_names
from testing.ubuntu_host import REPO, RELEASES, UbuntuHost, canned, make_state, on_host

CODENAME = {"22.04": "jammy", "24.04": "noble"}
CUDA_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
TOOLKIT_LINE = ("toolkit_repo (/etc/apt/sources.list.d/nvidia-container-toolkit.list): deb [signed-by="
                "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
                "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /")
TOOLKIT = ("toolkit: nvidia-container-toolkit=1.18.0-1 nvidia-container-toolkit-base=1.18.0-1 "
           "libnvidia-container-tools=1.18.0-1 libnvidia-container1=1.18.0-1")
NVIDIA_STACK = {  # tier -> the lines of NVIDIA's CUDA repository stack
    "research": ["driver: R580 580.159.04 (open)",
                 "driver_packages: nvidia-open (locked by nvidia-driver-pinning-580.159.04)",
                 "cuda: 13.0 (cuda-toolkit-13-0) at 13.0.2",
                 "cudnn: 9.17.0 (libcudnn9-cuda-13 libcudnn9-dev-cuda-13 libcudnn9-headers-cuda-13) at 9.17.0.29",
                 "fabricmanager: not needed"],
    "inference": ["driver: R580 580.159.04 (open)",
                  "driver_packages: nvidia-open (locked by nvidia-driver-pinning-580.159.04)",
                  "cuda: none", "cudnn: none", "fabricmanager: not needed"],
    "render": ["driver: R580 580.159.04 (open)",
               "driver_packages: nvidia-open (locked by nvidia-driver-pinning-580.159.04)",
               "cuda: 13.0 (cuda-toolkit-13-0) at 13.0.2", "cudnn: none", "fabricmanager: not needed"],
    "hgx": ["driver: R580 580.159.04 (open)",
            "driver_packages: nvidia-open (locked by nvidia-driver-pinning-580.159.04)",
            "cuda: 13.0 (cuda-toolkit-13-0) at 13.0.2",
            "cudnn: 9.17.0 (libcudnn9-cuda-13 libcudnn9-dev-cuda-13 libcudnn9-headers-cuda-13) at 9.17.0.29",
            "fabricmanager: nvidia-fabricmanager 580.159.04"],
}
NVIDIA_STACK["hgx-cloud"] = NVIDIA_STACK["hgx"]
# Ubuntu's own driver on the dev tier (T4: Turing, open modules from R560), S35/S36
UBUNTU_DRIVER = ["source: distro", "driver: R580 580.173.02 (open)",
                 "driver_packages: nvidia-headless-no-dkms-580-server-open nvidia-utils-580-server",
                 "cuda: none", "cudnn: none", "driver_repo: the Ubuntu archive with restricted",
                 "docker_repo: the distribution's archive (docker.io)"]
# per release: the running kernel (recorded) and the module packages for it
MODULES = {
    # 22.04 on the HWE kernel 6.8.0-90-generic: a prebuilt, signed build exists (apt-cache policy),
    # the metapackage follows the installed linux-image-generic-hwe-22.04
    "22.04": "kernel_modules: linux-modules-nvidia-580-server-open-generic-hwe-22.04 "
             "linux-modules-nvidia-580-server-open-6.8.0-90-generic (prebuilt, signed: no DKMS, no MOK; "
             "kernel 6.8.0-90-generic)",
    # 24.04 on 6.8.0-60-generic: no prebuilt build for that ABI: DKMS (ubuntu-drivers' fallback)
    "24.04": "kernel_modules: nvidia-dkms-580-server-open (DKMS: kernel headers, a MOK under Secure Boot; "
             "kernel 6.8.0-60-generic)",
}
HEADERS = {"22.04": "kernel_headers: linux-headers-6.8.0-90-generic linux-headers-generic-hwe-22.04",
           "24.04": "kernel_headers: linux-headers-6.8.0-60-generic linux-headers-generic"}
SB_REFUSAL = ("REFUSED (driver): Secure Boot is enabled and no module signing key is configured: the nvidia "
              "module DKMS builds would be refused by the kernel. Fix: enroll a MOK (mokutil --import) and set "
              "driver_module_signing_key to its private key on the host")


def simulated(tier: str, release: str, **extra) -> UbuntuHost:
    """A host with the hardware the tier plans for: its first GPU model, its smallest count."""
    values = tier_defaults(tier)
    count = values["validate_gpu_count"]
    count = count if isinstance(count, int) else count[0]
    return UbuntuHost(release, [values["validate_gpu_models"][0]] * count,
                      nvswitches=4 if values["validate_nvswitch"] == "required" else 0,
                      rdma=values["validate_rdma"] == "required", **extra)


def plans(hosts: dict) -> dict[str, str]:
    """Run deploys/plan.py for each simulated host, as pyinfra's CLI does; its output per host."""
    state = make_state(hosts)
    import io
    from contextlib import redirect_stderr

    out = io.StringIO()
    with canned({name: h for name, (h, _) in hosts.items()}), redirect_stderr(out):
        for name in hosts:
            with on_host(state, name):
                runpy.run_path(str(REPO / "deploys" / "plan.py"))
    return {name: body for name, body in re.findall(r"--> Plan for (\S+)\n((?:    .*\n)+)", out.getvalue())}


TIERS = list(tier_names())


@pytest.mark.parametrize("release", RELEASES)
def test_every_tier_plans_ubuntu_packages_and_repositories(release):
    hosts = {f"{tier}-{release}": (simulated(tier, release), {"tier": tier, "validate_os_release": f"ubuntu-{release}"})
             for tier in TIERS}
    got = plans(hosts)
    assert set(got) == set(hosts)
    codename = CODENAME[release]
    cuda_line = (f"driver_repo (/etc/apt/sources.list.d/gpufleet-cuda.list): deb [signed-by={CUDA_KEYRING}] "
                 f"https://developer.download.nvidia.com/compute/cuda/repos/ubuntu{release.replace('.', '')}/x86_64/ /")
    docker_line = ("docker_repo (/etc/apt/sources.list.d/gpufleet-docker.list): deb [arch=amd64 signed-by="
                   f"/etc/apt/keyrings/gpufleet-docker.gpg] https://download.docker.com/linux/ubuntu {codename} stable")
    for tier in TIERS:
        lines = got[f"{tier}-{release}"].splitlines()
        lines = [ln.strip() for ln in lines]
        assert f"os: ubuntu-{release}" in lines
        assert TOOLKIT_LINE in lines and TOOLKIT in lines
        if tier == "dev":
            for want in [*UBUNTU_DRIVER, MODULES[release]]:
                assert want in lines, (tier, release, want, lines)
            assert not any(ln.startswith("REFUSED") for ln in lines), lines
            continue
        for want in ["source: nvidia", *NVIDIA_STACK[tier], cuda_line, docker_line, HEADERS[release]]:
            assert any(ln == want or ln.startswith(want + " (DKMS") for ln in lines), (tier, release, want, lines)
        refused = [ln for ln in lines if ln.startswith("REFUSED")]
        if release == "22.04":  # the recorded 22.04 host has Secure Boot on and NVIDIA's modules are DKMS-built
            assert len(refused) == 1 and refused[0].startswith(SB_REFUSAL), refused
        else:
            assert not refused, refused


def test_dev_tier_planned_on_debian_resolves_ubuntus_driver_on_an_ubuntu_host():
    # tiers.yaml plans dev on debian-12; on an Ubuntu host the deploy resolves for the host's OS
    hosts = {f"dev-{r}": (simulated("dev", r), {"tier": "dev"}) for r in RELEASES}
    got = plans(hosts)
    for release in RELEASES:
        lines = [ln.strip() for ln in got[f"dev-{release}"].splitlines()]
        assert "driver: R580 580.173.02 (open)" in lines and MODULES[release] in lines, lines
        assert not any(ln.startswith("REFUSED") for ln in lines), lines
        # the driver deploy's own plan (gpufleet/plans/driver.py), not a second derivation of it
        assert "driver_change: Install driver 580.173.02 (open)" in lines, lines


def test_secure_boot_on_ubuntu_prebuilt_needs_no_mok_dkms_uses_ubuntus_mok_pair():
    key = "/var/lib/shim-signed/mok/MOK.priv"
    files = {key: True, "/var/lib/shim-signed/mok/MOK.der": True}
    hosts = {
        "dev-22.04": (simulated("dev", "22.04"), {"tier": "dev"}),  # prebuilt: Secure Boot is fine as it is
        "research-22.04": (simulated("research", "22.04", files=files),
                           {"tier": "research", "driver_module_signing_key": key}),
        "render-22.04": (simulated("render", "22.04", files={key: True}),  # the .der is missing
                         {"tier": "render", "driver_module_signing_key": key}),
    }
    got = {name: [ln.strip() for ln in body.splitlines()] for name, body in plans(hosts).items()}
    assert "secure_boot: enabled (modules prebuilt and signed by the distribution: no MOK)" in got["dev-22.04"]
    assert (f"secure_boot: enabled (DKMS signs with the MOK {key}, certificate /var/lib/shim-signed/mok/MOK.der)"
            in got["research-22.04"])
    assert not any(ln.startswith("REFUSED") for ln in got["research-22.04"])
    assert any(ln.startswith("REFUSED (driver): Secure Boot is enabled and the certificate of the module signing key, "
                             "/var/lib/shim-signed/mok/MOK.der, does not exist") for ln in got["render-22.04"])


def test_the_plan_runs_no_command_and_asks_only_recorded_facts():
    hosts = {"dev-24.04": (simulated("dev", "24.04"), {"tier": "dev"})}
    state = make_state(hosts)
    with canned({n: h for n, (h, _) in hosts.items()}) as asked:
        with on_host(state, "dev-24.04"):
            import io
            from contextlib import redirect_stderr

            with redirect_stderr(io.StringIO()):
                runpy.run_path(str(REPO / "deploys" / "plan.py"))
    assert "AptCandidates[('packages', ['linux-modules-nvidia-580-server-open-6.8.0-60-generic'])]" in asked
    assert "PackageVersions[('packages', ['linux-image-generic', 'linux-image-generic-hwe-24.04'])]" in asked


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("flavour", ["open", "proprietary"])
def test_compat_shows_the_prebuilt_modules_per_kernel_flavour(release, flavour):
    """tools/compat for Ubuntu's own driver names the prebuilt, signed module packages per kernel
    flavour (S35: -generic and -generic-hwe-NN.04), the build per kernel ABI, and the DKMS fallback."""
    from gpufleet.apps.compat import OPTIONS, answer, render
    from gpufleet.catalog.gpus import model_for_name

    wishes = {key: default for key, (_, default) in OPTIONS.items()} | {
        "driver_source": "distro", "driver_flavour": flavour}
    out = answer([model_for_name("Tesla T4")], f"ubuntu-{release}", wishes)
    series = "580-server-open" if flavour == "open" else "580-server"
    assert out["driver"]["modules"] == {
        "prebuilt": {"generic": f"linux-modules-nvidia-{series}-generic",
                     f"generic-hwe-{release}": f"linux-modules-nvidia-{series}-generic-hwe-{release}"},
        "prebuilt_kernel": f"linux-modules-nvidia-{series}-<uname -r>",
        "dkms": f"nvidia-dkms-{series}"}
    text = render(out)
    assert (f"modules: prebuilt, signed (Secure Boot without a MOK), per kernel flavour: linux-modules-nvidia-{series}-generic "
            f"(generic), linux-modules-nvidia-{series}-generic-hwe-{release} (generic-hwe-{release})") in text
    assert f"else nvidia-dkms-{series} (DKMS)" in text
    # NVIDIA's repository: its DKMS packages are the driver's own; no modules line
    nvidia = answer([model_for_name("Tesla T4")], f"ubuntu-{release}", wishes | {"driver_source": "nvidia"})
    assert "modules" not in nvidia["driver"] and "modules:" not in render(nvidia)


def test_the_plan_view_says_which_networks_each_host_trusts_for_training():
    """firewall_cluster_cidrs (issue 30): the plan view's 'training peers:' line, and the warning
    of a multi-node tier without them."""
    hosts = {"hgx-peers": (simulated("hgx", "24.04"), {"tier": "hgx", "validate_os_release": "ubuntu-24.04",
                                                        "firewall_cluster_cidrs": ["10.10.0.0/16"]}),
             "research-alone": (simulated("research", "24.04"), {"tier": "research"}),
             "dev": (simulated("dev", "24.04"), {"tier": "dev"})}
    got = {name: [ln.strip() for ln in body.splitlines()] for name, body in plans(hosts).items()}
    assert ("training peers: 10.10.0.0/16 (firewall_cluster_cidrs): all TCP (torchrun's rendezvous, 29500 by "
            "default, and NCCL's ephemeral ports), RoCEv2 (4791/udp)") in got["hgx-peers"]
    assert not any(ln.startswith("WARNING") for ln in got["hgx-peers"])
    assert ("training peers: none: training peers reach only the tier's open ports (firewall_open_ports)"
            in got["research-alone"])
    assert any(ln.startswith("WARNING: tier research trains across hosts (nccl_profile: roce) but "
                             "firewall_cluster_cidrs is empty") for ln in got["research-alone"]), got["research-alone"]
    assert not any(ln.startswith("WARNING") for ln in got["dev"])
