"""Unit: the decisions of deploys/tuning.py (gpufleet/plans/tuning.py): clock pair per GPU and the
nvidia-smi commands still needed, refusals, thread counts, NCCL values and the rendered files."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gpufleet.facts.gpu import ClockPair, GpuInfo, parse_query_gpu, parse_supported_clocks
from gpufleet.facts.gpu_tuning import parse_locked_clocks
from gpufleet.facts.network import NetInterface, RdmaDevice, RdmaPort
from gpufleet.plans import tuning as t
from gpufleet.config.failures import Refused

pytestmark = pytest.mark.unit

H200_SUPPORTED = {3201: list(range(1980, 344, -15)), 2201: list(range(1980, 344, -15))}
A100_SUPPORTED = {1215: list(range(1410, 209, -15))}
T4_SUPPORTED = {5001: list(range(1590, 299, -15)), 405: list(range(645, 299, -15))}


def gpu(index=0, name="NVIDIA A100-SXM4-40GB", cc="8.0", app=(1215, 1095), default=(1215, 1095), persistence=True,
        bus=None):
    return GpuInfo(index=index, uuid=f"GPU-{index}", name=name, bus_id=bus or f"00000000:00:{6 + index:02X}.0",
                   device_id=None, driver_version="580.159.04", memory_mib=None, persistence=persistence,
                   app_clocks=ClockPair(*app) if app else None,
                   default_app_clocks=ClockPair(*default) if default else None,
                   max_clocks=None, compute_cap=cc)


def supported(*gpus_and_lists):
    return {g.bus_id: s for g, s in gpus_and_lists}


# --- clock choice -------------------------------------------------------------------------------


def test_max_is_the_highest_pair_of_each_gpus_own_list():
    assert t.choose_pair("max", H200_SUPPORTED, "h200") == ClockPair(3201, 1980)
    assert t.choose_pair("max", A100_SUPPORTED, "a100") == ClockPair(1215, 1410)
    assert t.choose_pair("max", T4_SUPPORTED, "t4") == ClockPair(5001, 1590)
    # the highest memory clock wins even when a lower one allows a higher graphics clock
    assert t.choose_pair("max", {877: [1530, 1312], 405: [1600]}, "x") == ClockPair(877, 1530)


def test_explicit_pair_must_be_in_the_supported_list():
    assert t.choose_pair({"memory": 3201, "graphics": 1785}, H200_SUPPORTED, "h200") == ClockPair(3201, 1785)
    with pytest.raises(Refused) as e:
        t.choose_pair({"memory": 1234, "graphics": 999}, H200_SUPPORTED, "GPU 0 NVIDIA H200 (00000000:00:06.0)")
    r = e.value
    assert r.key == "clock_policy"
    assert "memory 1234 MHz, graphics 999 MHz is not supported by GPU 0 NVIDIA H200 (00000000:00:06.0)" in r.problem
    assert r.allowed == ("memory 3201 with graphics 1980..345 (step 15); memory 2201 with graphics 1980..345 (step 15); "
                         "or max | default | unmanaged")
    with pytest.raises(Refused):  # a graphics clock between two steps
        t.choose_pair({"memory": 1215, "graphics": 1400}, A100_SUPPORTED, "a100")


def test_gpu_without_supported_clocks_is_refused():
    with pytest.raises(Refused) as e:
        t.choose_pair("max", {}, "GPU 0 X")
    assert "reports no supported clocks" in e.value.problem and e.value.allowed == "default | unmanaged"


def test_method_by_driver_branch():
    assert t.clock_method("580.159.04", 595) == t.AC
    assert t.clock_method("595.45.04", 595) == t.LGC
    assert t.clock_method("610.1", 595) == t.LGC
    assert t.clock_method(None, 595) == t.AC


# --- plans: only what is needed -------------------------------------------------------------------


def test_mixed_gpus_get_their_own_max_and_only_the_ones_not_there_get_a_command():
    a = gpu(0, app=(1215, 1095))
    h = gpu(1, name="NVIDIA H200", cc="9.0", app=(3201, 1980), default=(3201, 1980))
    plans = t.plan_clocks("max", [a, h], supported((a, A100_SUPPORTED), (h, H200_SUPPORTED)), "580.159.04", {}, 595)
    assert [p.target for p in plans] == [ClockPair(1215, 1410), ClockPair(3201, 1980)]
    assert plans[0].commands == (("-i", a.bus_id, "-ac", "1215,1410"),)
    assert plans[1].commands == ()  # already at its max
    assert [p.entry for p in plans] == [f"{a.bus_id}=1215,1410", f"{h.bus_id}=3201,1980"]


def test_converged_gpus_need_nothing():
    a = gpu(0, app=(1215, 1410))
    plans = t.plan_clocks("max", [a], supported((a, A100_SUPPORTED)), "580.159.04", {}, 595)
    assert plans[0].commands == () and plans[0].record is None


def test_r595_locks_clocks_and_records_them():
    a = gpu(0, app=None, default=None)
    plans = t.plan_clocks("max", [a], supported((a, A100_SUPPORTED)), "595.45.04", {}, 595)
    assert plans[0].method == t.LGC
    assert plans[0].commands == (("-i", a.bus_id, "-lgc", "1410,1410"), ("-i", a.bus_id, "-lmc", "1215,1215"))
    assert plans[0].record == "1215,1410"
    again = t.plan_clocks("max", [a], supported((a, A100_SUPPORTED)), "595.45.04", {a.bus_id: "1215,1410"}, 595)
    assert again[0].commands == () and again[0].record is None


def test_default_resets_only_gpus_not_at_default():
    a, b = gpu(0, app=(1215, 1410)), gpu(1, app=(1215, 1095))
    plans = t.plan_clocks("default", [a, b], {}, "580.159.04", {}, 595)
    assert [p.commands for p in plans] == [(("-i", a.bus_id, "-rac"),), ()]
    assert [p.entry for p in plans] == [f"{a.bus_id}=default", f"{b.bus_id}=default"]
    locked = t.plan_clocks("default", [a], {}, "595.45.04", {a.bus_id: "1215,1410"}, 595)
    assert locked[0].commands == (("-i", a.bus_id, "-rgc"), ("-i", a.bus_id, "-rmc")) and locked[0].record == ""
    assert t.plan_clocks("default", [a], {}, "595.45.04", {}, 595)[0].commands == ()


def test_unmanaged_plans_nothing():
    a = gpu(0, app=(1215, 1410))
    assert t.plan_clocks("unmanaged", [a], {}, "580.159.04", {}, 595) == []


def test_t4_on_r595_has_no_settable_pair():
    t4 = gpu(0, name="Tesla T4", cc="7.5", app=None, default=None)
    with pytest.raises(Refused) as e:
        t.plan_clocks("max", [t4], supported((t4, T4_SUPPORTED)), "595.45.04", {}, 595)
    msg = str(e.value)
    assert msg.startswith("key 'clock_policy': GPU 0 Tesla T4 (00000000:00:06.0) (compute capability 7.5) "
                          "has no settable clock pair on driver 595.45.04")
    assert "memory clocks can only be locked (-lmc) on Ampere or newer" in msg
    assert msg.endswith("allowed: default | unmanaged")
    # default and unmanaged stay possible
    assert t.plan_clocks("default", [t4], {}, "595.45.04", {}, 595)[0].commands == ()


def test_gpu_without_application_clocks_before_r595_is_refused():
    g = gpu(0, app=None, default=None)
    with pytest.raises(Refused, match="does not report application clocks"):
        t.plan_clocks("max", [g], supported((g, A100_SUPPORTED)), "580.159.04", {}, 595)


def test_plan_from_recorded_h200_output():
    base = Path("tests/fixtures/facts/h200-x2")
    gpus = parse_query_gpu(base.joinpath("query-gpu-csv.txt").read_text().splitlines())
    clocks = parse_supported_clocks(base.joinpath("q-supported-clocks.txt").read_text().splitlines())
    plans = t.plan_clocks("max", gpus, clocks, "580.159.04", {}, 595)
    assert [p.target for p in plans] == [ClockPair(3201, 1980)] * 2
    assert all(p.commands == () for p in plans)  # the recorded hosts run at their max already


def test_locked_clock_records():
    assert parse_locked_clocks(["00000000:00:06.0 1215,1410", ""]) == {"00000000:00:06.0": "1215,1410"}


# --- threads --------------------------------------------------------------------------------------


@pytest.mark.parametrize("setting,cores,gpus,expected", [
    ("auto", 64, 8, 8), ("auto", 2, 4, 1), ("auto", 2, 2, 1), ("auto", 2, 1, 2), ("auto", 30, 4, 7),
    ("auto", 16, 0, 16), (4, 64, 8, 4), (1, 2, 1, 1),
])
def test_omp_threads(setting, cores, gpus, expected):
    assert t.omp_threads(setting, cores, gpus) == expected


# --- NCCL -----------------------------------------------------------------------------------------


def nic(name, state="up", kind=1, device=None):
    return NetInterface(name=name, operstate=state, mac=None, mtu=1500, type=kind, device=device, driver=None)


def hca(name, layer="InfiniBand"):
    return RdmaDevice(name=name, pci_slot=None, node_guid=None, fw_ver=None,
                      ports=[RdmaPort(port=1, link_layer=layer, state="ACTIVE", phys_state="LinkUp", rate=None)])


def test_socket_interface_from_real_nics():
    # a container: eth0 is up (no device behind it), ifb plumbing is down
    assert t.socket_ifname("auto", [nic("eth0"), nic("ifb0", "down"), nic("ifb1", "down")]) == "=eth0"
    # physical NICs beat virtual ones; bonds beat everything; IPoIB only without Ethernet
    assert t.socket_ifname("auto", [nic("ens5", device="0000:00:05.0"), nic("vlan7")]) == "=ens5"
    assert t.socket_ifname("auto", [nic("bond0"), nic("ens1f0", device="0000:3b:00.0")]) == "=bond0"
    assert t.socket_ifname("auto", [nic("ib0", kind=32)]) == "=ib0"
    assert t.socket_ifname("auto", [nic("eth0", "down"), nic("dummy0")]) is None


def test_tier_interface_must_exist():
    assert t.socket_ifname("=eth0", [nic("eth0")]) == "=eth0"
    assert t.socket_ifname("en", [nic("ens5")]) == "en"
    assert t.socket_ifname("^docker", [nic("ens5")]) == "^docker"
    with pytest.raises(Refused) as e:
        t.socket_ifname("=bond0", [nic("eth0"), nic("ifb0", "down")])
    assert e.value.key == "tuning_nccl_socket_ifname"
    assert "names bond0, which this host does not have" in e.value.problem
    assert e.value.allowed == "auto, or =eth0, =ifb0"
    with pytest.raises(Refused, match="not an interface for NCCL"):
        t.socket_ifname("=lo", [nic("lo")])


def test_ib_hca():
    devices = [hca("mlx5_1"), hca("mlx5_0"), hca("mlx5_2", "Ethernet")]
    assert t.ib_hca("auto", "ib", devices) == "=mlx5_0,mlx5_1"
    assert t.ib_hca("auto", "roce", devices) == "=mlx5_2"
    assert t.ib_hca("auto", "tcp", devices) is None
    assert t.ib_hca("auto", "ib", []) is None
    assert t.ib_hca("=mlx5_0:1", "ib", devices) == "=mlx5_0:1"
    with pytest.raises(Refused, match="mlx5_9"):
        t.ib_hca("=mlx5_9", "ib", devices)


def render_nccl(profile, debug=False, rdma=False, ifname="=eth0", hca=None):
    variables = t.nccl_variables(profile, ifname, hca, rdma, debug)
    return t.render_profiles("hgx", profile, variables, t.gpu_environment(8, "expandable_segments:True"), rdma)[
        "/etc/nccl.conf"]


def settings_lines(text):
    return [line for line in text.splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("profile", ["ib", "roce", "tcp", "efa"])
def test_nccl_profiles_render_without_debug_variables(profile):
    text = render_nccl(profile, rdma=True, hca="=mlx5_0,mlx5_1")
    assert text.startswith("# Managed by gpufleet (deploys/tuning.py) for tier hgx.")
    assert f"Network profile: {profile}" in text
    lines = settings_lines(text)
    assert lines[0] == "NCCL_SOCKET_IFNAME==eth0"
    assert ("NCCL_IB_HCA==mlx5_0,mlx5_1" in lines) == (profile in ("ib", "roce"))
    for name in t.NCCL_DEBUG_ONLY:
        assert not any(line.startswith(name + "=") for line in lines), name


def test_nccl_debug_variables_only_when_asked():
    assert settings_lines(render_nccl("tcp", debug=True, rdma=True)) == [
        "NCCL_SOCKET_IFNAME==eth0", "NCCL_DEBUG=WARN", "NCCL_IB_DISABLE=1"]
    assert settings_lines(render_nccl("ib", debug=True, rdma=False, hca=None)) == [
        "NCCL_SOCKET_IFNAME==eth0", "NCCL_DEBUG=WARN"]
    assert "No RDMA device was found" in render_nccl("ib", rdma=False)


def test_environment_files():
    env = t.gpu_environment(3, "expandable_segments:True,roundup_power2_divisions:[256:1,>:8]")
    files = t.render_profiles("research", "roce", [], env, False)
    for path, text in files.items():
        assert text.startswith("# Managed by gpufleet (deploys/tuning.py) for tier research."), path
    profile = files["/etc/profile.d/gpufleet-gpu.sh"]
    # values quoted by shlex.quote where the shell needs it
    assert "if [ -z \"${OMP_NUM_THREADS:-}\" ]; then OMP_NUM_THREADS=3; fi\nexport OMP_NUM_THREADS\n" in profile
    assert "MKL_NUM_THREADS=3;" in profile and "CUDA_DEVICE_ORDER=PCI_BUS_ID;" in profile
    assert profile.count("'expandable_segments:True,roundup_power2_divisions:[256:1,>:8]'") == 2
    # what a login shell gets from it (sh reads the file as written, no value already set)
    shell = subprocess.run(["sh", "-c", '. "$1"; echo "$OMP_NUM_THREADS|$PYTORCH_ALLOC_CONF|$CUDA_DEVICE_ORDER"', "sh",
                            "/dev/stdin"], input=profile, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"},
                           check=True)
    assert shell.stdout == "3|expandable_segments:True,roundup_power2_divisions:[256:1,>:8]|PCI_BUS_ID\n"
    unit = files["/etc/systemd/system.conf.d/gpufleet-gpu-env.conf"]
    assert ('[Manager]\nDefaultEnvironment="CUDA_DEVICE_ORDER=PCI_BUS_ID" "OMP_NUM_THREADS=3" "MKL_NUM_THREADS=3" '
            '"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,roundup_power2_divisions:[256:1,>:8]" '
            '"PYTORCH_ALLOC_CONF=expandable_segments:True,roundup_power2_divisions:[256:1,>:8]"\n') in unit
    assert "OMP_NUM_THREADS=3\n" in files["/etc/environment.d/60-gpufleet-gpu.conf"]
    # an empty allocator setting leaves both PyTorch variables out
    assert [n for n, _ in t.gpu_environment(1, "")] == ["CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]


def test_profile_script_runs_in_sh_and_keeps_preset_values(tmp_path):
    import subprocess
    env = t.gpu_environment(3, "expandable_segments:True")
    script = tmp_path / "p.sh"
    script.write_text(t.render_profiles("dev", "tcp", [], env, False)["/etc/profile.d/gpufleet-gpu.sh"])
    out = subprocess.run(["sh", "-c", f". {script}; echo $OMP_NUM_THREADS $PYTORCH_ALLOC_CONF $CUDA_DEVICE_ORDER"],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    assert out == "3 expandable_segments:True PCI_BUS_ID\n"
    out = subprocess.run(["sh", "-c", f". {script}; echo $OMP_NUM_THREADS"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "7"}, check=True).stdout
    assert out == "7\n"


def test_clock_files_render(tmp_path):
    import subprocess
    a = gpu(0, app=(1215, 1095))
    plans = t.plan_clocks("max", [a], supported((a, A100_SUPPORTED)), "580.159.04", {}, 595)
    ctx = dict(tier="research", policy="max", plans=plans, ac_deprecated_from=595, record_dir="/run/gpufleet/gpu-clocks",
               legacy_persistence=False, persistence_daemon=True)
    env = t.render("etc/gpufleet/gpu-clocks.env.j2", **ctx)
    assert env.startswith("# Managed by gpufleet (deploys/tuning.py) for tier research.")
    assert 'GPUFLEET_GPU_CLOCKS="00000000:00:06.0=1215,1410"\n' in env
    unit = t.render("etc/systemd/system/gpufleet-gpu-clocks.service.j2", **ctx)
    assert "After=nvidia-persistenced.service" in unit and "Wants=nvidia-persistenced.service" in unit
    assert "Type=oneshot" in unit and "WantedBy=multi-user.target" in unit
    script = tmp_path / "s"
    script.write_text(t.render("usr/local/sbin/gpufleet-gpu-clocks.j2", **ctx))
    assert subprocess.run(["sh", "-n", str(script)]).returncode == 0
