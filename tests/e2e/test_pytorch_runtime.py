"""End-to-end: the validation gate's PyTorch check and performance probe run with the tier's
PyTorch runtime on the sandbox's hgx host shape, never with a system python3 that has none.

One Debian 12 test host with 2 SIMULATED H200s (testing/gpusim) and driver 580.126.09 loaded,
tier hgx with the sandbox's overrides (inventories/sandbox.py). hgx says `pytorch_runtime: venv`:
gpufleet installs the wheel the resolver chose (PyTorch 2.11 cu130 for H200 with R580) into
/opt/gpufleet/pytorch. PyTorch's index is out of reach, so the stand-in repository's server
(testing/aptrepo.py) serves a PyTorch index on loopback holding a TEST DOUBLE torch wheel
(testing/torch_standin.py: torch.cuda.is_available() False, device count 0), as a site's mirror
(pytorch_index_url). In turn:
- before the install: the gate WARNs, naming what installs it (never "PyTorch not installed");
- deploys/pytorch.py installs it; the second run installs nothing;
- a user who is not root imports it; the gate's PyTorch check PASSes with the runtime named;
  the probe runs with it and says the simulated GPUs give it no CUDA device;
- `pytorch_runtime: python` at the venv's python (an operator's interpreter) is used as given;
  at the system python3, which has no torch: a WARN naming pytorch_runtime;
- air-gapped: a folder of wheels on the host (pytorch_wheel_dir) with the index unreachable;
- bad values stop at planning, naming host and key, before the host changes.
"""
from __future__ import annotations

import re

import pytest

from testing import testhosts, torch_standin
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
VENV = "/opt/gpufleet/pytorch"
CHECK = "pytorch: the host's PyTorch build runs on its GPUs and driver"
PERF = "probe: bf16 matmul, memory and all-reduce bandwidth reach the expected minimums"
WHEEL = "2.11.0+cu130"


def sh(host, cmd: str, timeout: float = 120) -> str:
    return testhosts.ssh(host, cmd, timeout=timeout).stdout


def line_of(run, host, what: str) -> str:
    lines = [ln.strip() for ln in run.output.splitlines() if ln.strip().startswith(f"[{host.name}] [") and what in ln]
    assert len(lines) == 1, run.output[-5000:]
    return re.sub(r"^(\[[^\]]+\]) +", r"\1 ", lines[0])


