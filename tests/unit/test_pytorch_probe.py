"""The host's PyTorch build: facts/pytorch.py's parser on recorded answers, gpufleet/catalog/pytorch.py's
check_build on real wheels' arch lists, and the validation gate's check built on both.

Arch lists of real wheels, as `torch.cuda.get_arch_list()` prints them (pytorch/pytorch#182250,
comment of 2026-05-03): 2.11.0+cu126 and 2.11.0+cu128. The CUDA 13 list is compat.yaml's cu13x
(PT1/PT2: TORCH_CUDA_ARCH_LIST 7.5 ... 12.0+PTX) written the way get_arch_list() spells it.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from pyinfra.api import StringCommand

from gpufleet.facts.kernel import DriverStateData
from gpufleet.facts.pytorch import MARK, SCRIPT, TorchBuild, TorchBuildData, parse_torch_build
from gpufleet.catalog.gpus import model_for_name
from gpufleet.catalog.pytorch import arch_entries, check_build
from gpufleet.plans.pytorch_runtime import runtime_of
from gpufleet.checks.validation import FAIL, PASS, SKIP, WARN, pytorch_build_runs_here

pytestmark = pytest.mark.unit

CU126_211 = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]
CU128_211 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CU130 = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
B200, V100, H100, A100 = (model_for_name(n) for n in (
    "NVIDIA B200", "Tesla V100-SXM2-16GB", "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"))
DRIVER = "580.126.09"

# SCRIPT's answers, recorded: the real CPU wheel 2.13.0 (testing/torch_cpu.py's cache) imported by
# python 3.11.7, with the NumPy warning real torch prints on stderr when NumPy is missing
RECORDED_CPU = [
    '::gpufleet-torch:: {"arch_list": [], "cuda": null, "hip": null, "path": '
    '"/usr/local/lib/python3.11/dist-packages/torch", "python": "3.11.7", "reason": "", "status": "ok", '
    '"torch": "2.13.0+cpu"}',
]
RECORDED_NO_TORCH = ['::gpufleet-torch:: {"python": "3.11.2", "reason": "No module named \'torch\'", "status": "no-torch"}']


def test_parse_recorded_answers():
    cpu = parse_torch_build(["/usr/local/lib/python3.11/dist-packages/torch/_subclasses/functional_tensor.py:368: "
                             "UserWarning: Failed to initialize NumPy", *RECORDED_CPU])
    assert (cpu.status, cpu.torch, cpu.cuda, cpu.arch_list, cpu.python) == ("ok", "2.13.0+cpu", None, [], "3.11.7")
    assert cpu.present and cpu.cpu_only
    none = parse_torch_build(RECORDED_NO_TORCH)
    assert (none.status, none.reason, none.present) == ("no-torch", "No module named 'torch'", False)
    cuda = parse_torch_build([MARK + ' {"status": "ok", "torch": "2.11.0+cu128", "cuda": "12.8", "hip": null, '
                              '"arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], "python": "3.12.3"}'])
    assert (cuda.cuda, cuda.arch_list, cuda.cpu_only) == ("12.8", CU128_211, False)
    broken = parse_torch_build([MARK + ' {"status": "broken", "reason": "OSError: libcudnn.so.9: cannot open"}'])
    assert broken.status == "broken" and "libcudnn" in broken.reason


@pytest.mark.parametrize("lines, reason", [
    ([], "the probe printed no answer"),
    (["Traceback (most recent call last):", "Killed"], "the probe printed no answer: Traceback"),
    ([MARK + " {not json"], "not JSON"),
    ([MARK + ' {"status": "maybe"}'], "unexpected answer"),
])
def test_unexpected_answers_are_unknown_not_a_pass(lines, reason):
    data = parse_torch_build(lines)
    assert data.status == "unknown" and data.reason.startswith(reason) and not data.present


def test_fact_runs_a_fixed_script_and_survives_no_python():
    fact = TorchBuild()
    assert fact.default() == TorchBuildData(status="no-python", reason="no such interpreter")
    assert fact.requires_command() == "python3"
    command = fact.command()
    assert isinstance(command, StringCommand)
    text = command.get_raw_value()
    assert text.startswith("timeout 120 python3 -c ") and text.endswith("2>/dev/null || true")
    assert "import torch" in SCRIPT and "get_arch_list()" in SCRIPT and "torch.version" not in text.split("-c")[0]


def test_arch_entries():
    assert arch_entries(CU130) == (("7.5", "8.0", "8.6", "9.0", "10.0", "12.0", "12.0+PTX"), ())
    assert arch_entries(["sm_90a", "sm_100f", "sm_120a", "gfx90a", "sm_x"]) == (("10.0",), ("9.0", "12.0"))


@pytest.mark.parametrize("models, cuda, archs, driver, status, fragments", [
    # the "no kernel image" case: a CUDA 12.6 list (the same set as 2.6's) on Blackwell
    ([B200], "12.6", CU126_211, DRIVER, "fail",
     ["no kernel image: NVIDIA B200 (compute capability 10.0) needs sm_100",
      '"no kernel image is available for execution on the device"',
      "built for sm_50, sm_60, sm_70, sm_75, sm_80, sm_86, sm_90"]),
    ([B200], "12.8", CU128_211, DRIVER, "pass", ["runs on NVIDIA B200 (10.0) with driver 580.126.09"]),
    # the real 2.11.0+cu128 wheel has no sm_70
    ([V100], "12.8", CU128_211, DRIVER, "fail", ["Tesla V100-SXM2-16GB (compute capability 7.0) needs sm_70"]),
    ([V100], "12.6", CU126_211, DRIVER, "pass", ["Tesla V100-SXM2-16GB (7.0)"]),
    # sm_80 SASS runs on 8.x, sm_90 on H100
    ([A100, H100], "13.0", CU130, DRIVER, "pass", ["NVIDIA A100-SXM4-40GB (8.0), NVIDIA H100 80GB HBM3 (9.0)"]),
    # mixed: one GPU left out fails the host, naming that one only
    ([V100, H100], "12.8", CU128_211, DRIVER, "fail", ["needs sm_70"]),
    # the "driver too old" case: a CUDA 13 build under R570
    ([B200], "13.0", CU130, "570.195.03", "fail",
     ["driver too old: CUDA 13.x builds need driver >= 580, the host runs 570.195.03",
      '"The NVIDIA driver on your system is too old"']),
    # arch-specific kernels run on their own compute capability only
    ([H100], "12.8", ["sm_90a"], DRIVER, "pass", []),
    ([A100], "12.8", ["sm_90a"], DRIVER, "fail", ["needs sm_80"]),
    ([B200], "12.8", [], DRIVER, "unknown", ["architecture list is empty"]),
])
def test_check_build(models, cuda, archs, driver, status, fragments):
    verdict = check_build(models, "2.11.0+cu" + cuda.replace(".", ""), cuda, archs, driver)
    assert verdict.status == status, verdict.message
    for fragment in fragments:
        assert fragment in verdict.message


def test_ptx_only_coverage_needs_the_builds_toolkit_driver():
    future = dataclasses.replace(model_for_name("NVIDIA RTX PRO 6000 Blackwell Server Edition"),
                                 name="future GPU", compute_capability="13.0")
    ok = check_build([future], "2.11.0+cu130", "13.0", CU130, "580.159.04")
    assert ok.status == "pass" and "future GPU runs by JIT from PTX" in ok.message
    old = check_build([future], "2.11.0+cu130", "13.0", CU130, "580.65.06")  # < 13.0's toolkit driver 580.82.07
    assert old.status == "fail" and "future GPU (compute capability 13.0) needs sm_130" in old.message


# --- the gate's check ------------------------------------------------------------------------------


def _ctx(build: TorchBuildData, models=(B200,), pytorch_version="2.11", torch_probe=True, driver=DRIVER,
         runtime="python", asked=None):
    settings = SimpleNamespace(pytorch_version=pytorch_version, pytorch_runtime=runtime,
                               pytorch_python="/usr/bin/python3", pytorch_venv_path="/opt/gpufleet/pytorch")

    def fact(cls, **kwargs):
        assert cls is TorchBuild
        if asked is not None:
            asked.append(kwargs)
        return build

    def resolution():
        from gpufleet.errors import Incompatible
        raise Incompatible("not needed here", key=None)

    return SimpleNamespace(
        torch_probe=torch_probe, probe_skip="probes turned off", fact=fact,
        hardware=lambda: SimpleNamespace(models=tuple(models)), resolution=resolution,
        driver=DriverStateData(module_version=driver, userspace_version=driver),
        gpu=SimpleNamespace(ok=False), settings=settings, runtime=runtime_of(settings),
        wanted_pytorch=lambda: None)


def _built(version, cuda, archs):
    return TorchBuildData(status="ok", torch=version, cuda=cuda, arch_list=archs, python="3.12.3",
                          path="/usr/local/lib/python3.12/dist-packages/torch")


def test_gate_fails_a_build_without_the_gpus_sm_and_names_the_wheel_that_fits():
    result = pytorch_build_runs_here(_ctx(_built("2.6.0+cu126", "12.6", CU126_211)))
    assert result.status == FAIL
    assert "NVIDIA B200 (compute capability 10.0) needs sm_100" in result.message
    # no 2.6 wheel has sm_100 and the tier's choice does not resolve here: where to ask
    assert "install a CUDA build that covers these GPUs (tools/compat --gpu 'NVIDIA B200'" in result.fix
    same_release = pytorch_build_runs_here(_ctx(_built("2.11.0+cu126", "12.6", CU126_211)))
    assert same_release.fix == "pip install --force-reinstall torch==2.11.* --index-url https://download.pytorch.org/whl/cu130"


def test_gate_passes_a_covering_build():
    result = pytorch_build_runs_here(_ctx(_built("2.11.0+cu128", "12.8", CU128_211)))
    assert result.status == PASS and result.message.startswith("torch 2.11.0+cu128 (CUDA 12.8, built for sm_75")


def test_gate_fails_the_driver_floor():
    result = pytorch_build_runs_here(_ctx(_built("2.11.0+cu130", "13.0", CU130), driver="570.195.03"))
    assert result.status == FAIL and "driver too old" in result.message


def test_gate_flags_a_cpu_only_build_on_a_gpu_host():
    cpu = parse_torch_build(RECORDED_CPU)
    result = pytorch_build_runs_here(_ctx(cpu))
    assert result.status == FAIL
    assert result.message.startswith("torch 2.13.0+cpu (/usr/local/lib/python3.11/dist-packages/torch) is a CPU-only "
                                     "build (torch.version.cuda is None)")
    assert result.fix == "pip install --force-reinstall torch==2.13.* --index-url https://download.pytorch.org/whl/cu130"
    # a tier that picks no PyTorch: a warning, the same fix
    assert pytorch_build_runs_here(_ctx(cpu, pytorch_version="none")).status == WARN


def test_gate_says_when_there_is_nothing_to_check():
    # the tier asks for a runtime that has no PyTorch: a warning naming what to set, never a silent skip
    no_python = pytorch_build_runs_here(_ctx(TorchBuild().default()))
    assert (no_python.status, no_python.message) == (
        WARN, "no PyTorch to run it with: /usr/bin/python3: no such interpreter "
              "(runtime python /usr/bin/python3 (pytorch_python))")
    assert no_python.fix.startswith("set pytorch_runtime: venv (gpufleet installs the resolved wheel for the host's "
                                    "users), or pytorch_python to the python of the site's venv or conda env")
    no_torch = pytorch_build_runs_here(_ctx(parse_torch_build(RECORDED_NO_TORCH)))
    assert (no_torch.status, no_torch.message) == (
        WARN, "no PyTorch to run it with: /usr/bin/python3 (python 3.11.2) imports no torch (No module named 'torch') "
              "(runtime python /usr/bin/python3 (pytorch_python))")
    # gpufleet's venv not there yet: the deploy installs it
    asked: list = []
    venv = pytorch_build_runs_here(_ctx(parse_torch_build(RECORDED_NO_TORCH), runtime="venv", asked=asked))
    assert asked == [{"python": "/opt/gpufleet/pytorch/bin/python"}]
    assert venv.status == WARN and "runtime venv /opt/gpufleet/pytorch" in venv.message
    assert venv.fix.startswith("run deploys/all.py (or deploys/pytorch.py): it installs the resolved wheel into "
                               "/opt/gpufleet/pytorch")
    # none on purpose: said so, with the key
    asked.clear()
    none = pytorch_build_runs_here(_ctx(parse_torch_build(RECORDED_NO_TORCH), runtime="none", asked=asked))
    assert none.status == SKIP and "pytorch_runtime: none" in none.message and asked == []
    no_gpu = pytorch_build_runs_here(_ctx(_built("2.11.0+cu128", "12.8", CU128_211), models=()))
    assert no_gpu.status == SKIP and no_gpu.message.startswith("nothing to check against: no known NVIDIA GPU")
    off = pytorch_build_runs_here(_ctx(_built("2.11.0+cu126", "12.6", CU126_211), torch_probe=False))
    assert (off.status, off.message) == (SKIP, "probes turned off")
    unknown = pytorch_build_runs_here(_ctx(parse_torch_build([])))
    assert unknown.status == WARN
