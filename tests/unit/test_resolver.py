"""One test per resolver rule, each accepting and refusing, with real GPU models."""

from __future__ import annotations

import pytest

from gpufleet.errors import Incompatible
from gpufleet.facts.gpu import ClockPair
from gpufleet.catalog.gpus import model_for_name
from gpufleet.config.resolver import Resolution, check_tier_hardware, resolve
from gpufleet.catalog.tiers import tier_defaults

pytestmark = pytest.mark.unit

UBUNTU = ("ubuntu", "24.04")
H100, H200, B200, GB200 = "0x2330", "0x2335", "0x2901", "0x2941"
A100, T4, V100, K80, L4, RTX3080 = "0x20b0", "0x1eb8", "0x1db1", "0x102d", "0x27b8", "0x2206"
H100_NVSWITCH = "0x22a3"


def wish(**overrides) -> dict:
    base = {
        "driver_source": "nvidia",
        "driver_branch": "580",
        "driver_version": "auto",
        "driver_flavour": "auto",
        "cuda_version": "none",
        "cuda_driver_compat": "toolkit",
        "cudnn_version": "none",
        "clock_policy": "default",
    }
    base.update(overrides)
    return base


def refused(gpus, wishes, os_release=UBUNTU, **kw) -> Incompatible:
    with pytest.raises(Incompatible) as info:
        resolve(gpus, wishes, os_release, **kw)
    return info.value


# --- CUDA minimum driver ------------------------------------------------------------------------


def test_cuda_family_floor():
    ok = resolve([A100], wish(driver_branch="570", cuda_version="12.8"), UBUNTU)
    assert ok.cuda_package == "cuda-toolkit-12-8"
    err = refused([A100], wish(driver_branch="570", cuda_version="13.0"))
    assert err.key == "cuda_version" and "needs driver >= 580" in err.reason
    assert "12.8" in err.allowed and "13.0" not in err.allowed


def test_cuda_toolkit_driver_table3_vs_minor_compat():
    err = refused([H100], wish(cuda_version="13.2"))
    assert err.key == "cuda_version" and "595.71.05" in err.reason
    ok = resolve([H100], wish(cuda_version="13.2", cuda_driver_compat="minor"), UBUNTU)
    assert ok.cuda_version == "13.2" and any("minor-version compatibility" in n for n in ok.notes)
    # the toolkit rule uses the driver of the update installed: on 580.82.07 "13.0" is 13.0 Update 1
    # (S1 Table 3: >= 580.82.07), and Update 2 (>= 580.95.05), asked by name, is refused
    assert resolve([H100], wish(cuda_version="13.0", driver_version="580.82.07"), UBUNTU).cuda_release == "13.0.1"
    err = refused([H100], wish(cuda_version="13.0.2", driver_version="580.82.07"))
    assert err.key == "cuda_version" and "580.95.05" in err.reason and "13.0.1" in err.allowed


def test_cuda13_drops_compute_capability_below_7_5():
    assert resolve([T4], wish(cuda_version="13.0"), UBUNTU).cuda_version == "13.0"
    err = refused([V100], wish(cuda_version="13.0"))
    assert err.key == "cuda_version" and "7.5" in err.reason and "Tesla V100-SXM2-16GB" in err.reason


def test_blackwell_needs_cuda_12_8():
    assert resolve([B200], wish(driver_branch="570", cuda_version="12.8"), UBUNTU).cuda_version == "12.8"
    err = refused([B200], wish(driver_branch="570", cuda_version="12.6"))
    assert "needs CUDA >= 12.8" in err.reason


# --- cuDNN --------------------------------------------------------------------------------------


