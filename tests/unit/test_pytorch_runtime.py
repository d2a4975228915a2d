"""Where the host's PyTorch lives (gpufleet/plans/pytorch_runtime.py): the keys' grammar refused at
planning naming host and key, the venv install plan from the resolver's choice, the facts' own
guard on the interpreter path, and the gate's probe line naming the runtime (or what to set)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gpufleet.facts.gpu_checks import PerfProbe
from gpufleet.facts.pytorch import TorchBuild
from gpufleet.catalog.pytorch import choose_pytorch
from gpufleet.catalog.gpus import model_for_name
from gpufleet.plans.pytorch_runtime import INSTALL_SCRIPT, MARKER, runtime_of, venv_plan
from gpufleet.checks.validation import SKIP, WARN, performance
from tests.unit.test_settings import inventory, problems_of

pytestmark = pytest.mark.unit

H200 = model_for_name("NVIDIA H200")
CHOICE = choose_pytorch([H200], "2.11", "580.126.09")


@pytest.mark.parametrize("data, key, fragment", [
    ({"pytorch_python": "/usr/bin/python3;id"}, "pytorch_python", "contains the shell metacharacter ';'"),
    ({"pytorch_python": "/usr/bin/python3 -c x"}, "pytorch_python", "path components may only use"),
    ({"pytorch_python": "python3"}, "pytorch_python", "is not an absolute path"),
    ({"pytorch_python": "/opt/../usr/bin/python3"}, "pytorch_python", "path traversal"),
    ({"pytorch_runtime": "conda"}, "pytorch_runtime", "allowed: venv | python | none"),
    ({"pytorch_venv_path": "/tmp/torch"}, "pytorch_venv_path", "world-writable"),
    ({"pytorch_venv_path": "/home/alice/venv"}, "pytorch_venv_path", "per-user"),
    ({"pytorch_venv_path": "/opt"}, "pytorch_venv_path", "system"),
    ({"pytorch_venv_path": "/usr"}, "pytorch_venv_path", "system"),
    ({"pytorch_index_url": "https://user:secret@mirror.example/whl/{variant}"}, "pytorch_index_url",
     "carries credentials"),
    ({"pytorch_index_url": "ftp://mirror.example/whl"}, "pytorch_index_url", "the scheme must be http or https"),
    ({"pytorch_index_url": "https://mirror.example/whl/{release}"}, "pytorch_index_url", "braces only as {variant}"),
    ({"pytorch_index_url": "https://mirror.example/whl?x=1"}, "pytorch_index_url", "query or fragment"),
    ({"pytorch_wheel_dir": "wheels"}, "pytorch_wheel_dir", "is not an absolute path"),
    ({"pytorch_wheel_dir": "/srv/wheels;id"}, "pytorch_wheel_dir", "shell metacharacter"),
    # venv installs the wheel of pytorch_version: none leaves nothing to install
    ({"pytorch_version": "none"}, "pytorch_runtime", "venv installs the wheel of pytorch_version, which is none"),
])
def test_bad_values_stop_at_planning_naming_host_and_key(data, key, fragment):
    problems = problems_of(inventory(data))  # tier hgx: pytorch_runtime venv
    line = next((p for p in problems if p.startswith(f"host gpu-a01: key '{key}': ")), "")
    assert fragment in line and "; allowed: " in line, problems


def test_good_values_pass():
    from gpufleet.config.settings import validate_inventory

    validate_inventory(inventory({"pytorch_runtime": "python", "pytorch_python": "/opt/conda/envs/ml/bin/python3.11",
                                  "pytorch_version": "none"}))
    validate_inventory(inventory({"pytorch_venv_path": "/srv/pytorch-2.11", "pytorch_wheel_dir": "/srv/wheels",
                                  "pytorch_index_url": "http://10.0.0.5:8080/whl/{variant}"}))


def _settings(**over):
    values = {"pytorch_runtime": "venv", "pytorch_python": "/usr/bin/python3",
              "pytorch_venv_path": "/opt/gpufleet/pytorch", "pytorch_index_url": "auto", "pytorch_wheel_dir": "none",
              "pytorch_version": "2.11"}
    return SimpleNamespace(**{**values, **over})


def test_the_venv_installs_the_resolvers_wheel_from_where_the_tier_says():
    assert (CHOICE.version, CHOICE.variant) == ("2.11", "cu130")
    plan = venv_plan(_settings(), CHOICE)
    assert (plan.spec, plan.variant, plan.marker) == ("torch==2.11.*", "cu130", "/opt/gpufleet/pytorch/gpufleet-torch")
    assert plan.source == ("--index-url", "https://download.pytorch.org/whl/cu130")  # as tools/compat names it
    mirror = venv_plan(_settings(pytorch_index_url="https://mirror.example/pytorch/{variant}"), CHOICE)
    assert mirror.source == ("--index-url", "https://mirror.example/pytorch/cu130")
    offline = venv_plan(_settings(pytorch_wheel_dir="/srv/wheels"), CHOICE)
    assert offline.source == ("--no-index", "--find-links", "/srv/wheels")
    # the record names the wheel, not where it came from: a new mirror installs nothing again
    assert plan.record == mirror.record == offline.record == "torch==2.11.* cu130\n"
    # the script writes the record where the operation reads it, last
    assert INSTALL_SCRIPT.rstrip().splitlines()[-2] == f'mv -f "$venv/.gpufleet-torch.new" "$venv/{MARKER}"'


def test_the_runtime_names_its_interpreter():
    assert runtime_of(_settings()).python == "/opt/gpufleet/pytorch/bin/python"
    assert runtime_of(_settings(pytorch_runtime="python", pytorch_python="/opt/conda/bin/python")).python == \
        "/opt/conda/bin/python"
    assert runtime_of(_settings(pytorch_runtime="none")).kind == "none"


@pytest.mark.parametrize("python", ["python3 -c 'import os'", "/usr/bin/python3;id", "../python", "/opt/../bin/sh"])
def test_the_facts_refuse_anything_but_an_interpreter_path(python):
    with pytest.raises(ValueError):
        TorchBuild().command(python=python)
    with pytest.raises(ValueError):
        PerfProbe().command(python=python)


def _probe_ctx(lines, runtime="venv"):
    settings = _settings(pytorch_runtime=runtime)
    asked = []

    def fact(cls, **kwargs):
        asked.append(kwargs.get("python"))
        return lines

    ctx = SimpleNamespace(probe=True, probe_skip="", fact=fact, gpu=SimpleNamespace(ok=False),
                          runtime=runtime_of(settings), wanted_pytorch=lambda: CHOICE)
    return ctx, asked


def test_the_probe_runs_with_the_runtime_and_says_which():
    lines = [json.dumps({"status": "ok", "torch": "2.11.0+cu130", "cuda_devices": 0, "device": "cuda"}),
             json.dumps({"metric": "matmul", "status": "skipped", "reason": "no CUDA device"})]
    ctx, asked = _probe_ctx(lines)
    result = performance(ctx)
    assert asked == ["/opt/gpufleet/pytorch/bin/python"]
    assert (result.status, result.message) == (
        SKIP, "skipped (torch 2.11.0+cu130, runtime venv /opt/gpufleet/pytorch (gpufleet's, pytorch_runtime)): "
              "matmul: no CUDA device")


def test_a_runtime_without_torch_is_a_warning_naming_what_to_set():
    missing = [json.dumps({"status": "skipped", "reason": "PyTorch not installed"})]
    result = performance(_probe_ctx(missing, runtime="python")[0])
    assert result.status == WARN
    assert result.message == ("no PyTorch to run it with: /usr/bin/python3: it imports no torch "
                              "(runtime python /usr/bin/python3 (pytorch_python))")
    assert result.fix.startswith("set pytorch_runtime: venv (gpufleet installs torch 2.11 cu130 for the host's users)")
    venv = performance(_probe_ctx(PerfProbe.default())[0])
    assert venv.status == WARN and "/opt/gpufleet/pytorch/bin/python: no such interpreter" in venv.message
    assert "pytorch_index_url" in venv.fix and "pytorch_wheel_dir" in venv.fix
    ctx, asked = _probe_ctx(missing, runtime="none")
    none = performance(ctx)
    assert none.status == SKIP and "pytorch_runtime: none" in none.message and asked == []
