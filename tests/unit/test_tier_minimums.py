"""validate_min_ram_gb and validate_min_nic_gbps: the gate's checks on recorded-shape facts
(/proc/meminfo's MemTotal through SystemResources, /sys/class/net/*/speed through
NetworkInterfaces), with tier_mismatch deciding fail or warn as for the other hardware keys."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpufleet.facts.network import NetInterface, NetworkInterfaces, parse_net
from gpufleet.facts.system import SystemResources, SystemResourcesData
from gpufleet.checks.validation import FAIL, PASS, SKIP, WARN, enough_ram, fast_enough_nic, fastest_data_nic

pytestmark = pytest.mark.unit

GIB = 1024 * 1024  # KiB


class FakeHost:
    def __init__(self, memory_kib=None, nics=()):
        self.memory_kib, self.nics = memory_kib, list(nics)

    def get_fact(self, cls, *args, **kwargs):
        if cls is SystemResources:
            return SystemResourcesData(memory_total_kib=self.memory_kib)
        assert cls is NetworkInterfaces
        return self.nics


def _ctx(host, **settings):
    base = {"tier": "hgx", "tier_mismatch": "fail", "validate_min_ram_gb": 0, "validate_min_nic_gbps": 0}
    return SimpleNamespace(host=host, settings=SimpleNamespace(**{**base, **settings}))


def _nic(name, speed, type_=1, device="0000:01:00.0"):
    return NetInterface(name=name, operstate="up", mac=None, mtu=1500, type=type_, device=device, driver=None,
                        speed_mbps=speed)


def test_ram_a_host_with_the_tiers_gib_installed_passes():
    # 1 TiB installed: MemTotal ~1007 GiB once firmware and kernel took theirs = 1081 GB
    assert enough_ram(_ctx(FakeHost(1007 * GIB), validate_min_ram_gb=1024)).status == PASS


@pytest.mark.parametrize("mismatch, status", [("fail", FAIL), ("warn", WARN)])
def test_ram_below_the_minimum_fails_or_warns_as_tier_mismatch_says(mismatch, status):
    result = enough_ram(_ctx(FakeHost(23 * GIB), validate_min_ram_gb=256, tier_mismatch=mismatch))
    assert result.status == status
    assert result.message == (f"24.7 GB of RAM (MemTotal), tier hgx expects at least 256 GB "
                              f"(validate_min_ram_gb; tier_mismatch: {mismatch})")


def test_ram_minimum_zero_or_unknown_memory_is_not_checked():
    assert enough_ram(_ctx(FakeHost(1 * GIB))).status == SKIP
    assert enough_ram(_ctx(FakeHost(None), validate_min_ram_gb=32)).status == SKIP


def test_fastest_data_nic_ignores_plumbing_and_unknown_speeds():
    nics = parse_net(["name=eth0 type=1 device=0000:01:00.0 speed=25000",
                      "name=ib0 type=32 device=0000:3b:00.0 speed=200000",
                      "name=ens1f1 type=1 device=0000:5e:00.1 speed=-1",
                      "name=tap0 type=1 speed=400000",
                      "name=virtio0 type=1 device=virtio2 speed="])
    assert fastest_data_nic(nics).name == "ib0"
    assert fastest_data_nic([n for n in nics if n.name not in ("eth0", "ib0")]) is None


def test_nic_at_or_above_the_minimum_passes():
    host = FakeHost(nics=[_nic("eth0", 25000), _nic("ib0", 200000, type_=32)])
    result = fast_enough_nic(_ctx(host, validate_min_nic_gbps=200))
    assert (result.status, result.message) == (PASS, "ib0 200 Gbit/s (validate_min_nic_gbps: 200)")


def test_nic_below_the_minimum_names_it():
    host = FakeHost(nics=[_nic("eth0", 25000), _nic("eth1", 10000)])
    result = fast_enough_nic(_ctx(host, validate_min_nic_gbps=100, tier="hgx-cloud", tier_mismatch="warn"))
    assert result.status == WARN
    assert result.message.startswith("fastest data NIC eth0 runs at 25 Gbit/s, tier hgx-cloud expects at least 100")


def test_nic_speed_nobody_reports_is_skipped_with_the_reason():
    result = fast_enough_nic(_ctx(FakeHost(nics=[_nic("eth0", None, device="virtio0")]), validate_min_nic_gbps=25))
    assert result.status == SKIP and "cannot be checked" in result.message
    assert fast_enough_nic(_ctx(FakeHost(nics=[_nic("eth0", 1000)]))).status == SKIP  # minimum 0
