"""PyTorch wheel choice (gpufleet/catalog/pytorch.py through the resolver) and tools/compat.

Real GPUs from compat.yaml (Volta, Turing, Ampere, Ada, Hopper, Blackwell) against real PyTorch
releases (2.5 ... 2.14). Every case is run twice: through compat_cli.answer() (the resolver) and
through the tools/compat command line as a subprocess (exit code, text and --json). A refusal
must say why, in the words `import torch` would use, and name the GPU and what it lacks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api.inventory import Inventory

from gpufleet.apps.compat import OPTIONS, answer, render
from gpufleet.errors import Incompatible, InventoryError
from gpufleet.catalog.gpus import model_for_name
from gpufleet.catalog.pytorch import choose_pytorch, kernel_for, mixed_gpus, pytorch_data
from gpufleet.config.resolver import resolve
from gpufleet.config.settings import validate_inventory

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compat"

V100 = "Tesla V100-SXM2-16GB"
T4 = "Tesla T4"
A100 = "NVIDIA A100-SXM4-80GB"
A10 = "NVIDIA A10"
L4 = "NVIDIA L4"
H100 = "NVIDIA H100 80GB HBM3"
H100_PCIE = "NVIDIA H100 PCIe"
H200 = "NVIDIA H200"
B200 = "NVIDIA B200"
B300 = "NVIDIA B300 SXM6 AC"
RTX_PRO = "NVIDIA RTX PRO 6000 Blackwell Server Edition"

NO_KERNEL = '"no kernel image is available for execution on the device"'
TOO_OLD = '"The NVIDIA driver on your system is too old"'

# (id, GPUs, OS, extra arguments, wheel variant or None if refused, fragments the answer must contain)
CASES = [
    ("hopper-h200-2.11", [H200], "ubuntu-24.04", ["--driver-branch", "580", "--cuda", "13.0", "--cudnn", "9.17.0", "--pytorch", "2.11"],
     "cu130", ["R580 580.159.04", "cuda-toolkit-13-0", "libcudnn9-cuda-13",
               "pip install torch==2.11.* --index-url https://download.pytorch.org/whl/cu130"]),
    ("hopper-h100-old-2.5", [H100], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.5"],
     "cu124", ["https://download.pytorch.org/whl/cu124"]),
    # CUDA 13 wheels dropped sm_70, and so did 2.11's cu128 (PT4, the real wheel's arch list):
    # Volta gets cu126 (2.10's cu128 still has sm_70)
    ("volta-v100-2.11", [V100], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.11"],
     "cu126", ["whl/cu126"]),
    ("volta-v100-2.10", [V100], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.10"],
     "cu128", ["whl/cu128"]),
    # 2.7's cu128 wheels have no sm_70 (PyTorch put it back in 2.8: pytorch#157517)
    ("volta-v100-2.7", ["Tesla V100-PCIE-32GB"], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.7"],
     "cu126", ["whl/cu126"]),
    ("volta-v100-2.14", [V100], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.14"],
     "cu126", ["whl/cu126"]),
    ("turing-t4-2.11", [T4], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.11"],
     "cu130", ["whl/cu130"]),
    # Debian 12's own R535: CUDA 13 wheels need 580, the CUDA 12.8 wheel runs by minor-version compatibility
    ("turing-t4-debian-distro-2.11", [T4], "debian-12", ["--driver-source", "distro", "--pytorch", "2.11"],
     "cu128", ["R535", "minor-version compatibility"]),
    # cu130 is experimental in 2.9: the newest stable variant wins
    ("ampere-a100-2.9", [A100], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.9"],
     "cu128", ["whl/cu128"]),
    ("ampere-a10-2.6", [A10], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.6"],
     "cu124", ["whl/cu124"]),
    # sm_86 SASS runs on 8.9 (same major): Ada is covered by an Ampere build
    ("ada-l4-2.5", [L4], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.5"],
     "cu124", ["whl/cu124"]),
    # only the experimental cu128 build of 2.7 has sm_100
    ("blackwell-b200-2.7", [B200], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.7"],
     "cu128", ["experimental"]),
    ("blackwell-b200-2.6-no-kernel", [B200], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.6"],
     None, ["no kernel image", "NVIDIA B200 (compute capability 10.0) needs sm_100", NO_KERNEL,
            "built for sm_50, sm_60, sm_70, sm_75, sm_80, sm_86, sm_90"]),
    ("blackwell-b200-r570-2.12-driver-too-old", [B200], "ubuntu-24.04", ["--driver-branch", "570", "--pytorch", "2.12"],
     None, ["driver too old", "CUDA 13.x wheels need driver >= 580", "the resolved driver is 570.195.03", TOO_OLD,
            "NVIDIA B200 (compute capability 10.0) needs sm_100"]),
    ("blackwell-auto-branch-2.12", [B200], "ubuntu-24.04", ["--pytorch", "2.12"],
     "cu130", ["R580", "whl/cu130"]),
    ("blackwell-rtx-pro-2.11", [RTX_PRO], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.11"],
     "cu130", ["whl/cu130"]),
    ("blackwell-rtx-pro-2.5-no-kernel", [RTX_PRO], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.5"],
     None, ["NVIDIA RTX PRO 6000 Blackwell Server Edition (compute capability 12.0) needs sm_120", NO_KERNEL]),
    # sm_100 SASS runs on 10.3
    ("blackwell-b300-2.11", [B300], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.11"],
     "cu130", ["whl/cu130"]),
    ("hopper-r535-2.12", [H100], "ubuntu-24.04", ["--driver-branch", "535", "--pytorch", "2.12"],
     "cu126", ["R535 535.247.01", "whl/cu126"]),
    # mixed hosts: every GPU must be covered by the one wheel
    ("mixed-v100-h100-2.11", [V100, H100_PCIE], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.11"],
     "cu126", ["mixed GPUs", "slowest GPU's pace", "CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]),
    ("mixed-a100-rtxpro-2.6-no-kernel", [A100, RTX_PRO], "ubuntu-24.04", ["--driver-branch", "580", "--pytorch", "2.6"],
     None, ["NVIDIA RTX PRO 6000 Blackwell Server Edition (compute capability 12.0) needs sm_120", NO_KERNEL,
            "mixed GPUs"]),
]
IDS = [case[0] for case in CASES]


def _wishes(extra: list[str]) -> dict[str, str]:
    flags = {flag: key for key, (flag, _) in OPTIONS.items()}
    wishes = {key: default for key, (_, default) in OPTIONS.items()}
    for flag, value in zip(extra[::2], extra[1::2]):
        wishes[flags[flag]] = value
    return wishes


@pytest.mark.parametrize("case_id, gpus, os_release, extra, variant, fragments", CASES, ids=IDS)
def test_resolver_answers(case_id, gpus, os_release, extra, variant, fragments):
    out = answer([model_for_name(g) for g in gpus], os_release, _wishes(extra))
    said = render(out)
    if variant is None:
        assert out["refused"], said
        assert out["refused_key"] == "pytorch_version"
        assert out["pytorch"] is None and out["driver"] is None
        assert out["allowed"][0] == "none" and len(out["allowed"]) > 1  # a JSON list
    else:
        assert out["refused"] is None, out["refused"]
        assert out["pytorch"]["cuda_variant"] == variant
        assert out["pytorch"]["index_url"] == f"https://download.pytorch.org/whl/{variant}"
    for fragment in fragments:
        assert fragment in said, (fragment, said)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=60)


def _argv(gpus: list[str], os_release: str, extra: list[str]) -> list[str]:
    argv = []
    for gpu in gpus:
        argv += ["--gpu", gpu]
    return argv + ["--os", os_release, *extra]


@pytest.mark.parametrize("case_id, gpus, os_release, extra, variant, fragments", CASES, ids=IDS)
def test_cli(case_id, gpus, os_release, extra, variant, fragments):
    argv = _argv(gpus, os_release, extra)
    text = _run(*argv)
    assert text.returncode == (0 if variant else 3), text.stdout + text.stderr
    for fragment in fragments:
        assert fragment in text.stdout, (fragment, text.stdout)
    if variant:
        assert f"--index-url https://download.pytorch.org/whl/{variant}" in text.stdout
    else:
        assert "REFUSED: no PyTorch" in text.stdout and "key:     pytorch_version" in text.stdout
    as_json = _run(*argv, "--json")
    assert as_json.returncode == text.returncode
    out = json.loads(as_json.stdout)
    assert {"driver", "cuda", "cudnn", "pytorch", "refused"} <= set(out)
    if variant:
        assert out["refused"] is None
        assert out["pytorch"]["cuda_variant"] == variant
        assert out["pytorch"]["version"] == extra[extra.index("--pytorch") + 1]
        assert out["pytorch"]["index_url"].endswith("/" + variant)
        assert out["driver"]["version"].startswith(out["driver"]["branch"] + ".")
    else:
        assert isinstance(out["refused"], str) and out["pytorch"] is None


def test_cli_needs_15_real_combinations():
    assert len(CASES) >= 15
    refusals = [c for c in CASES if c[4] is None]
    assert any(TOO_OLD in f for c in refusals for f in c[5])
    assert any(NO_KERNEL in f for c in refusals for f in c[5])


@pytest.mark.parametrize("argv, fragment", [
    (["--gpu", "NVIDIA H20", "--os", "ubuntu-24.04"], "unknown GPU 'NVIDIA H20' (did you mean 'NVIDIA H200'"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--pytorch", "2.4"], "PyTorch 2.4: the architecture lists of its wheels are unverified"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--pytorch", "3.0"], "PyTorch 3.0 is not in the compatibility data"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--pytorch", "2.11.0"], "expected a PyTorch release such as \"2.11\""),
    (["--gpu", H200, "--os", "plan9"], "unknown OS release 'plan9'"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--driver-branch", "999"], "argument --driver-branch"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--cuda", "13"], "argument --cuda"),
    (["--os", "ubuntu-24.04"], "at least one --gpu"),
    (["--gpu", H200], "--os is needed"),
    (["--gpu", H200, "--os", "ubuntu-24.04", "--driver-version", "580.159.04"], "needs --driver-branch"),
])
def test_cli_bad_arguments_exit_2(argv, fragment):
    result = _run(*argv)
    assert result.returncode == 2, result.stdout + result.stderr
    assert fragment in result.stderr, result.stderr
    assert result.stdout == ""


def test_cli_help_prints_help_only():
    result = _run("--help")
    assert result.returncode == 0
    flat = " ".join(result.stdout.split())
    assert "--pytorch" in flat and "exit codes: 0 the GPUs and OS fit" in flat and "; 3 refused:" in flat
    assert result.stderr == ""


def test_cli_accepts_pci_ids_like_the_deploys():
    result = _run("--gpu", "0x2335", "--os", "ubuntu-24.04", "--pytorch", "2.11", "--json")
    out = json.loads(result.stdout)
    assert out["gpus"] == [{"name": H200, "compute_capability": "9.0"}]
    assert out["pytorch"]["cuda_variant"] == "cu130"


# --- the rules themselves -----------------------------------------------------------------------


def _variant(release: str, name: str):
    return next(v for v in pytorch_data().releases[release] if v.name == name)


@pytest.mark.parametrize("gpu, release, variant, kind", [
    (L4, "2.5", "cu124", "sass"),        # 8.9 runs sm_86 SASS
    (B300, "2.11", "cu130", "sass"),     # 10.3 runs sm_100 SASS
    (V100, "2.11", "cu130", None),       # sm_70 gone from CUDA 13 wheels
    (V100, "2.7", "cu128", None),        # and from 2.7's cu128
    (V100, "2.8", "cu128", "sass"),      # back in 2.8
    (RTX_PRO, "2.6", "cu126", None),     # 12.0 is not 9.0's major: no SASS, no PTX
    (H100, "2.11", "cu130", "sass"),
])
def test_kernel_coverage(gpu, release, variant, kind):
    assert kernel_for(model_for_name(gpu), _variant(release, variant)) == kind


def test_ptx_only_coverage_needs_a_driver_as_new_as_the_toolkit():
    # A hypothetical compute capability 13.0 GPU: no SASS of its major anywhere; 2.8's cu129 wheel
    # carries 12.0+PTX, which the driver JIT-compiles only if it is at least CUDA 12.9's (575.57.08).
    import dataclasses
    future = dataclasses.replace(model_for_name(RTX_PRO), name="future GPU", compute_capability="13.0")
    assert kernel_for(future, _variant("2.8", "cu129")) == "ptx"
    assert kernel_for(future, _variant("2.8", "cu128")) is None  # 12.0 without +PTX
    assert kernel_for(model_for_name(RTX_PRO), _variant("2.8", "cu129")) == "sass"
    assert choose_pytorch([future], "2.8", "580.159.04").variant == "cu129"
    with pytest.raises(Incompatible) as info:
        choose_pytorch([future], "2.8", "570.195.03")
    assert "future GPU (compute capability 13.0) needs sm_130" in info.value.reason


def test_none_means_no_check():
    assert choose_pytorch([model_for_name("Tesla K80")], "none", "470.239.06") is None
    plan = resolve([model_for_name(H200)], {"driver_branch": "580"}, "ubuntu-24.04")
    assert plan.pytorch is None and plan.describe()["pytorch"] == "none"


def test_plan_line_is_the_pip_line():
    plan = resolve([model_for_name(H200)], {"driver_branch": "580", "pytorch_version": "2.11"}, "ubuntu-24.04")
    assert plan.describe()["pytorch"] == \
        "2.11 cu130: pip install torch==2.11.* --index-url https://download.pytorch.org/whl/cu130"


def test_auto_branch_skips_a_driver_too_old_for_the_wheel():
    # With 570 first, B200 + 2.12 (CUDA 13 only for sm_100) must land on a branch >= 580.
    plan = resolve([model_for_name(B200)], {"driver_branch": "auto", "pytorch_version": "2.12"}, "ubuntu-24.04")
    assert int(plan.driver_branch) >= 580 and plan.pytorch.variant.startswith("cu13")


def test_refusal_names_only_the_uncovered_gpu():
    with pytest.raises(Incompatible) as info:
        resolve([model_for_name(A100), model_for_name(RTX_PRO)], {"driver_branch": "580", "pytorch_version": "2.6"},
                "ubuntu-24.04")
    assert "needs sm_120" in info.value.reason and A100 not in info.value.reason
    assert info.value.key == "pytorch_version"
    assert "2.11" in info.value.allowed.split(", ") and "2.6" not in info.value.allowed.split(", ")


def test_mixed_gpus_note():
    assert mixed_gpus([model_for_name(H200)] * 8) is None
    note = mixed_gpus([model_for_name(A100), model_for_name(A100), model_for_name(T4)])
    assert "2 x NVIDIA A100-SXM4-80GB (compute capability 8.0), 1 x Tesla T4 (compute capability 7.5)" in note
    assert "NVIDIA A100-SXM4-80GB: CUDA_VISIBLE_DEVICES=0,1; Tesla T4: CUDA_VISIBLE_DEVICES=2" in note
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in note and "slowest GPU's pace" in note


# --- planning time: host, key, allowed ----------------------------------------------------------


def _problems(host_data: dict) -> list[str]:
    inv = Inventory(([("gpu-h01", host_data)], {}), pod=(["gpu-h01"], {"tier": "hgx"}))
    with pytest.raises(InventoryError) as info:
        validate_inventory(inv, source="")
    return info.value.problems


def test_inventory_refusal_no_kernel_image():
    [line] = _problems({"pytorch_version": "2.6"})
    assert line.startswith("host gpu-h01: key 'pytorch_version': incompatible: no PyTorch 2.6 wheel")
    assert "NVIDIA B200 (compute capability 10.0) needs sm_100" in line and NO_KERNEL in line
    assert line.endswith("allowed: none, 2.14, 2.13, 2.12, 2.11, 2.10, 2.9, 2.8, 2.7")


def test_inventory_refusal_driver_too_old():
    # R570 with a CUDA 12 host toolkit: H100/H200 get 2.12's cu126 wheel, B200 (sm_100 only in cu13x) cannot
    [line] = _problems({"pytorch_version": "2.12", "driver_branch": "570", "cuda_version": "12.8",
                        "cudnn_version": "9.10.2"})
    assert line.startswith("host gpu-h01: key 'pytorch_version': incompatible:")
    assert "CUDA 13.x wheels need driver >= 580, the resolved driver is 570.195.03" in line and TOO_OLD in line


@pytest.mark.parametrize("value, fragment", [
    (2.11, "PyTorch version given as a number 2.11; quote it"),
    ("2.4", "unverified"),
    ("latest", "expected a PyTorch release"),
])
def test_inventory_grammar(value, fragment):
    [line] = _problems({"pytorch_version": value})
    assert line.startswith("host gpu-h01: key 'pytorch_version': ") and fragment in line
    assert "allowed: none, 2.14" in line


# --- validation gate: mixed GPUs are said, with what they mean -----------------------------------


class _Ctx:
    def __init__(self, names):
        self.models = tuple(model_for_name(n) for n in names)

    def hardware(self):
        return self


def test_validation_warns_about_mixed_gpus():
    from gpufleet.checks.validation import PASS, WARN, one_gpu_model

    same = one_gpu_model(_Ctx([H200] * 2))
    assert (same.status, same.message) == (PASS, f"2 x {H200}")
    mixed = one_gpu_model(_Ctx([A100, A100, T4]))
    assert mixed.status == WARN
    assert "different compute capability and memory" in mixed.message.lower()
    assert "NVIDIA A100-SXM4-80GB: CUDA_VISIBLE_DEVICES=0,1; Tesla T4: CUDA_VISIBLE_DEVICES=2" in mixed.message
    assert "one GPU model per host" in mixed.fix
