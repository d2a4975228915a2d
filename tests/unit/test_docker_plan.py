"""gpufleet/plans/docker.py on recorded facts: the plan made from a converged real host's facts
(tests/unit/recorded_host.py: Debian 12, docker.io, toolkit 1.18.0-1) changes nothing there;
a fresh host's plan installs and needs a restart; each refusal is data; what of a daemon.json
change a reload applies and what needs a restart."""
from __future__ import annotations

import dataclasses
import json

import pytest

from gpufleet.facts.docker import DaemonJson
from gpufleet.facts.system import OsRelease
from gpufleet.plans import docker as d
from gpufleet.plans.refusal import Refusal
from tests.unit import recorded_host as recorded

pytestmark = pytest.mark.unit

GPU = "GPU-5f0c4e1e-0000-4000-8000-000000000001"


def daemon_raw() -> bytes:
    current = recorded.fact(DaemonJson, "/etc/docker/daemon.json")
    assert current.exists
    return bytes(current.raw)


def repos(settings):
    rel = recorded.fact(OsRelease, "cat /etc/os-release")
    return d.repositories(settings, rel.id, rel.version_codename, "amd64")


def planned(daemon: bytes | None = None, installed=None, candidates=None, **over) -> d.DockerPlan | Refusal:
    settings = recorded.settings(**over)
    engine = d.ENGINES[settings.docker_source]
    return d.plan(settings, daemon_raw=daemon_raw() if daemon is None else daemon,
                  installed=recorded.package_versions(engine.watched()) if installed is None else installed,
                  candidates=candidates, repos=repos(settings), gpu_uuids=[GPU])


def test_the_converged_recorded_host_plans_no_change_of_daemon_json():
    plan = planned()
    assert isinstance(plan, d.DockerPlan)
    assert plan.engine_packages == ("docker.io",)  # Debian 12's docker.io has its CLI inside
    assert plan.hold == ("containerd", "docker.io", "libnvidia-container-tools", "libnvidia-container1",
                         "nvidia-container-toolkit", "nvidia-container-toolkit-base", "runc")
    assert plan.toolkit_packages[0] == "nvidia-container-toolkit=1.18.0-1"
    assert plan.daemon.changed == () and plan.daemon.restart_keys == () and plan.daemon.restart_for == ()
    assert plan.docker_repo is None and plan.toolkit_repo.line.startswith("deb [signed-by=")
    assert plan.cdi_gpus == (GPU,) and plan.cdi_skipped is None
    assert plan.smoke_image is None  # docker_smoke_image: none on the recorded host
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.source = "docker"  # type: ignore[misc]


def test_a_fresh_host_installs_everything_and_needs_a_restart_for_the_toolkit():
    none = {p: None for p in d.ENGINES["distro"].watched()}
    plan = planned(b"", installed=none, candidates={"docker-cli": "26.1.5+dfsg1-9+b9"})
    assert isinstance(plan, d.DockerPlan)
    assert plan.engine_packages == ("docker.io", "docker-cli")  # Debian 13 splits the CLI out
    assert "docker-cli" in plan.hold
    assert plan.daemon.restart_for and plan.daemon.restart_for[-1] in plan.daemon.restart_keys
    assert "default-runtime" in plan.daemon.changed and "default-ulimits" in plan.daemon.restart_keys


def test_docker_source_docker_uses_dockers_repository_for_this_release():
    plan = planned(installed={p: None for p in d.ENGINES["docker"].watched()}, docker_source="docker",
                   docker_repo_url="https://mirror.example/docker/linux")
    assert isinstance(plan, d.DockerPlan)
    assert plan.engine_packages == ("docker-ce", "docker-ce-cli", "containerd.io")
    assert plan.docker_repo is not None
    assert plan.docker_repo.key_url == "https://mirror.example/docker/linux/debian/gpg"
    assert " bookworm stable" in plan.docker_repo.line and "arch=amd64" in plan.docker_repo.line


@pytest.mark.parametrize("daemon, over, key", [
    (b'{\n  "log-driver": "json-file",\n}\n', {}, "docker daemon.json"),
    (b"[]", {}, "docker daemon.json"),
    (None, {"docker_source": "docker"}, "docker_source"),  # the recorded host has docker.io
])
def test_each_refusal_is_data_naming_the_key(daemon, over, key):
    settings = recorded.settings(**over)
    installed = recorded.package_versions(sorted({*d.ENGINES["docker"].watched(), *d.ENGINES["distro"].watched()}))
    refusal = d.plan(settings, daemon_raw=daemon_raw() if daemon is None else daemon, installed=installed,
                     candidates=None, repos=repos(settings), gpu_uuids=[GPU])
    assert isinstance(refusal, Refusal)
    assert (refusal.area, refusal.key) == ("docker", key)
    assert refusal.reason and refusal.fix


def test_what_a_reload_applies_and_what_needs_a_restart():
    shm = planned(docker_shm_size="2g")
    assert isinstance(shm, d.DockerPlan)
    assert shm.daemon.changed == ("default-shm-size",) and shm.daemon.restart_keys == ()
    stack = planned(docker_ulimits={"memlock": -1, "stack": 33554432})
    assert isinstance(stack, d.DockerPlan)
    assert stack.daemon.changed == ("default-ulimits",) and stack.daemon.restart_keys == ("default-ulimits",)
    # the operator's own keys stay: the recorded file's storage-driver is not gpufleet's to change
    assert "storage-driver" not in stack.daemon.changed
    assert json.loads(daemon_raw())["storage-driver"] == "vfs"


def test_no_gpu_means_no_cdi_spec_and_says_why():
    settings = recorded.settings()
    plan = d.plan(settings, daemon_raw=daemon_raw(), installed=recorded.package_versions(d.ENGINES["distro"].watched()),
                  candidates=None, repos=repos(settings), gpu_uuids=[])
    assert isinstance(plan, d.DockerPlan)
    assert plan.cdi_gpus == () and plan.cdi_skipped == "no GPU visible to nvidia-smi: no CDI spec"
