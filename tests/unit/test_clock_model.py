"""One clock model: `clock_policy: max` is each GPU's highest supported pair as its nvidia-smi
reports it (what -ac / -lgc,-lmc can apply). The compatibility catalogue's pair is only the
plan-time estimate, and says so. The plan view's host line, the deploy's commands and the gate's
check come from one plan (gpufleet.plans.tuning.host_clocks), shown with one wording (clocks_summary).

The case that tells the two meanings apart: an A100 board that reports 1215,1395 as its highest
pair while the catalogue's A100-SXM4-40GB says 1410 (a power-capped board)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpufleet.facts.gpu import ClockPair, GpuInfo, GpuState, GpuStateData
from gpufleet.plans import tuning as t
from gpufleet.config.resolver import resolve
from gpufleet.catalog.tiers import tier_defaults
from gpufleet.checks.validation import FAIL, PASS, clocks_as_set
from tests.unit.test_resolver import A100, H200, UBUNTU, wish

pytestmark = pytest.mark.unit

CAPPED = {1215: list(range(1395, 209, -15))}  # the board's own list tops out at 1395


def _gpu(index: int, app: tuple[int, int]) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", name="NVIDIA A100-SXM4-40GB", bus_id=f"00000000:00:{6 + index:02X}.0",
                   device_id="0x20b0", driver_version="580.159.04", memory_mib=40960, persistence=True,
                   app_clocks=ClockPair(*app), default_app_clocks=ClockPair(1215, 1095), max_clocks=None,
                   compute_cap="8.0")


class FakeHost:
    def __init__(self, apps):
        gpus = [_gpu(i, app) for i, app in enumerate(apps)]
        self.state = GpuStateData(status="ok", gpus=gpus, supported_clocks={g.bus_id: CAPPED for g in gpus})

    def get_fact(self, cls, *args, **kwargs):
        if cls is GpuState:
            return self.state
        return cls.default()  # no clock locks, NICs, RDMA devices, cpufreq: what a plain host has


def test_catalogue_pair_is_labelled_an_estimate_under_max():
    res = resolve([A100], wish(clock_policy="max"), UBUNTU)
    assert res.application_clocks["NVIDIA A100-SXM4-40GB"] == ClockPair(1215, 1410)
    assert res.describe()["clocks"] == ("ac; NVIDIA A100-SXM4-40GB 1215,1410 (catalogue estimate; each GPU gets its "
                                        "own highest supported pair)")
    # an explicit pair is what is applied (the GPU's own list checks it): no estimate
    pair = resolve([H200], wish(clock_policy={"memory": 3201, "graphics": 1785}), UBUNTU)
    assert pair.describe()["clocks"] == "ac; NVIDIA H200 3201,1785"


def test_a_model_the_catalogue_has_no_pair_for_still_gets_its_highest_pair():
    res = resolve(["0x20b2"], wish(clock_policy="max"), UBUNTU)  # A100-SXM4-80GB: clocks unverified
    assert res.describe()["clocks"] == "ac; NVIDIA A100-SXM4-80GB its own highest supported pair (no catalogue estimate)"
    assert ("no catalogue clocks for NVIDIA A100-SXM4-80GB: its highest supported pair is read from the GPU when "
            "tuning runs") in res.notes
    assert not any("stay at default" in note for note in res.notes)


def test_the_host_gets_its_own_highest_pair_not_the_catalogues():
    plans = t.host_clocks(FakeHost([(1215, 1095), (1215, 1095)]), "max")
    assert [p.target for p in plans] == [ClockPair(1215, 1395)] * 2
    assert [p.commands for p in plans] == [(("-i", "00000000:00:06.0", "-ac", "1215,1395"),),
                                           (("-i", "00000000:00:07.0", "-ac", "1215,1395"),)]
    assert t.clocks_summary(plans) == "-ac 1215,1395 on GPU 0, 1 (NVIDIA A100-SXM4-40GB)"


def test_the_gate_checks_the_same_pair_and_says_it_the_same_way():
    settings = SimpleNamespace(**{**tier_defaults("research"), "tier": "research"})
    assert settings.clock_policy == "max"
    at_max = clocks_as_set(SimpleNamespace(host=FakeHost([(1215, 1395)] * 2), settings=settings,
                                           gpu=FakeHost([(1215, 1395)] * 2).state))
    assert (at_max.status, at_max.message) == (PASS, "2 GPUs at policy max: -ac 1215,1395 on GPU 0, 1 "
                                                     "(NVIDIA A100-SXM4-40GB)")
    # at the catalogue's pair is NOT at max on this board (it cannot run 1410): the gate says what it wants
    host = FakeHost([(1215, 1410), (1215, 1395)])
    off = clocks_as_set(SimpleNamespace(host=host, settings=settings, gpu=host.state))
    assert off.status == FAIL and off.message == "GPU 0 NVIDIA A100-SXM4-40GB (00000000:00:06.0): wants 1215,1395"


def test_summary_groups_gpus_by_target_and_names_locked_and_default():
    a = t.GpuClocks("00000000:00:06.0", "GPU 0 NVIDIA H200 (00000000:00:06.0)", t.LGC, ClockPair(3201, 1980))
    b = t.GpuClocks("00000000:00:07.0", "GPU 1 NVIDIA H200 (00000000:00:07.0)", t.LGC, ClockPair(3201, 1980))
    c = t.GpuClocks("00000000:00:08.0", "GPU 2 Tesla T4 (00000000:00:08.0)", t.AC, None)
    assert t.clocks_summary([a, b, c]) == ("-lgc/-lmc 3201,1980 on GPU 0, 1 (NVIDIA H200); "
                                           "driver default on GPU 2 (Tesla T4)")
