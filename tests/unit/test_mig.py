"""gpu_mig (issue 32): its grammar, the profiles per GPU model, the fit, and the plan for a host."""
from __future__ import annotations

import pytest

from gpufleet.catalog import mig
from gpufleet.facts.gpu import GpuInfo, GpuStateData, GpuStatus
from gpufleet.facts.mig import MigGpu, MigInstance, MigStateData
from gpufleet.config.schema import KEYS, BadValue

pytestmark = pytest.mark.unit

H200 = "NVIDIA H200"


def gpu(index: int, name: str = H200) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", name=name, bus_id=f"00000000:00:0{6 + index}.0", device_id=None,
                   driver_version="580.159.04", memory_mib=None, persistence=True, app_clocks=None,
                   default_app_clocks=None, max_clocks=None, compute_cap="9.0")


def state(*gpus: MigGpu) -> MigStateData:
    return MigStateData(ok=True, gpus=tuple(gpus))


def off(index: int) -> MigGpu:
    return MigGpu(index, f"00000000:00:0{6 + index}.0", "Disabled", "Disabled")


def on(index: int, *profiles: str, cis: int = 1) -> MigGpu:
    return MigGpu(index, f"00000000:00:0{6 + index}.0", "Enabled", "Enabled",
                  tuple(MigInstance(k + 1, p, 9, 4 * k, 4, cis) for k, p in enumerate(profiles)))


LAYOUT = {"all": ["3g.71gb", "3g.71gb"]}


@pytest.mark.parametrize("value, normalised", [
    ("none", "none"), ("unmanaged", "unmanaged"),
    (LAYOUT, {"all": ("3g.71gb", "3g.71gb")}),
    ({0: ["7g.141gb"], "1": ["1g.18gb+me"]}, {0: ("7g.141gb",), 1: ("1g.18gb+me",)}),
])
def test_grammar_accepts(value, normalised):
    assert dict(KEYS["gpu_mig"].validate(value)) == normalised if not isinstance(normalised, str) \
        else KEYS["gpu_mig"].validate(value) == normalised


@pytest.mark.parametrize("value, problem", [
    ("off", "unknown value"), ({}, "expected none"), ({"all": []}, "1 to 8 profiles"),
    ({"all": ["3g"]}, "not a MIG profile name"), ({"gpu0": ["3g.71gb"]}, "neither 'all' nor a GPU index"),
    ({"all": ["1g.18gb"] * 9}, "1 to 8 profiles"), ({0: ["3g.71gb"], "0": ["3g.71gb"]}, "named twice"),
    ({"all": "3g.71gb"}, "expected a list"),
])
def test_grammar_refuses(value, problem):
    with pytest.raises(BadValue) as error:
        KEYS["gpu_mig"].validate(value)
    assert problem in error.value.problem and "none | unmanaged" in error.value.allowed


def test_profiles_come_from_the_compat_data():
    names = [p.name for p in mig.model_profiles(H200) or ()]
    assert names == ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert [p.name for p in mig.model_profiles("NVIDIA A100-SXM4-40GB") or ()][4] == "3g.20gb"
    assert mig.model_profiles("Tesla T4") is None and mig.model_profiles("NVIDIA L4") is None
    assert {"NVIDIA H100 80GB HBM3", "NVIDIA A30", "NVIDIA A100 80GB PCIe"} <= set(mig.mig_models())


def test_b200_and_gh200_profiles_from_nvidia_mig_parted():
    """Derived (not recorded on a real GPU): NVIDIA mig-parted's default config (compat.yaml S40)."""
    b200 = [gpu(0, "NVIDIA B200"), gpu(1, "NVIDIA B200")]
    plan = mig.plan_mig(mig.check_setting({"all": ["1g.23gb", "1g.23gb", "2g.45gb", "3g.90gb"]}), b200,
                        state(off(0), off(1)))
    # largest first does not fit (the 2g would take slices 4-5, the 1g's have no start at 7): 1g, 1g, 2g, 3g does
    assert [g.wanted for g in plan.changes] == [("1g.23gb", "1g.23gb", "2g.45gb", "3g.90gb")] * 2
    with pytest.raises(mig.MigRefusal, match="has no MIG profile 3g.71gb"):
        mig.plan_mig(mig.check_setting(LAYOUT), b200, state(off(0), off(1)))
    assert [p.name for p in mig.model_profiles("NVIDIA GH200 144G HBM3e") or ()][-1] == "7g.144gb"
    from gpufleet.catalog.compat import compat_data

    # named as the GPU catalogue names them (nvidia-smi's names)
    assert {"NVIDIA B200", "NVIDIA GH200 144G HBM3e"} <= {g["name"] for g in compat_data().gpus_raw}


def test_plan_enables_and_partitions_then_is_a_no_op():
    setting = mig.check_setting(LAYOUT)
    plan = mig.plan_mig(setting, [gpu(0), gpu(1)], state(off(0), off(1)))
    assert [g.entry for g in plan.changes] == ["0=3g.71gb,3g.71gb", "1=3g.71gb,3g.71gb"]
    assert plan.mig_buses == {"00000000:00:06.0", "00000000:00:07.0"}
    assert plan.summary() == "GPU 0, 1: 3g.71gb + 3g.71gb"
    done = mig.plan_mig(setting, [gpu(0), gpu(1)], state(on(0, "3g.71gb", "3g.71gb"), on(1, "3g.71gb", "3g.71gb")))
    assert done.changes == ()
    # an instance without its compute instance (lost half way) is redone
    half = mig.plan_mig(setting, [gpu(0)], state(on(0, "3g.71gb", "3g.71gb", cis=0)))
    assert [g.index for g in half.changes] == [0]


