"""The CUDA toolkit's own -X-Y libraries (libcublas-13-0, libnpp-13-0, gds-tools-13-0 ...) are
installed and held at the toolkit release's versions by deploys/driver.py; the manifest a
rollout writes before it changes a host records them, and tools/rollback puts them back.

Planned by pyinfra on the simulated provisioned Ubuntu 22.04 host (testing/ubuntu_host.py, a
test double answering facts from recorded output), with a CUDA toolkit added to its dpkg list."""
from __future__ import annotations

import shlex
from dataclasses import dataclass

from gpufleet.rollout import manifest as mf
from gpufleet.rollout.context import RolloutContext
from testing.ubuntu_host import UbuntuHost, canned, make_state, on_host, planned_operations

NAME = "gpu-ubuntu-2204"
TOOLKIT = {  # dpkg-query's "package version status" lines, as the double answers them
    "cuda-toolkit-13-0": "13.0.2-1", "cuda-nvcc-13-0": "13.0.88-1", "libcublas-13-0": "13.1.0.3-1",
    "libnpp-13-0": "13.0.1.2-1", "gds-tools-13-0": "1.15.1.6-1",
}
LOOKALIKE = {"libgtk-3-0": "3.24.33-1ubuntu2"}  # ends like a -X-Y component of a toolkit 3-0 that is not there


@dataclass
class WithToolkit(UbuntuHost):
    def _dpkg_lines(self) -> list[str]:
        extra = [f"{p} {v} hi " for p, v in TOOLKIT.items()] + [f"{p} {v} ii " for p, v in LOOKALIKE.items()]
        return super()._dpkg_lines() + extra


def _host():
    host = WithToolkit("22.04", ["Tesla T4"], provisioned=True)
    state = make_state({NAME: (host, {"tier": "dev", "validate_os_release": "ubuntu-22.04"})})
    return host, state


def test_component_patterns_follow_the_installed_toolkits():
    installed = {"cuda-toolkit-13-0": "13.0.2-1", "cuda-toolkit-12-8": None, "libcudnn9-cuda-13": "9.17.0.29-1"}
    nsight = ["nsight-systems-20*", "nsight-compute-20*"]   # the release-named Nsight a toolkit may reach
    assert mf.toolkit_component_patterns(installed) == ["lib*-13-0", "gds-*-13-0", *nsight]
    assert mf.toolkit_component_patterns({"cuda-toolkit-12-8": "12.8.1-1", "cuda-toolkit-13-0": "13.0.2-1"}) == [
        "lib*-12-8", "gds-*-12-8", "lib*-13-0", "gds-*-13-0", *nsight]
    assert mf.toolkit_component_patterns({"nvidia-open": "580.126.09-1"}) == []


def test_the_manifest_records_the_toolkit_libraries_and_rollback_puts_them_back():
    from gpufleet.operations import manifest_steps as steps
    from gpufleet.deploys.rollback import restore

    host, state = _host()
    with canned({NAME: host}), on_host(state, NAME):
        installed = steps.installed_packages()
    assert TOOLKIT.items() <= installed.items()
    assert "libgtk-3-0" not in installed  # no cuda-toolkit-3-0: not a component
    # a manifest from before a rollout moved the toolkit to a later update: rollback puts back the
    # libraries too, not only the cuda-* packages
    recorded = {**installed, "cuda-toolkit-13-0": "13.0.1-1", "libcublas-13-0": "13.0.2.14-1",
                "gds-tools-13-0": "1.15.0.42-1"}
    doc = mf.build(host=NAME, ident="20261201T120000Z", created=0.0, reason="test", packages=recorded,
                   holds=sorted(TOOLKIT), etc_files={}, driver={}, gpus=[], disk_snapshot=None)
    host, state = _host()
    with canned({NAME: host}), on_host(state, NAME) as h:
        restore(RolloutContext(target="580.82.07", manifests={NAME: doc}))
        ops = planned_operations(state, h)
    [command] = [c for _, commands in ops for c in commands if "gpufleet-package-change" in c and "systemd-run" in c]
    words = shlex.split(command)
    args = words[words.index("gpufleet-package-change") + 1:]
    assert "install=libcublas-13-0=13.0.2.14-1" in args
    assert "install=gds-tools-13-0=1.15.0.42-1" in args
    assert "install=cuda-toolkit-13-0=13.0.1-1" in args
    assert not any(a.startswith("install=libnpp-13-0=") for a in args)  # at its recorded version already
    assert {f"hold={p}" for p in TOOLKIT} <= set(args)
