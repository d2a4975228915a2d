"""End-to-end: GPU containers really run, and a daemon.json change never kills them.

A Debian 12 and a Debian 13 test host (docker.io 20.10 and 26.1), booted so that Docker can start containers inside it (`testhosts up
--private-network --containers`: a cgroup v2 tree of its own, CAP_NET_ADMIN in its own network
namespace; testing/testhosts.py says what each part fixes), GPU SIMULATED (testing/gpusim),
NVIDIA's container toolkit as STAND-IN packages whose runtime hook mounts the simulator's
nvidia-smi into GPU containers (testing/aptrepo.py), the engine as Debian's real docker.io, and a
smoke image built on the host (testing/smoke_image.py; no registry is reachable).

The operator already runs Docker (without live-restore) and a container when gpufleet first
comes: live-restore is switched on by a reload and the restart keeps that container. Then a GPU
job runs while daemon.json changes: restarted under live-restore (the job survives), or, with
docker_restart_with_gpu_containers: never, the change is reported pending until the job ends.
Every run is applied twice: the second changes nothing.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from testing import smoke_image, testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
OPERATOR_KEYS = {
    "log-driver": "json-file",
    "bridge": "none", "iptables": False, "ip6tables": False, "ip-forward": False, "ip-masq": False,
    "storage-driver": "vfs",
}
DEPLOY = textwrap.dedent("""\
    from pyinfra import host, state
    from gpufleet.deploys.base import base
    from gpufleet.deploys.docker import docker
    from gpufleet.failures import host_failed
    from gpufleet.settings import validate_inventory

    validate_inventory(state.inventory)
    for step in (base, docker):
        if host_failed(host):
            break
        step()
    """)
SLEEPER = "python3 -IS -c 'import time; time.sleep(1000000)'"


def sh(host, cmd: str, timeout: float = 120) -> str:
    return testhosts.ssh(host, cmd, timeout=timeout).stdout


def container(host, name: str) -> dict:
    return json.loads(sh(host, f"docker inspect --format '{{{{json .State}}}}' {name}"))


def dockerd_pid(host) -> str:
    return sh(host, "systemctl show -p MainPID --value docker.service").strip()


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def gpu_host(request, hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    h = hostpool.get(f"docker-gpu-{request.param}", 1, release=request.param, gpu="t4", private_network=True,
                     forward=[aptrepo.port], containers=True)[0]
    # The operator's Docker, before gpufleet: their daemon.json, an image, a running container.
    sh(h, "mkdir -p /etc/docker && cat > /etc/docker/daemon.json <<'EOF'\n" + json.dumps(OPERATOR_KEYS, indent=2) + "\nEOF")
    cli = " docker-cli" if h.release == "trixie" else ""  # Debian 13 split the CLI out of docker.io
    sh(h, "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "
          f"docker.io{cli} >/dev/null", timeout=900)
    # The tiers' memlock -1 needs CAP_SYS_RESOURCE, which root lacks on this machine (see
    # testhosts.CONTAINER_NSPAWN): the containers get the host's own hard limit instead.
    ulimits = {"memlock": int(sh(h, "ulimit -Hl").strip()) * 1024, "stack": 67108864}
    smoke_image.build(h)
    sh(h, f"docker run -d --name operator-job {smoke_image.IMAGE} {SLEEPER}")
    tmp = tmp_path_factory.mktemp("docker-gpu")
    deploy = tmp / "docker_deploy.py"
    deploy.write_text(DEPLOY)
    runs = {}

    def run(label: str, deploy_file: str | None = None, **extra):
        data = {"tier": "dev", "validate_os_release": OS_RELEASE[h.release], "tier_mismatch": "warn",
                "docker_toolkit_repo_url": aptrepo.container_repo_base(),
                "docker_toolkit_repo_fingerprint": aptrepo.fingerprint,
                "docker_smoke_image": smoke_image.IMAGE, "docker_ulimits": ulimits, **extra}
        inventory = write_inventory(tmp / f"{label}.py", [h], data={h.name: data})
        result = pyinfra(inventory, deploy_file or str(deploy), netns=h.netns)
        if result.returncode != 0:  # what dockerd said, for the failure message
            result.output += "\n--- journalctl -u docker\n" + testhosts.ssh(
                h, "journalctl -u docker --no-pager | tail -60", check=False).stdout
        (tmp / f"{label}.log").write_text(result.output)  # kept under pytest's basetemp for reading
        runs[label] = result
        return result

    return {"host": h, "run": run, "runs": runs, "tmp": tmp, "ulimits": ulimits}


@pytest.fixture(scope="module")
def first(gpu_host):
    h = gpu_host["host"]
    before = container(h, "operator-job")
    pid = dockerd_pid(h)
    one = gpu_host["run"]("first")
    two = gpu_host["run"]("first-again")
    return {"before": before, "dockerd_before": pid, "one": one, "two": two}


def test_operator_container_survives_gpufleets_first_run(gpu_host, first):
    h = gpu_host["host"]
    assert first["one"].returncode == 0, first["one"].output[-4000:]
    conf = json.loads(sh(h, "cat /etc/docker/daemon.json"))
    assert conf["live-restore"] is True and conf["default-runtime"] == "nvidia"
    assert sh(h, "docker info --format '{{.LiveRestoreEnabled}}'").strip() == "true"
    # dockerd was restarted (features, ulimits need it), after live-restore came by a reload
    assert dockerd_pid(h) != first["dockerd_before"]
    after = container(h, "operator-job")
    assert after["Running"] and after["Pid"] == first["before"]["Pid"], (first["before"], after)
    assert after["StartedAt"] == first["before"]["StartedAt"]


def test_smoke_test_runs_and_prints_the_simulated_gpus(gpu_host, first):
    h = gpu_host["host"]
    uuid = sh(h, "nvidia-smi --query-gpu=uuid --format=csv,noheader").strip()
    out = first["one"].output
    assert f"[{h.name}] GPU smoke test: container sees GPU 0: Tesla T4 (UUID: {uuid})" in out, out[-4000:]
    assert f"[{h.name}] GPU smoke test PASSED" in out
    assert "SKIPPED" not in out
    # the image has no nvidia-smi of its own: the stand-in toolkit mounted the simulator's
    r = testhosts.ssh(h, f"docker run --rm {smoke_image.IMAGE} nvidia-smi -L", check=False)
    assert r.returncode != 0 and "not found" in r.stderr, r


def test_first_run_again_changes_nothing(first):
    assert first["two"].returncode == 0, first["two"].output[-3000:]
    assert changed_operations(first["two"]) == [], first["two"].output[-3000:]


@pytest.fixture(scope="module")
def gpu_job(gpu_host, first):
    h = gpu_host["host"]
    sh(h, f"docker run -d --name train --gpus all {smoke_image.IMAGE} {SLEEPER}")
    return container(h, "train")


def test_gpu_job_sees_the_gpu(gpu_host, gpu_job):
    h = gpu_host["host"]
    assert gpu_job["Running"]
    assert sh(h, "docker exec train nvidia-smi -L").startswith("GPU 0: Tesla T4")


@pytest.fixture(scope="module")
def restarted(gpu_host, gpu_job):
    """A change that needs a restart while the GPU job runs, live-restore on: restarted."""
    h = gpu_host["host"]
    pid = dockerd_pid(h)
    ulimits = dict(gpu_host["ulimits"], stack=33554432)  # lowered: needs no privilege
    one = gpu_host["run"]("restart", docker_ulimits=ulimits)
    two = gpu_host["run"]("restart-again", docker_ulimits=ulimits)
    return {"dockerd_before": pid, "one": one, "two": two}


def test_gpu_job_survives_a_restart_under_live_restore(gpu_host, gpu_job, restarted):
    h = gpu_host["host"]
    one = restarted["one"]
    assert one.returncode == 0, one.output[-4000:]
    assert "PENDING" not in one.output
    assert json.loads(sh(h, "cat /etc/docker/daemon.json"))["default-ulimits"]["stack"]["Soft"] == 33554432
    assert dockerd_pid(h) != restarted["dockerd_before"]  # really restarted
    after = container(h, "train")
    assert after["Running"] and after["Pid"] == gpu_job["Pid"] and after["StartedAt"] == gpu_job["StartedAt"]
    assert sh(h, "docker exec train nvidia-smi -L").startswith("GPU 0: Tesla T4")
    assert changed_operations(restarted["two"]) == [], restarted["two"].output[-3000:]


@pytest.fixture(scope="module")
def pending(gpu_host, gpu_job, restarted):
    """The same kind of change with docker_restart_with_gpu_containers: never: left pending."""
    h = gpu_host["host"]
    pid = dockerd_pid(h)
    extra = {"docker_ulimits": dict(gpu_host["ulimits"], stack=16777216), "docker_restart_with_gpu_containers": "never"}
    one = gpu_host["run"]("pending", **extra)
    two = gpu_host["run"]("pending-again", **extra)
    validate = gpu_host["run"]("pending-validate", deploy_file="deploys/validate.py", **extra)
    state = {"dockerd": dockerd_pid(h), "conf": json.loads(sh(h, "cat /etc/docker/daemon.json")),
             "train": container(h, "train")}
    # the job ends: the next run applies the change (and the operator's job survives it)
    sh(h, "docker rm -f train >/dev/null")
    operator_job = container(h, "operator-job")
    applied = gpu_host["run"]("pending-applied", **extra)
    applied_again = gpu_host["run"]("pending-applied-again", **extra)
    return {"dockerd_before": pid, "one": one, "two": two, "validate": validate, "state": state,
            "operator_job": operator_job, "applied": applied, "applied_again": applied_again, **extra}


def test_change_is_pending_while_the_gpu_job_runs(gpu_host, gpu_job, pending):
    h = gpu_host["host"]
    one, state = pending["one"], pending["state"]
    assert one.returncode == 0, one.output[-4000:]
    assert (f"[{h.name}] daemon.json change PENDING (not applied): default-ulimits need a Docker restart; "
            "1 GPU container(s) running (train) (docker_restart_with_gpu_containers: never)") in one.output
    assert "host(s) have a Docker configuration change PENDING" in one.output
    assert state["dockerd"] == pending["dockerd_before"]  # not restarted
    assert state["conf"]["default-ulimits"]["stack"]["Soft"] == 33554432  # not written either
    assert state["train"]["Running"] and state["train"]["Pid"] == gpu_job["Pid"]
    # applied twice: the second run changes nothing and says the same
    assert changed_operations(pending["two"]) == [], pending["two"].output[-3000:]
    assert "daemon.json change PENDING" in pending["two"].output
    assert ("[WARN] docker: daemon.json has gpufleet's keys (no Docker change pending): not yet in "
            "/etc/docker/daemon.json: default-ulimits") in pending["validate"].output, pending["validate"].output[-3000:]


def test_pending_change_applied_once_the_gpu_job_ended(gpu_host, pending):
    h = gpu_host["host"]
    applied = pending["applied"]
    assert applied.returncode == 0, applied.output[-4000:]
    assert "PENDING" not in applied.output
    assert json.loads(sh(h, "cat /etc/docker/daemon.json"))["default-ulimits"]["stack"]["Soft"] == 16777216
    after = container(h, "operator-job")
    assert after["Running"] and after["Pid"] == pending["operator_job"]["Pid"]
    assert changed_operations(pending["applied_again"]) == [], pending["applied_again"].output[-3000:]