@pytest.fixture(scope="module")
def hgx(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    (h,) = hostpool.get("pytorch-runtime", 1, gpu=f"h200x2@{TEST_DRIVER}")
    tmp = tmp_path_factory.mktemp("pytorch-runtime")
    # the sandbox's hgx host: 2 H200s over NVLink on eth0 stand for the 8-GPU baseboard
    base = {**environment_data(h, "hgx", aptrepo), "tier_mismatch": "warn", "tuning_nccl_socket_ifname": "auto"}

    def inventory(name: str, **data) -> str:
        return str(write_inventory(tmp / f"{name}.py", [h], data={h.name: {**base, **data}}))

    return h, inventory, tmp


def test_gate_runs_with_gpufleets_venv(hgx):
    h, inventory, tmp = hgx
    inv = inventory("venv")
    assert sh(h, f"test -e {VENV} && echo there || echo absent").strip() == "absent"

    # before the install: a warning the operator can act on, never a silent skip
    before = pyinfra(inv, "deploys/validate.py")
    (tmp / "before.log").write_text(before.output)
    line = line_of(before, h, CHECK)
    assert line.startswith(f"[{h.name}] [WARN] {CHECK}: no PyTorch to run it with: {VENV}/bin/python: no such "
                           f"interpreter (runtime venv {VENV} (gpufleet's, pytorch_runtime))"), line
    assert f"-> fix: run deploys/all.py (or deploys/pytorch.py): it installs torch 2.11 cu130 into {VENV}" in line
    assert line_of(before, h, PERF).startswith(f"[{h.name}] [WARN] {PERF}: no PyTorch to run it with"), before.output
    assert "PyTorch not installed" not in before.output

    first = pyinfra(inv, "deploys/pytorch.py")
    (tmp / "install.log").write_text(first.output)
    assert first.returncode == 0, first.output[-5000:]
    assert any("Install torch 2.11 cu130" in op for op in changed_operations(first)), first.output[-5000:]
    second = pyinfra(inv, "deploys/pytorch.py")
    assert second.returncode == 0, second.output[-5000:]
    assert changed_operations(second) == [], second.output[-5000:]

    # shared: root's, readable and runnable by a user who is not root
    assert sh(h, f"stat -c '%U %a' {VENV} {VENV}/gpufleet-torch").split() == ["root", "755", "root", "644"]
    assert sh(h, f"find {VENV} -perm -o+w ! -type l | head -n 3").strip() == ""
    as_user = sh(h, f"runuser -u nobody -- {VENV}/bin/python -c "
                    "'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'")
    assert as_user.split() == [WHEEL, "13.0", "False"]
    assert sh(h, f"cat {VENV}/gpufleet-torch") == "torch==2.11.* cu130\n"
    # the system python3 is left alone
    assert "No module named" in testhosts.ssh(h, "python3 -c 'import torch'", check=False).stderr

    after = pyinfra(inv, "deploys/validate.py")
    (tmp / "after.log").write_text(after.output)
    line = line_of(after, h, CHECK)
    assert line.startswith(f"[{h.name}] [PASS] {CHECK}: torch {WHEEL} (CUDA 13.0, built for sm_75, sm_80, sm_86, "
                           "sm_90, sm_100, sm_120, compute_120) runs on NVIDIA H200 (9.0)"), line
    assert line.endswith(f"(runtime venv {VENV} (gpufleet's, pytorch_runtime))"), line
    # the probe ran with the venv's torch; the simulated GPUs are no CUDA device to it
    perf = line_of(after, h, PERF)
    assert perf.startswith(f"[{h.name}] [SKIP] {PERF}: skipped (torch {WHEEL}, runtime venv {VENV} "
                           "(gpufleet's, pytorch_runtime)): matmul: no CUDA device"), perf
    assert "PyTorch not installed" not in after.output


def test_configured_interpreter_and_one_without_torch(hgx):
    h, inventory, tmp = hgx
    if sh(h, f"test -x {VENV}/bin/python && echo yes || echo no").strip() != "yes":
        pytest.skip("needs the venv of test_gate_runs_with_gpufleets_venv")
    # an operator's interpreter (here: the venv's python, as a site would name its conda env's)
    run = pyinfra(inventory("python", pytorch_runtime="python", pytorch_python=f"{VENV}/bin/python"),
                  "deploys/validate.py")
    line = line_of(run, h, CHECK)
    assert line.startswith(f"[{h.name}] [PASS] {CHECK}: torch {WHEEL}"), line
    assert line.endswith(f"(runtime python {VENV}/bin/python (pytorch_python))"), line

    # the system python3 has no torch: a warning naming the key to set
    run = pyinfra(inventory("system", pytorch_runtime="python", pytorch_python="/usr/bin/python3"),
                  "deploys/validate.py")
    (tmp / "system.log").write_text(run.output)
    line = line_of(run, h, CHECK)
    assert line.startswith(f"[{h.name}] [WARN] {CHECK}: no PyTorch to run it with: /usr/bin/python3 (python 3.11."), line
    assert "-> fix: set pytorch_runtime: venv (gpufleet installs torch 2.11 cu130 for the host's users), or " \
           "pytorch_python to the python of the site's venv or conda env that has PyTorch" in line, line
    assert line_of(run, h, PERF).startswith(f"[{h.name}] [WARN] {PERF}: no PyTorch to run it with: /usr/bin/python3: "
                                            "it imports no torch"), run.output

    # none on purpose: said so, naming the key
    run = pyinfra(inventory("none", pytorch_runtime="none"), "deploys/validate.py")
    assert line_of(run, h, CHECK) == (f"[{h.name}] [SKIP] {CHECK}: no PyTorch on this host (pytorch_runtime: none): "
                                      "set pytorch_runtime to venv or python to check it")


def test_air_gapped_from_a_folder_of_wheels(hgx):
    h, inventory, tmp = hgx
    torch_standin.wheel(WHEEL, h.root / "srv" / "wheels")
    target = "/opt/site/pytorch"
    inv = inventory("wheels", pytorch_venv_path=target, pytorch_wheel_dir="/srv/wheels",
                    pytorch_index_url="http://127.0.0.1:9/unreachable/{variant}")
    run = pyinfra(inv, "deploys/pytorch.py")
    (tmp / "wheels.log").write_text(run.output)
    assert run.returncode == 0, run.output[-5000:]
    assert sh(h, f"{target}/bin/python -c 'import torch; print(torch.__version__)'").strip() == WHEEL
    assert changed_operations(pyinfra(inv, "deploys/pytorch.py")) == []


@pytest.mark.parametrize("data, key, said", [
    ({"pytorch_python": "/usr/bin/python3;id"}, "pytorch_python", "contains the shell metacharacter ';'"),
    ({"pytorch_python": "python3"}, "pytorch_python", "is not an absolute path"),
    ({"pytorch_index_url": "https://user:secret@mirror.example/whl/{variant}"}, "pytorch_index_url",
     "carries credentials"),
    ({"pytorch_venv_path": "/tmp/torch"}, "pytorch_venv_path", "world-writable"),
    ({"pytorch_version": "none"}, "pytorch_runtime", "venv installs the wheel of pytorch_version, which is none"),
])
def test_bad_values_stop_at_planning(hgx, data, key, said):
    h, inventory, tmp = hgx
    before = sh(h, "ls /opt")
    run = pyinfra(inventory(f"bad-{key}", **data), "deploys/pytorch.py")
    assert run.returncode != 0
    found = [ln for ln in run.output.splitlines() if f"host {h.name}: key '{key}': " in ln]
    assert found and said in found[0] and "allowed: " in found[0], run.output[-3000:]
    assert sh(h, "ls /opt") == before
