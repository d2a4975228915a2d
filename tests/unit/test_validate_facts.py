"""Pure parsers of facts/validation.py, and the validation gate's areas and result lines."""
import pytest

from facts.validation import parse_container_gpus, parse_dcgm_diag
from gpufleet.validation import AREAS, CHECKS, STATUSES, Result

pytestmark = pytest.mark.unit


def test_container_gpus():
    data = parse_container_gpus(["docker=yes", "active=active", 'runtimes={"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}',
                                 "ctk=yes", "cdi: nvidia.com/gpu=0", "cdi: nvidia.com/gpu=1",
                                 "cdi: nvidia.com/gpu=GPU-517ec679", "cdi: nvidia.com/gpu=all"])
    assert data.docker and data.nvidia_runtime and data.toolkit and data.active == "active"
    assert data.gpu_indices == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    none = parse_container_gpus(["docker=no", "active=inactive"])
    assert not none.docker and none.gpu_indices == []


def test_dcgm_diag():
    ok = ["+---------------------------+------------------------------------------------+",
          "| Diagnostic                | Result                                         |",
          "| Deployment                | Pass                                           |",
          "| Blacklist                 | Pass                                           |",
          "| NVML Library              | Pass                                           |", "::gpufleet:: rc 0"]
    assert parse_dcgm_diag(ok).status == "pass"
    bad = ok[:3] + ["| Persistence Mode          | Fail                                           |", "::gpufleet:: rc 226"]
    assert (parse_dcgm_diag(bad).status, parse_dcgm_diag(bad).failed) == ("fail", ["Persistence Mode"])
    assert parse_dcgm_diag(["::gpufleet:: no-dcgmi"]).status == "not-installed"
    assert parse_dcgm_diag(["Error: unable to connect to host engine", "::gpufleet:: rc 255"]).status == "error"


def test_every_check_belongs_to_a_known_area_and_results_read_as_lines():
    assert {area for area, _ in CHECKS} <= set(AREAS)
    line = Result("base", "the gpufleet marker matches the tier", "fail", "missing", "run deploys/all.py").line()
    assert line == "[FAIL] base: the gpufleet marker matches the tier: missing -> fix: run deploys/all.py"
    assert set(STATUSES) == {"pass", "fail", "warn", "skip"}
