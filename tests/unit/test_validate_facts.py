"""Pure parsers of facts/gpu_checks.py, and the validation gate's areas and result lines."""
import pytest

from gpufleet.facts.gpu_checks import parse_container_gpus
from gpufleet.checks.validation import AREAS, CHECKS, STATUSES, Result

pytestmark = pytest.mark.unit


def test_container_gpus():
    data = parse_container_gpus(["docker=yes", "active=active", 'runtimes={"nvidia":{"path":"nvidia-container-runtime"},"runc":{}}',
                                 "ctk=yes", "cdi: nvidia.com/gpu=0", "cdi: nvidia.com/gpu=1",
                                 "cdi: nvidia.com/gpu=GPU-517ec679", "cdi: nvidia.com/gpu=all"])
    assert data.docker and data.nvidia_runtime and data.toolkit and data.active == "active"
    assert data.gpu_indices == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    none = parse_container_gpus(["docker=no", "active=inactive"])
    assert not none.docker and none.gpu_indices == []


def test_every_check_belongs_to_a_known_area_and_results_read_as_lines():
    assert {area for area, _ in CHECKS} <= set(AREAS)
    line = Result("base", "the gpufleet marker matches the tier", "fail", "missing", "run deploys/all.py").line()
    assert line == "[FAIL] base: the gpufleet marker matches the tier: missing -> fix: run deploys/all.py"
    assert set(STATUSES) == {"pass", "fail", "warn", "skip"}


def _ctx(**driver):
    from types import SimpleNamespace

    from gpufleet.facts.kernel import DriverStateData

    return SimpleNamespace(driver=DriverStateData(**driver), settings=SimpleNamespace())


def test_kernel_installed_later_without_the_module_warns():
    from gpufleet.checks.validation import kernels_have_the_module

    later = _ctx(userspace_version="580.126.09", kernel_release="6.1.0-27-amd64", module_version="580.126.09",
                 loaded_modules={"nvidia": "580.126.09"},
                 installed_kernels={"6.1.0-27-amd64": True, "6.1.0-28-amd64": False, "6.1.0-28-cloud-amd64": False})
    result = kernels_have_the_module(later)
    assert result.status == "warn"
    assert result.message.startswith("no nvidia module for 6.1.0-28-amd64, 6.1.0-28-cloud-amd64")
    assert "linux-headers-amd64 linux-headers-cloud-amd64" in result.fix
    ok = _ctx(userspace_version="580.126.09", kernel_release="6.1.0-27-amd64",
              installed_kernels={"6.1.0-27-amd64": True})
    assert kernels_have_the_module(ok).status == "pass"
    # the running kernel's module is loaded even where it came from elsewhere (a prebuilt one)
    loaded = _ctx(userspace_version="580.126.09", kernel_release="6.8.0-60-generic", module_version="580.126.09",
                  installed_kernels={"6.8.0-60-generic": False})
    assert kernels_have_the_module(loaded).status == "pass"
    assert kernels_have_the_module(_ctx(installed_kernels={"6.1.0-28-amd64": False})).status == "skip"  # no driver
    assert kernels_have_the_module(_ctx(userspace_version="580.126.09")).status == "skip"  # container


def test_kernel_without_its_prebuilt_module_warns_and_names_the_rollout():
    from gpufleet.facts.packages import DpkgEntry
    from gpufleet.checks.validation import kernels_have_the_module

    module = "linux-modules-nvidia-580-server-open-6.8.0-90-generic"
    # Ubuntu 22.04, prebuilt modules for 6.8.0-90; a 6.8.0-94 kernel came in without its build
    later = _ctx(userspace_version="580.173.02", kernel_release="6.8.0-90-generic", module_version="580.173.02",
                 loaded_modules={"nvidia": "580.173.02"},
                 packages={module: DpkgEntry(module, "6.8.0-90.91~22.04.1+1", "hi")},
                 installed_kernels={"6.8.0-90-generic": True, "6.8.0-94-generic": False})
    result = kernels_have_the_module(later)
    assert result.status == "warn"
    assert result.message.startswith("no prebuilt nvidia module for 6.8.0-94-generic")
    assert "tools/rollout" in result.fix and "linux-headers" not in result.fix  # no DKMS to feed headers to
    both = _ctx(userspace_version="580.173.02", kernel_release="6.8.0-90-generic",
                packages={module: DpkgEntry(module, "6.8.0-90.91~22.04.1+1", "hi")},
                installed_kernels={"6.8.0-90-generic": True})
    assert kernels_have_the_module(both).status == "pass"