def test_index_wins_over_all_and_none_turns_mig_off():
    setting = mig.check_setting({"all": ["3g.71gb", "3g.71gb"], 1: ["7g.141gb"]})
    plan = mig.plan_mig(setting, [gpu(0), gpu(1)], state(off(0), off(1)))
    assert [g.entry for g in plan.gpus] == ["0=3g.71gb,3g.71gb", "1=7g.141gb"]
    plan = mig.plan_mig("none", [gpu(0), gpu(1)], state(on(0, "3g.71gb"), off(1)))
    assert [(g.entry, g.change) for g in plan.gpus] == [("0=none", True), ("1=none", False)]
    assert mig.plan_mig("none", [gpu(0)], state(off(0))).changes == ()
    assert mig.plan_mig("unmanaged", [gpu(0)], state(on(0, "3g.71gb"))).gpus == ()


@pytest.mark.parametrize("layout, gpus, problem, allowed", [
    ({"all": ["3g.40gb"]}, [gpu(0)], "GPU 0 NVIDIA H200 (00000000:00:06.0) has no MIG profile 3g.40gb",
     "1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb"),
    ({"all": ["1g.5gb"]}, [gpu(0, "Tesla T4")], "GPU 0 Tesla T4 (00000000:00:06.0) has no MIG", "none | unmanaged"),
    ({"all": ["4g.71gb", "4g.71gb"]}, [gpu(0)], "takes at most 1 x 4g.71gb, not 2", "4g.71gb (at most 1)"),
    ({"all": ["7g.141gb", "1g.18gb"]}, [gpu(0)], "7g.141gb + 1g.18gb does not fit GPU 0", "a layout whose slices fit"),
    ({3: ["3g.71gb"]}, [gpu(0)], "names GPU 3, which this host does not have", "all, or the host's GPU indices"),
])
def test_refusals_name_the_gpu_and_what_is_allowed(layout, gpus, problem, allowed):
    with pytest.raises(mig.MigRefusal) as error:
        mig.plan_mig(mig.check_setting(layout), gpus, state(*(off(g.index) for g in gpus)))
    assert problem in error.value.problem and allowed in error.value.allowed, (error.value.problem, error.value.allowed)


def test_creation_order_is_one_the_driver_can_place():
    profiles = mig.model_profiles(H200) or ()
    # largest first would put the 3g at 0 and leave the second 2g nowhere: 3g at 4 it is
    assert mig.creation_order(["2g.35gb", "2g.35gb", "3g.71gb"], profiles) == ("2g.35gb", "2g.35gb", "3g.71gb")
    assert mig.creation_order(["1g.18gb", "4g.71gb", "2g.35gb"], profiles) == ("4g.71gb", "2g.35gb", "1g.18gb")
    assert mig.creation_order(["1g.18gb", "4g.71gb", "3g.71gb"], profiles) is None   # 8 compute slices of 7
    assert mig.creation_order(["1g.18gb"] * 7, profiles) == ("1g.18gb",) * 7
    assert mig.creation_order(["1g.18gb"] * 8, profiles) is None


# --- the no-op's MIG modes from GpuState's query (issue 31) --------------------------------


def gpu_state_with(modes: MigStateData | None, count: int = 2, status: GpuStatus = "ok") -> GpuStateData:
    return GpuStateData(status=status, gpus=[gpu(i) for i in range(count)] if status == "ok" else [], mig_modes=modes)


def test_modes_from_gpu_states_query_stand_for_mig_state_only_with_mig_off_everywhere():
    from gpufleet.config.hostfacts import mig_from_gpu_state

    no_mig = MigGpu(1, "00000000:00:07.0", None, None)  # a GPU without MIG: N/A
    both_off = state(off(0), off(1))
    assert mig_from_gpu_state(gpu_state_with(both_off)) == both_off
    assert mig_from_gpu_state(gpu_state_with(state(off(0), no_mig))) == state(off(0), no_mig)
    # MIG on, or pending (on after the next reset), on any GPU: MigState lists the instances
    assert mig_from_gpu_state(gpu_state_with(state(off(0), MigGpu(1, "00000000:00:07.0", "Enabled", "Enabled")))) is None
    assert mig_from_gpu_state(gpu_state_with(state(MigGpu(0, "00000000:00:06.0", "Disabled", "Enabled"), off(1)))) is None
    assert mig_from_gpu_state(gpu_state_with(state(MigGpu(0, "00000000:00:06.0", "Enabled", "Disabled"), off(1)))) is None
    # not asked (an older answer), not answered, not one line per GPU, or nvidia-smi failed
    assert mig_from_gpu_state(gpu_state_with(None)) is None
    assert mig_from_gpu_state(gpu_state_with(MigStateData(ok=False))) is None
    assert mig_from_gpu_state(gpu_state_with(state(off(0)))) is None
    assert mig_from_gpu_state(gpu_state_with(both_off, status="mismatch")) is None
