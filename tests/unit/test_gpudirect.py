"""GPUDirect RDMA on RDMA tiers (issue 30 item 2), on recorded and composed output: nvidia-peermem
planned, loaded at boot and checked by the gate against the loaded driver (recorded H200
DriverState, composed PeermemState cases: tests/fixtures/facts/README.md says from what); the
NCCL profile's HCAs checked against /sys/class/infiniband (composed HGX sample, kernel sysfs ABI
format), each mismatch named."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from gpufleet.plans import gpudirect as g
from gpufleet.checks import validation as v
from gpufleet.facts.kernel import DriverState, PeermemState
from gpufleet.facts.network import RdmaDevices
from tests.unit.settings_observables import FIXTURES, _lines, recorded_fact
from tests.unit.test_monitoring import settings

pytestmark = pytest.mark.unit

DRIVER = recorded_fact(DriverState, "h200_driver_loaded")  # nvidia 580.159.04 loaded (real H200 host)
HGX_HCAS = RdmaDevices().process(_lines(FIXTURES / "facts/samples/sys-class-infiniband-hgx.txt"))
LOADED = recorded_fact(PeermemState, "peermem-loaded-at-boot")
NOT_BUILT = recorded_fact(PeermemState, "peermem-not-built")
STALE = recorded_fact(PeermemState, "peermem-stale-after-upgrade")
BUILT_NOT_LOADED = dataclasses.replace(NOT_BUILT, available_version="580.159.04")


def test_peermem_is_loaded_where_the_profile_is_rdma_and_the_host_has_hcas():
    plan = g.plan_peermem("ib", HGX_HCAS, DRIVER, BUILT_NOT_LOADED)
    assert plan.wanted and plan.load_now and not plan.problem, plan
    assert g.plan_peermem("roce", HGX_HCAS, DRIVER, BUILT_NOT_LOADED).load_now
    done = g.plan_peermem("ib", HGX_HCAS, DRIVER, LOADED)
    assert done.wanted and not done.load_now and done.reason == "nvidia-peermem 580.159.04 is loaded, as the driver"


@pytest.mark.parametrize("profile, hcas, reason", [
    ("tcp", HGX_HCAS, "nccl_profile: tcp has no RDMA between hosts"),
    ("efa", HGX_HCAS, "nccl_profile: efa has no RDMA between hosts"),
    ("ib", [], "no RDMA device on this host (/sys/class/infiniband is empty)"),
])
def test_no_peermem_without_an_rdma_profile_or_hcas(profile, hcas, reason):
    assert g.plan_peermem(profile, hcas, DRIVER, NOT_BUILT) == g.PeermemPlan(False, reason)


def test_peermem_matched_to_the_loaded_driver_or_named():
    stale = g.plan_peermem("ib", HGX_HCAS, DRIVER, STALE)
    assert stale.problem == ("nvidia-peermem 580.95.05 is loaded with driver 580.159.04: reboot (or rmmod "
                             "nvidia-peermem, then modprobe nvidia-peermem) when the host is idle") and not stale.load_now
    other = g.plan_peermem("ib", HGX_HCAS, DRIVER, dataclasses.replace(BUILT_NOT_LOADED, available_version="590.44.01"))
    assert other.problem.startswith("nvidia-peermem on disk is 590.44.01, the loaded driver 580.159.04") and not other.load_now
    missing = g.plan_peermem("ib", HGX_HCAS, DRIVER, NOT_BUILT)
    assert missing.problem.startswith("no nvidia-peermem module for the running kernel (modinfo)")
    unloaded = g.plan_peermem("ib", HGX_HCAS, dataclasses.replace(DRIVER, module_version=None, loaded_modules={}),
                              BUILT_NOT_LOADED)
    assert unloaded.problem.startswith("nvidia-peermem cannot load before the nvidia module") and not unloaded.load_now


def test_the_boot_file_names_the_module_for_systemd_modules_load():
    assert g.BOOT_FILE == "/etc/modules-load.d/gpufleet-nvidia-peermem.conf"
    lines = [line for line in g.BOOT_TEXT.splitlines() if line and not line.startswith("#")]
    assert lines == ["nvidia-peermem"]


# --- HCAs --------------------------------------------------------------------------------------

def test_every_hca_listed_by_auto_is_checked_and_each_fault_named():
    problems, good = g.hca_problems("=mlx5_0,mlx5_1,mlx5_2,mlx5_3", HGX_HCAS, 400)
    assert problems == ["mlx5_1 port 1: 200 Gb/sec (4X HDR), below validate_min_nic_gbps 400",
                        "mlx5_2 port 1: link DOWN (Polling), not ACTIVE (LinkUp)"]
    assert good == ["mlx5_0 port 1 400 Gb/s", "mlx5_3 port 1 400 Gb/s"]


@pytest.mark.parametrize("setting, problems, good", [
    ("=mlx5_0:1,mlx5_3:1", [], ["mlx5_0 port 1 400 Gb/s", "mlx5_3 port 1 400 Gb/s"]),
    ("^=mlx5_1,mlx5_2", [], ["mlx5_0 port 1 400 Gb/s", "mlx5_3 port 1 400 Gb/s"]),  # all but those
    ("=mlx5_0,mlx5_7", ["mlx5_7: not on this host (it has mlx5_0, mlx5_1, mlx5_2, mlx5_3)"], ["mlx5_0 port 1 400 Gb/s"]),
    ("=mlx5_0:2", ["mlx5_0: no port 2"], []),
    ("mlx5_2", ["mlx5_2 port 1: link DOWN (Polling), not ACTIVE (LinkUp)"], []),  # a prefix, as NCCL reads it
])
def test_the_nccl_hca_list_against_the_hcas_the_host_has(setting, problems, good):
    assert g.hca_problems(setting, HGX_HCAS, 200) == (problems, good)


# --- the gate ------------------------------------------------------------------------------------

class GateContext:
    def __init__(self, settings, rdma, peermem, driver=DRIVER):
        self.settings, self.rdma, self.peermem, self.driver = settings, rdma, peermem, driver
        self.host = SimpleNamespace()

    def fact(self, cls, **kwargs):
        assert cls is PeermemState
        return self.peermem


@pytest.fixture
def hcas(monkeypatch):
    found = {"rdma": HGX_HCAS}
    monkeypatch.setattr("gpufleet.config.hostfacts.rdma_devices", lambda host: found["rdma"])
    return found


def test_the_gate_checks_peermem_on_an_rdma_tier(hcas):
    hgx = settings(tier="hgx")
    ok = v.gpudirect_rdma(GateContext(hgx, HGX_HCAS, LOADED))
    assert ok.status == "pass" and ok.message == ("nvidia-peermem 580.159.04 loaded with driver 580.159.04, and at "
                                                  "boot (/etc/modules-load.d/gpufleet-nvidia-peermem.conf)"), ok
    stale = v.gpudirect_rdma(GateContext(hgx, HGX_HCAS, STALE))
    assert stale.status == "fail" and "580.95.05 is loaded with driver 580.159.04" in stale.message
    assert stale.fix == "reboot the host when it is idle"
    unloaded = v.gpudirect_rdma(GateContext(hgx, HGX_HCAS, BUILT_NOT_LOADED))
    assert unloaded.status == "fail" and unloaded.message.startswith("nvidia-peermem is not loaded")
    no_boot = v.gpudirect_rdma(GateContext(hgx, HGX_HCAS, dataclasses.replace(LOADED, boot_files=[])))
    assert no_boot.status == "fail" and "it would not load at the next boot" in no_boot.message
    assert v.gpudirect_rdma(GateContext(settings(tier="hgx-cloud"), HGX_HCAS, LOADED)).status == "skip"  # tcp
    hcas["rdma"] = []
    assert v.gpudirect_rdma(GateContext(hgx, [], NOT_BUILT)).message == \
        "no RDMA device on this host (/sys/class/infiniband is empty)"


def test_the_gate_names_the_hca_that_is_down_or_slow(hcas):
    hgx = settings(tier="hgx")  # validate_min_nic_gbps 200, NCCL_IB_HCA auto: every InfiniBand HCA
    bad = v.nccl_hcas_up(GateContext(hgx, HGX_HCAS, LOADED))
    assert bad.status == "fail" and bad.message == (
        "NCCL_IB_HCA =mlx5_0,mlx5_1,mlx5_2,mlx5_3: mlx5_2 port 1: link DOWN (Polling), not ACTIVE (LinkUp)"), bad
    fast = v.nccl_hcas_up(GateContext(settings(tier="hgx", validate_min_nic_gbps=400,
                                               tuning_nccl_ib_hca="=mlx5_0,mlx5_3"), HGX_HCAS, LOADED))
    assert fast.status == "pass" and fast.message == "NCCL_IB_HCA =mlx5_0,mlx5_3: mlx5_0 port 1 400 Gb/s, mlx5_3 port 1 400 Gb/s"
    slow = v.nccl_hcas_up(GateContext(settings(tier="hgx", validate_min_nic_gbps=400,
                                               tuning_nccl_ib_hca="=mlx5_0,mlx5_1"), HGX_HCAS, LOADED))
    assert slow.status == "fail" and "mlx5_1 port 1: 200 Gb/sec (4X HDR), below validate_min_nic_gbps 400" in slow.message
    gone = v.nccl_hcas_up(GateContext(settings(tier="hgx", tuning_nccl_ib_hca="=mlx5_9"), HGX_HCAS, LOADED))
    assert gone.status == "fail" and "names mlx5_9, which this host does not have" in gone.message, gone