def test_cudnn_against_cuda_major():
    ok = resolve([A100], wish(cuda_version="13.0", cudnn_version="9.17.0"), UBUNTU)
    assert (ok.cudnn_version, ok.cudnn_package) == ("9.17.0", "libcudnn9-cuda-13")
    old = resolve([A100], wish(cuda_version="11.8", cudnn_version="9.10.2"), UBUNTU)
    assert old.cudnn_package == "libcudnn9-cuda-11"
    err = refused([A100], wish(cuda_version="11.8", cudnn_version="9.17.0"))
    assert err.key == "cudnn_version" and "no verified build for CUDA 11" in err.reason
    err = refused([A100], wish(cuda_version="13.0", cudnn_version="9.10.2"))
    assert err.key == "cudnn_version" and "no verified build for CUDA 13" in err.reason
    assert "9.17.0" in err.allowed


def test_cudnn_against_compute_capability():
    ok = resolve([V100], wish(cuda_version="12.8", cudnn_version="9.10.2"), UBUNTU)
    assert ok.cudnn_package == "libcudnn9-cuda-12"
    err = refused([V100], wish(cuda_version="12.8", cudnn_version="9.17.0"))
    assert err.key == "cudnn_version" and "7.0" in err.reason and err.allowed.startswith("none, 9.10.2")
    # the support matrix lists Blackwell (10.0, 12.0) for cuDNN 9.17.0's CUDA 12 build (issue 47);
    # Blackwell itself needs CUDA >= 12.8 (S6), so on 12.6 the CUDA key is refused first
    assert resolve([B200], wish(cuda_version="12.8", cudnn_version="9.17.0"), UBUNTU).cudnn_release == "9.17.0.29"
    err = refused([B200], wish(driver_branch="570", cuda_version="12.6", cudnn_version="9.17.0"))
    assert err.key == "cuda_version" and "needs CUDA >= 12.8" in err.reason
    assert resolve([B200], wish(cuda_version="12.8", cudnn_version="9.10.2"), UBUNTU).cudnn_version == "9.10.2"


def test_cudnn_needs_host_cuda():
    err = refused([A100], wish(cudnn_version="9.17.0"))
    assert err.key == "cudnn_version" and "cuda_version is none" in err.reason


# --- architecture vs driver branch --------------------------------------------------------------


def test_kepler_ends_at_r470():
    ok = resolve([K80], wish(driver_branch="470"), UBUNTU)
    assert ok.driver_version == "470.239.06" and ok.flavour == "proprietary"
    err = refused([K80], wish(driver_branch="535"))
    assert err.key == "driver_branch" and "last branch for kepler is R470" in err.reason
    assert err.allowed == "R470"


def test_volta_ends_at_r580():
    assert resolve([V100], wish(driver_branch="580"), UBUNTU).driver_branch == "580"
    err = refused([V100], wish(driver_branch="595"))
    assert "last branch for volta is R580" in err.reason


def test_blackwell_needs_r570():
    assert resolve([B200], wish(driver_branch="570"), UBUNTU).driver_version == "570.195.03"
    err = refused([B200], wish(driver_branch="535"))
    assert err.key == "driver_branch" and "blackwell" in err.reason and "R570" in err.allowed


def test_h200_needs_r550():
    assert resolve([H200], wish(driver_branch="550"), UBUNTU).driver_branch == "550"
    err = refused([H200], wish(driver_branch="535"))
    assert err.key == "driver_branch" and "NVIDIA H200 needs driver >= 550.40.65" in err.reason


# --- kernel-module flavour ----------------------------------------------------------------------


def test_blackwell_needs_open_modules():
    assert resolve([B200], wish(driver_flavour="open"), UBUNTU).flavour == "open"
    err = refused([B200], wish(driver_flavour="proprietary"))
    assert err.key == "driver_flavour" and "must use the open" in err.reason


def test_open_modules_need_turing():
    assert resolve([A100], wish(driver_flavour="open"), UBUNTU).flavour == "open"
    err = refused([V100], wish(driver_flavour="open"))
    assert err.key == "driver_flavour" and "turing or newer" in err.reason


def test_t4_open_modules_only_from_575_51_02():
    assert resolve([T4], wish(driver_flavour="open"), UBUNTU).flavour == "open"  # R580
    err = refused([T4], wish(driver_branch="570", driver_flavour="open"))
    assert "575.51.02" in err.reason


