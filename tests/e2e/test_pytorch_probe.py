"""End-to-end: the validation gate and the fleet report read the PyTorch the host's python3
imports (torch.__version__, torch.version.cuda, torch.cuda.get_arch_list(), by the probe on the
host) and judge it against the host's GPUs and driver.

One Debian 12 test host with a SIMULATED V100 (testing/gpusim) and driver 580.126.09 loaded,
tier research: pytorch_runtime python, the system's /usr/bin/python3. In turn it has:
- no torch: a WARN naming what to set (pytorch_runtime, pytorch_python), not a pass;
- a clearly marked TEST DOUBLE (testing/torch_standin.py) reporting the recorded build values
  of the real 2.11.0+cu128 wheel, whose arch list lacks sm_70 (pytorch/pytorch#182250): FAIL,
  naming the GPU, its compute capability and the missing sm_70, with the wheel that fits;
- the same double with the real 2.11.0+cu126 values (sm_50 ... sm_90): PASS;
- real PyTorch, the CPU build (testing/torch_cpu.py): torch.version.cuda is None -> FAIL.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from testing import torch_cpu, torch_standin
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import REPO, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
V100 = "Tesla V100-SXM2-16GB"
CHECK = "pytorch: the host's PyTorch build runs on its GPUs and driver"
NO_KERNEL = '"no kernel image is available for execution on the device"'


@pytest.fixture(scope="module")
def volta(hostpool, tmp_path_factory):
    torch_site, why = torch_cpu.site()
    if torch_site is None:
        pytest.fail(f"no PyTorch CPU build: {why}")
    (h,) = hostpool.get("torchprobe", 1, gpu=f"v100@{TEST_DRIVER}")
    tmp = tmp_path_factory.mktemp("torchprobe")
    data = {**environment_data(h, "research"), "tier_mismatch": "warn", "pytorch_version": "2.11",
            "cuda_version": "none", "cudnn_version": "none"}
    inv = write_inventory(tmp / "inventory.py", [h], data={h.name: data})
    yield h, inv, tmp, torch_site
    torch_standin.remove(h)


def gate_line(run, h) -> str:
    prefix = f"[{h.name}] ["
    lines = [ln.strip() for ln in run.output.splitlines() if ln.strip().startswith(prefix) and CHECK in ln]
    assert len(lines) == 1, run.output[-4000:]
    return lines[0]


def test_pytorch_build_judged_on_the_host(volta):
    h, inv, tmp, torch_site = volta

    # no torch at all in the tier's runtime (research: python, the system python3): a warning
    # naming what to set
    line = gate_line(pyinfra(inv, "deploys/validate.py"), h)
    assert line.startswith(f"[{h.name}] [WARN] {CHECK}: no PyTorch to run it with: /usr/bin/python3 (python 3.11."), line
    assert "imports no torch (No module named 'torch')" in line
    assert "-> fix: set pytorch_runtime: venv (gpufleet installs torch 2.11 cu126 for the host's users)" in line, line

    # the real 2.11.0+cu128 wheel's arch list (stand-in): no sm_70 -> no kernel image on a V100
    torch_standin.install(h, "2.11.0+cu128")
    run = pyinfra(inv, "deploys/validate.py")
    (tmp / "cu128.log").write_text(run.output)
    line = gate_line(run, h)
    assert line.startswith(f"[{h.name}] [FAIL] {CHECK}: torch 2.11.0+cu128 (CUDA 12.8, built for sm_75, sm_80, "
                           "sm_86, sm_90, sm_100, sm_120): no kernel image: "
                           f"{V100} (compute capability 7.0) needs sm_70 (CUDA kernels fail with {NO_KERNEL})"), line
    assert "-> fix: pip install --force-reinstall torch==2.11.* --index-url https://download.pytorch.org/whl/cu126" \
        in line, line
    assert run.returncode != 0

    # the real 2.11.0+cu126 wheel's arch list (stand-in): sm_70 is there -> it runs
    torch_standin.install(h, "2.11.0+cu126")
    line = gate_line(pyinfra(inv, "deploys/validate.py"), h)
    assert line == (f"[{h.name}] [PASS] {CHECK}: torch 2.11.0+cu126 (CUDA 12.6, built for sm_50, sm_60, sm_70, "
                    f"sm_75, sm_80, sm_86, sm_90) runs on {V100} (7.0) with driver {TEST_DRIVER} "
                    "(runtime python /usr/bin/python3 (pytorch_python))"), line

    # real PyTorch, CPU build: torch.version.cuda is None on a GPU host
    torch_standin.remove(h)
    torch_cpu.install(h, torch_site)
    run = pyinfra(inv, "deploys/validate.py")
    (tmp / "cpu.log").write_text(run.output)
    line = gate_line(run, h)
    assert line.startswith(f"[{h.name}] [FAIL] {CHECK}: torch {torch_cpu.VERSION}+cpu "
                           "(/usr/local/lib/python3.11/dist-packages/torch) is a CPU-only build "
                           "(torch.version.cuda is None)"), line
    assert "-> fix: pip install --force-reinstall torch==2.13.* --index-url https://download.pytorch.org/whl/cu126" \
        in line, line

    # the fleet report reads it too (without --probe)
    out = tmp / "report"
    report = subprocess.run([str(REPO / "tools" / "fleet-report"), str(inv), "--no-drift", "--quiet",
                             "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert report.returncode == 1, report.stdout + report.stderr  # the host is not provisioned
    row = json.loads((out / "fleet-report.json").read_text())["hosts"][0]
    assert row["pytorch"].startswith(f"fail: torch {torch_cpu.VERSION}+cpu "), row["pytorch"]
    assert "CPU-only build" in row["pytorch"]
    check = next(c for c in row["validation"]["checks"] if c["area"] == "pytorch")
    assert check["status"] == "fail" and "whl/cu126" in check["fix"]
    assert "PyTorch" in (out / "fleet-report.md").read_text()
