"""The acceptance plan (gpufleet/plans/acceptance.py) on recorded-shape probe output, port
counters and all-reduce outcomes: minimums per model and per nccl_profile, WARN for a GPU
without one, never a PASS for a minimum not applied (tests as data: tests/unit/acceptance)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.plans import perf
from gpufleet.facts.network import parse_ib_counters
from gpufleet.plans import acceptance as acc

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent / "acceptance"
IB = Path(__file__).resolve().parents[1] / "fixtures/infiniband"
CASES = json.loads((HERE / "cases.json").read_text())


def probe_lines(name: str, slow: float = 1.0) -> list[str]:
    lines = []
    for line in (HERE / name).read_text().splitlines():
        rec = json.loads(line)
        if "seconds" in rec:
            rec["seconds"] *= slow
        lines.append(json.dumps(rec))
    return lines


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_probe_against_model_minimums(case: dict) -> None:
    models = {int(k): v for k, v in case["models"].items()}
    result = perf.parse_probe_output(probe_lines(case["probe"], case.get("slow", 1.0)), models)
    found = {f.name: f for f in acc.judge_probe(result, models, nvlink=False)}
    for name, (status, words) in case["expect"].items():
        assert found[name].status == status, found[name]
        assert words in found[name].message, found[name]
    assert not any(f.status == acc.PASS for f in found.values() if "cpu" in f.name)


def test_every_catalogue_gpu_has_a_minimum_or_a_warn() -> None:
    from gpufleet.catalog.compat import compat_data

    for gpu in compat_data().gpus_raw:
        floors = acc.model_floors(gpu["name"])
        for floor in floors.values():
            assert floor.basis.split(":")[0] in ("measured", "derived"), (gpu["name"], floor)
    # the two live GPUs the project probed are measured, the rest derived
    assert acc.model_floors("NVIDIA H100 80GB HBM3")["matmul"].measured
    assert acc.model_floors("NVIDIA H200")["memory"].measured
    assert not acc.model_floors("NVIDIA B200")["matmul"].measured


def test_intra_node_minimums_nvlink_and_pcie() -> None:
    assert acc.intra_node_floor("NVIDIA H200", 2, nvlink=True).value == 225.0
    assert acc.intra_node_floor("NVIDIA L40S", 2, nvlink=False).value == 12.0
    assert acc.intra_node_floor("NVIDIA H200", 1, nvlink=True) is None
    # an NVLink model without a known NVLink bandwidth: no minimum, so the probe WARNs
    line = json.dumps({"metric": "allreduce", "device": "cuda:0-1", "ranks": 2, "bytes": 1 << 30,
                       "iterations": 10, "seconds": 1.0})
    head = json.dumps({"status": "ok", "cuda_devices": 2})
    models = {0: "NVIDIA A10G", 1: "NVIDIA A10G"}
    found = acc.judge_probe(perf.parse_probe_output([head, line], models, nvlink=True), models, nvlink=True)
    assert [(f.status, "NVIDIA A10G" in f.message) for f in found] == [(acc.WARN, True)]


@pytest.mark.parametrize("profile, busbw, status", [
    ("ib", 45.0, acc.PASS), ("ib", 12.0, acc.FAIL), ("roce", 21.0, acc.PASS), ("tcp", 0.5, acc.FAIL),
    ("nvlink-only", 100.0, acc.WARN)])
def test_inter_node_minimum_per_profile(profile: str, busbw: float, status: str) -> None:
    run = acc.AllReduce(peer="gpu-9", ok=True, backend="nccl", ranks=16, busbw_gbs=busbw, detail="sum right",
                        transport="NET/IB" if profile in ("ib", "roce") else "NET/Socket")
    found = acc.judge_allreduce(run, profile)
    assert found[0].status == acc.PASS
    assert found[1].status == status, found[1]


def test_gloo_on_cpu_ran_but_bandwidth_never_passes() -> None:
    run = acc.AllReduce(peer="h0", ok=True, backend="gloo", ranks=2, busbw_gbs=0.3, simulated=True, detail="sum [3, 30]")
    found = acc.judge_allreduce(run, "roce")
    assert found[0].status == acc.PASS and "gloo on CPU" in found[0].message
    assert found[1].status == acc.SKIP and "not judged" in found[1].message


def test_nccl_on_sockets_where_rdma_is_expected_fails() -> None:
    run = acc.AllReduce(peer="h0", ok=True, backend="nccl", ranks=16, busbw_gbs=45.0, transport="NET/Socket")
    assert acc.judge_allreduce(run, "ib")[-1].status == acc.FAIL


def test_peer_unreachable_fails_with_the_fix() -> None:
    run = acc.AllReduce(peer="h0", ok=False, detail="rendezvous with h0:29400 timed out")
    found = acc.judge_allreduce(run, "roce")
    assert found[0].status == acc.FAIL and "firewall" in found[0].fix
    assert acc.judge_allreduce(None, "roce")[0].status == acc.WARN


def ports(name: str) -> list[acc.IbPort]:
    return [acc.IbPort(p.device, p.port, p.state or "", p.phys_state or "", tuple(sorted(p.counters.items())))
            for p in parse_ib_counters((IB / f"counters-{name}.txt").read_text().splitlines())]


def test_symbol_errors_during_the_acceptance_fail_naming_the_port() -> None:
    before = ports("before")
    [same] = acc.judge_ports(before, before)
    assert same.status == acc.PASS and "mlx5_0 port 1: port_rcv_errors 2" in same.message  # history, said
    [grew] = acc.judge_ports(before, ports("after-symbol-errors"))
    assert grew.status == acc.FAIL and grew.message == "mlx5_1 port 1: symbol_error 0 -> 17", grew
    [flap] = acc.judge_ports(before, ports("after-flap"))
    assert flap.status == acc.FAIL and "mlx5_0 port 1: DOWN/Disabled" in flap.message
    assert acc.judge_ports([], [])[0].status == acc.SKIP


def test_nccl_over_ib_without_gpudirect_rdma_fails_on_rdma_profiles() -> None:
    """NCCL stages through host memory without a word when nvidia-peermem is missing; its channel
    lines are the evidence (constructed from NCCL's format string: tests/unit/acceptance/README.md)."""
    with_gdr = acc.parse_allreduce((HERE / "nccl-ib-gdr.txt").read_text().splitlines(), "gpu-1")
    without = acc.parse_allreduce((HERE / "nccl-ib-no-gdr.txt").read_text().splitlines(), "gpu-1")
    assert (with_gdr.transport, with_gdr.gdr, without.transport, without.gdr) == ("NET/IB", True, "NET/IB", False)
    assert [f.name for f in acc.judge_allreduce(with_gdr, "ib") if f.status == acc.FAIL] == []
    failed = [f for f in acc.judge_allreduce(without, "roce") if f.status == acc.FAIL]
    assert [f.name for f in failed] == ["GPUDirect RDMA"] and "nvidia-peermem" in failed[0].fix
    # a tcp fabric expects no RDMA at all
    assert [f for f in acc.judge_allreduce(without, "tcp") if f.name == "GPUDirect RDMA"] == []


def test_a_port_down_before_and_after_is_not_judged_a_port_that_went_down_fails() -> None:
    """A dual-port HCA with one port cabled must not fail every acceptance; a port that went
    down while the acceptance ran must."""
    from dataclasses import replace

    before = ports("before")
    uncabled = [replace(p, state="DOWN", phys_state="Polling") if p.device == "mlx5_0" else p for p in before]
    found = acc.judge_ports(uncabled, uncabled)
    assert found[0].status == acc.PASS and "mlx5_0 port 1: DOWN/Polling" in found[0].message, found
    assert acc.judge_ports(before, uncabled)[0].status == acc.FAIL
    all_down = [replace(p, state="DOWN", phys_state="Polling") for p in before]
    assert acc.judge_ports(all_down, all_down)[0].status == acc.WARN