def test_auto_flavour():
    assert resolve([A100], wish(), UBUNTU).flavour == "open"  # Turing+ and R580 >= 560
    assert resolve([A100], wish(driver_branch="550"), UBUNTU).flavour == "proprietary"  # before 560
    assert resolve([V100], wish(), UBUNTU).flavour == "proprietary"  # pre-Turing
    assert resolve([T4], wish(driver_branch="570"), UBUNTU).flavour == "proprietary"  # not open-listed yet


def test_mixed_generations_keep_proprietary_or_refuse():
    mixed = resolve([V100, A100], wish(), UBUNTU)
    assert mixed.flavour == "proprietary"
    err = refused([V100, B200], wish())
    assert err.key == "driver_flavour" and "cannot share a host" in err.reason
    # intersection of branch constraints: A100 would run R595, V100 would not
    err = refused([V100, A100], wish(driver_branch="595"))
    assert "volta" in err.reason


# --- NVSwitch / Fabric Manager ------------------------------------------------------------------


def test_nvswitch_needs_fabricmanager_at_exact_driver_version():
    r = resolve([H100] * 8 + [H100_NVSWITCH] * 4, wish(), UBUNTU)
    assert r.fabricmanager_needed
    assert r.fabricmanager_package == "nvidia-fabricmanager"  # R580+: unversioned; -580 is only virtual
    assert r.fabricmanager_version == r.driver_version == "580.159.04"
    pinned = resolve([H100] * 8, wish(driver_version="580.95.05"), UBUNTU, nvswitch=True)
    assert pinned.fabricmanager_version == "580.95.05"
    assert not resolve([H100] * 8, wish(), UBUNTU).fabricmanager_needed


def test_blackwell_nvswitch_adds_nvlsm_and_grace_is_off_host():
    r = resolve([B200] * 8, wish(), UBUNTU, nvswitch=True)
    assert r.fabricmanager_needed and r.fabric_extra_packages == ("nvlsm",)
    gb = resolve([GB200] * 4, wish(), UBUNTU, nvswitch=True)
    assert not gb.fabricmanager_needed and any("off-host" in n for n in gb.notes)


# --- distribution packages ----------------------------------------------------------------------


def test_distro_debian12_and_13():
    r12 = resolve([T4], wish(driver_source="distro", driver_branch="auto", cuda_version="11.8"), ("debian", "12"))
    assert (r12.driver_branch, r12.driver_version, r12.cuda_version) == ("535", "535.309.01", "11.8")
    assert r12.cuda_package == "nvidia-cuda-toolkit" and "nvidia-driver" in r12.driver_packages
    r13 = resolve([RTX3080], wish(driver_source="distro", driver_branch="auto", cuda_version="12.4"), "debian-13")
    assert (r13.driver_version, r13.cuda_version) == ("550.163.01", "12.4")


def test_distro_refuses_what_the_os_cannot_provide():
    distro = wish(driver_source="distro", driver_branch="auto")
    assert refused([T4], distro | {"cuda_version": "12.4"}, ("debian", "12")).allowed == "none, 11.8"
    assert refused([T4], distro | {"driver_branch": "580"}, ("debian", "12")).key == "driver_branch"
    assert refused([T4], distro | {"cuda_version": "13.0"}, UBUNTU).key == "cuda_version"  # Ubuntu's toolkit: no row
    assert refused([H100] * 8, distro, UBUNTU, nvswitch=True).key == "driver_source"  # no Fabric Manager
    assert refused([A100], distro | {"cuda_version": "11.8", "cudnn_version": "9.5.1"}, "debian-12").key == "cudnn_version"
    assert refused([H100] * 8, distro, "debian-12", nvswitch=True).key == "driver_source"
    # H200 first appears in R550: Debian 12's R535 cannot drive it, Debian 13's R550 can
    assert refused([H200], distro, "debian-12").key == "driver_branch"
    assert resolve([H200], distro, "debian-13").driver_branch == "550"


