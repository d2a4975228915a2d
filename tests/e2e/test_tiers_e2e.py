"""End-to-end for tiers, facts and planning-time validation, on test hosts whose GPUs are
SIMULATED (testing/gpusim, a test double).

- the facts report the simulated hardware exactly (compared with the simulator's own config);
- a host whose declared tier does not match its GPUs is reported (warn) or refused (fail);
- broken inventories stop at planning time with one clear line, and the host is unchanged
  (the overlay's upper layer, which records every write to the host's disk, stays the same).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import REPO, PYINFRA, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]


@pytest.fixture(scope="module")
def tiered(hostpool):
    dev = hostpool.get("tiers-dev", 1, gpu="t4")[0]
    research = hostpool.get("tiers-research", 1, gpu=f"a100x4@{TEST_DRIVER}")[0]
    hgx = hostpool.get("tiers-hgx", 1, release="trixie", gpu="h200x2")[0]
    return {"dev": dev, "research": research, "hgx": hgx}


def _data(host: testhosts.Host, tier: str, **extra) -> dict:
    return {"tier": tier, "validate_os_release": OS_RELEASE[host.release], **extra}


def _fact(inventory: Path, fact: str) -> dict:
    import subprocess
    proc = subprocess.run([str(PYINFRA), "-y", str(inventory), "fact", fact], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    return json.loads(out[out.index("{", out.index("--> Fact data for")):out.rindex("}") + 1])


def test_facts_report_the_simulated_hardware_exactly(tiered, tmp_path):
    hosts = list(tiered.values())
    inv = write_inventory(tmp_path / "inv.py", hosts,
                          data={h.name: _data(h, t) for t, h in tiered.items()})
    gpu_state = _fact(inv, "gpufleet.facts.gpu.GpuState")
    pci = _fact(inv, "gpufleet.facts.pci.NvidiaPciDevices")
    driver = _fact(inv, "gpufleet.facts.kernel.DriverState")
    for host in hosts:
        sim = json.loads(testhosts.ssh(host, "cat /etc/gpusim/gpus.json").stdout)
        state = gpu_state[host.name]
        assert state["status"] == "ok"
        assert [g["uuid"] for g in state["gpus"]] == [g["uuid"] for g in sim["gpus"]]
        assert [g["bus_id"] for g in state["gpus"]] == [g["bus_id"] for g in sim["gpus"]]
        assert {g["name"] for g in state["gpus"]} == {g["name"] for g in sim["gpus"]}
        assert {g["driver_version"] for g in state["gpus"]} == {sim["driver"]["version"]}
        assert sorted(d["slot"] for d in pci[host.name] if d["kind"] == "gpu") == sorted(
            g["bus_id"][4:].lower() for g in sim["gpus"])
        assert driver[host.name]["module_version"] == sim["driver"]["version"]
    h200 = gpu_state[tiered["hgx"].name]
    assert h200["topology"]["links"]["GPU0"]["GPU1"] == "NV18"
    assert h200["gpus"][0]["app_clocks"] == [3201, 1980]
    t4 = gpu_state[tiered["dev"].name]
    assert [g["name"] for g in t4["gpus"]] == ["Tesla T4"]


def test_plan_shows_hardware_and_a_tier_mismatch(tiered, tmp_path):
    data = {h.name: _data(h, t) for t, h in tiered.items()}
    data[tiered["hgx"].name]["tier_mismatch"] = "warn"
    inv = write_inventory(tmp_path / "inv.py", list(tiered.values()), data=data)
    run = pyinfra(inv, "deploys/plan.py")
    assert run.returncode == 0, run.output
    plans = dict(re.findall(r"--> Plan for (\S+)\n((?:    .*\n)+)", run.output))
    assert "hardware: 1 x Tesla T4" in plans[tiered["dev"].name]
    assert "hardware: 4 x NVIDIA A100-SXM4-40GB (NVLink)" in plans[tiered["research"].name]
    assert "MISMATCH" not in plans[tiered["dev"].name] + plans[tiered["research"].name]
    hgx = plans[tiered["hgx"].name]
    assert "hardware: 2 x NVIDIA H200 (NVLink)" in hgx
    assert "MISMATCH (warn): tier hgx expects 8 GPUs; found 2" in hgx
    assert "NVSwitch" in hgx and "RDMA" in hgx
    assert "driver: R580" in hgx and "cuda: 13.0 (cuda-toolkit-13-0)" in hgx
    # the PyTorch wheel for these GPUs and this driver, as tools/compat says it
    assert "pytorch: 2.11 cu130: pip install torch==2.11.* --index-url https://download.pytorch.org/whl/cu130" in hgx
    assert "pytorch: 2.11 cu128: pip install torch==2.11.* --index-url https://download.pytorch.org/whl/cu128" \
        in plans[tiered["dev"].name]  # Debian's R535: CUDA 13 wheels need 580
    assert "MIXED" not in hgx


def test_tier_mismatch_fail_refuses_only_that_host(tiered, tmp_path, aptrepo):  # noqa: F811
    research, hgx = tiered["research"], tiered["hgx"]
    before = hgx.written_files()
    data = {research.name: environment_data(research, "research", aptrepo),
            hgx.name: environment_data(hgx, "hgx", aptrepo)}
    inv = write_inventory(tmp_path / "inv.py", [research, hgx], data=data)
    run = pyinfra(inv, "deploys/all.py")
    assert run.returncode != 0
    assert f"[{hgx.name}] refused (tier): hardware does not match tier hgx" in run.output
    assert "Fix: give the host the tier its hardware is (tier), or set tier_mismatch: warn" in run.output
    assert hgx.written_files() == before, "the refused host was changed"
    # the other host of the same run converged, validation gate included
    assert testhosts.ssh(research, "cat /etc/gpufleet/managed").stdout.endswith("tier: research\n")
    assert f"[{research.name}] Error" not in run.output, run.output


# (inventory data, key named in the message, a fragment the message must contain)
BROKEN = [
    ({"validate_os_release": "debian-12"}, "tier", "missing"),
    ({"tier": "hgx2"}, "tier", "did you mean 'hgx'"),
    ({"tier": "dev", "cuda_verison": "12.4"}, "cuda_verison", "did you mean 'cuda_version'"),
    ({"tier": "dev", "driver_hold": "yes"}, "driver_hold", "expected a boolean"),
    ({"tier": "dev", "driver_flavour": "closed"}, "driver_flavour", "unknown value 'closed'"),
    ({"tier": "research", "cuda_version": "12.99"}, "cuda_version", "12.99"),
    ({"tier": "research", "driver_branch": "999"}, "driver_branch", "999"),
    ({"tier": "research", "cudnn_version": "7.0.0"}, "cudnn_version", "7.0.0"),
    ({"tier": "research", "driver_branch": "535", "cuda_version": "13.0"}, "cuda_version", "incompatible"),
    ({"tier": "hgx", "validate_gpu_models": ["NVIDIA B200"], "driver_flavour": "proprietary"},
     "driver_flavour", "incompatible"),
    ({"tier": "dev", "clock_policy": {"memory": "fast", "graphics": 1590}}, "clock_policy", ""),
    ({"tier": "hgx", "validate_rdma": "absent"}, "nccl_profile", "needs RDMA"),
    ({"tier": "dev", "firewall_open_ports": ["70000/tcp"]}, "firewall_open_ports", "70000"),
    # PyTorch wheels that would fail at `import torch` time on the tier's GPUs / driver
    ({"tier": "hgx", "pytorch_version": "2.6"}, "pytorch_version",
     "NVIDIA B200 (compute capability 10.0) needs sm_100 (CUDA kernels would fail with \"no kernel image"),
    ({"tier": "hgx", "driver_branch": "570", "cuda_version": "12.8", "cudnn_version": "9.10.2", "pytorch_version": "2.12"},
     "pytorch_version", "CUDA 13.x wheels need driver >= 580, the resolved driver is 570.195.03"),
    ({"tier": "dev", "pytorch_version": "2.4"}, "pytorch_version", "unverified"),
]


@pytest.mark.parametrize("data,key,fragment", BROKEN, ids=[f"{b[1]}-{i}" for i, b in enumerate(BROKEN)])
def test_broken_inventory_stops_at_planning_time(tiered, tmp_path, data, key, fragment):
    host = tiered["dev"]
    before = host.written_files()
    data = {"validate_os_release": OS_RELEASE[host.release], **data}
    inv = write_inventory(tmp_path / "inv.py", [host], data={host.name: data})
    run = pyinfra(inv, "deploys/all.py")
    assert run.returncode != 0
    line = next((ln for ln in run.output.splitlines() if f"host {host.name}: key '{key}'" in ln), None)
    assert line, run.output
    assert fragment in line and "allowed:" in line, line
    assert "--> Beginning operation run" not in run.output
    assert host.written_files() == before, "a broken inventory changed the host"
