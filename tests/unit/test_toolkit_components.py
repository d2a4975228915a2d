"""The CUDA toolkit's component packages: the closure StackPackages reads from dpkg and the
gate's verdict on it (gpufleet.catalog.cuda_stack.component_drift)."""
from __future__ import annotations

from gpufleet.facts.packages import toolkit_components
from gpufleet.catalog.cuda_stack import component_drift

ENTRIES = {
    "cuda-toolkit-13-0": ("13.0.2-1", "hi", "cuda-toolkit-config-common, cuda-toolkit-13-0-config-common, "
                                            "cuda-compiler-13-0 (>= 13.0.2), libcublas-13-0 (>= 13.1.0.3)"),
    "cuda-compiler-13-0": ("13.0.2-1", "hi", "cuda-nvcc-13-0 (>= 13.0.88), cuda-cuobjdump-13-0 | cuda-foo-13-0"),
    "cuda-nvcc-13-0": ("13.0.96-1", "ii", "cuda-toolkit-13-0-config-common"),
    "libcublas-13-0": ("13.1.0.3-1", "hi", ""),
    "cuda-nvcc-12-8": ("12.8.93-1", "hi", ""),
}


def test_closure_follows_depends_named_like_the_toolkit():
    got = toolkit_components(ENTRIES, sorted(ENTRIES))
    # config-common is not named *-13-0; alternatives are not followed; 12-8 is another toolkit
    assert got == {"cuda-compiler-13-0": ["13.0.2-1", "13.0.2", True],
                   "cuda-nvcc-13-0": ["13.0.96-1", "13.0.88", False],
                   "libcublas-13-0": ["13.1.0.3-1", "13.1.0.3", True]}


def test_a_component_off_its_release_is_drift_only_while_the_toolkit_is_exact():
    components = toolkit_components(ENTRIES, sorted(ENTRIES))
    installed = {"cuda-toolkit-13-0": "13.0.2-1"}
    assert component_drift(components, {"cuda-toolkit-13-0": "13.0.2"}, installed) == [
        "cuda-nvcc-13-0 13.0.96 (the CUDA toolkit release ships 13.0.88) was changed by hand"]
    # the toolkit itself at another release: its own pending upgrade or drift, not its components'
    assert component_drift(components, {"cuda-toolkit-13-0": "13.0.3"}, installed) == []


def test_components_at_their_release_are_no_drift():
    entries = {**ENTRIES, "cuda-nvcc-13-0": ("13.0.88-1", "hi", "")}
    components = toolkit_components(entries, sorted(entries))
    assert component_drift(components, {"cuda-toolkit-13-0": "13.0.2"}, {"cuda-toolkit-13-0": "13.0.2-1"}) == []
    assert all(held for _, _, held in components.values())