# --- inputs, branches, clocks -------------------------------------------------------------------


def test_gpu_inputs():
    models = [model_for_name("NVIDIA H200")]
    assert resolve(models, wish(), UBUNTU).gpus == ("NVIDIA H200",)
    assert resolve(["NVIDIA H200", "2335"], wish(), UBUNTU).gpus == ("NVIDIA H200", "NVIDIA H200")
    assert "0x9999" in refused(["0x9999"], wish()).reason
    assert "no NVIDIA GPU" in refused([], wish()).reason


def test_auto_branch_and_unusable_branch():
    assert resolve([B200], wish(driver_branch="auto"), UBUNTU).driver_branch == "580"
    # auto only tries supported branches (compat.yaml auto_branch_preference), never EOL R470
    err = refused([K80], wish(driver_branch="auto"))
    assert err.key == "driver_branch" and err.allowed == "R470"
    assert refused([A100], wish(driver_branch="615")).key == "driver_branch"
    assert refused([A100], wish(driver_version="580.1.1")).key == "driver_version"


def test_clock_policies():
    assert resolve([H200], wish(clock_policy="max"), UBUNTU).application_clocks == {"NVIDIA H200": ClockPair(3201, 1980)}
    lower = resolve([H100], wish(clock_policy={"memory": 1593, "graphics": 1755}), UBUNTU)
    assert lower.application_clocks["NVIDIA H100 80GB HBM3"] == ClockPair(1593, 1755)
    err = refused([H100], wish(clock_policy={"memory": 2619, "graphics": 2100}))
    assert err.key == "clock_policy" and "2619,1980" in err.reason
    assert refused([H100], wish(clock_policy={"memory": 2000, "graphics": 1500})).allowed == "2619, 1593"
    assert resolve([H100], wish(driver_branch="595", clock_policy="max"), UBUNTU).clock_method == "lgc"
    assert resolve([A100], wish(clock_policy="unmanaged"), UBUNTU).clock_method == "none"


def test_eol_branch_is_noted():
    assert any("end of life" in n for n in resolve([A100], wish(driver_branch="570"), UBUNTU).notes)
    assert not resolve([A100], wish(), UBUNTU).notes


def test_resolution_describe_is_ordered():
    r = resolve([H100] * 8, wish(cuda_version="13.0", cudnn_version="9.17.0"), UBUNTU, nvswitch=True)
    assert isinstance(r, Resolution)
    assert list(r.describe())[:4] == ["source", "os_release", "gpus", "driver"]
    assert r.describe()["gpus"] == "8 x NVIDIA H100 80GB HBM3"


# --- tier vs hardware ---------------------------------------------------------------------------


def test_check_tier_hardware_matches():
    hgx = tier_defaults("hgx")
    assert check_tier_hardware(hgx, [H200] * 8, nvswitch=True, rdma=True) == []
    assert check_tier_hardware(hgx, [H200] * 8 + [H100_NVSWITCH], nvswitch=False, rdma=True) == []


def test_check_tier_hardware_mismatches():
    hgx = tier_defaults("hgx")
    problems = check_tier_hardware(hgx, [A100] * 4, nvswitch=False, rdma=False)
    assert any("expects GPU models" in p and "4 x NVIDIA A100-SXM4-40GB" in p for p in problems)
    assert any("expects 8 GPUs; found 4" in p for p in problems)
    assert any("NVSwitch" in p for p in problems)
    assert any("RDMA" in p for p in problems)
    cloud = check_tier_hardware(tier_defaults("hgx-cloud"), [H100] * 8, nvswitch=True, rdma=True)
    assert cloud == ["tier hgx-cloud expects no RDMA NICs (InfiniBand/RoCE); found one"]
    dev = check_tier_hardware(tier_defaults("dev"), ["0x9999"], nvswitch=False, rdma=False)
    assert dev == ["tier dev: GPU with PCI id 0x9999 is not in the compatibility data"]
