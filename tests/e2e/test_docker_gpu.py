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

On Debian 12 a 2-process DDP job (gloo, DataLoader workers, real CPU PyTorch from the machine's
cache) runs in a container under the daemon defaults gpufleet set, and fails under Docker's own
64m /dev/shm (issue 30 item 4).
"""
from __future__ import annotations

import json
import shlex
import textwrap
import time

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
    from gpufleet.controller import hostlock
    hostlock.install()  # as every entry point: the lock, and the reload guard, at the first change
    from gpufleet.deploys.base import base
    from gpufleet.deploys.docker import docker
    from gpufleet.config.failures import host_failed
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    for step in (base, docker):
        if host_failed(host):
            break
        step()
    """)
SLEEPER = "python3 -IS -c 'import time; time.sleep(1000000)'"
# Opens and stats the (SIMULATED: mknod, no driver) GPU device node from inside a container:
# ENXIO "No such device or address" when its device policy lets it through to the absent
# driver, EPERM "Operation not permitted" when systemd has taken the device from it.
OPEN_GPU = ("python3 -IS -c \"import os\ntry:\n    os.close(os.open('/dev/nvidia0', os.O_RDWR))\n    print('open')\n"
            "except OSError as e:\n    print(os.strerror(e.errno), oct(os.stat('/dev/nvidia0').st_rdev))\"")
GPU_ALLOWED = f"No such device or address {oct(195 << 8)}"


def sh(host, cmd: str, timeout: float = 120) -> str:
    return testhosts.ssh(host, cmd, timeout=timeout).stdout


def container(host, name: str) -> dict:
    return json.loads(sh(host, f"docker inspect --format '{{{{json .State}}}}' {name}"))


def device_allow(host, scope: str) -> list[str]:
    return sh(host, f"systemctl show -p DeviceAllow --value {scope}").splitlines()


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
    # ...and a GPU job given the device nodes (SIMULATED, as the driver makes them: without
    # /dev/char links), so runc could not name them in its systemd scope (issue 44 item 4)
    sh(h, "rm -f /dev/char/195:0 /dev/char/195:255; [ -c /dev/nvidia0 ] || mknod -m 666 /dev/nvidia0 c 195 0; "
          "[ -c /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255; "
          f"docker run -d --name operator-gpu-job --device /dev/nvidia0 --device /dev/nvidiactl {smoke_image.IMAGE} {SLEEPER}")
    assert sh(h, f"docker exec operator-gpu-job {OPEN_GPU}").strip() == GPU_ALLOWED
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
    gpu_job = container(h, "operator-gpu-job")
    scope = f"docker-{sh(h, 'docker inspect --format {{.Id}} operator-gpu-job').strip()}.scope"
    allow_before = device_allow(h, scope)
    pid = dockerd_pid(h)
    one = gpu_host["run"]("first")
    opened = [sh(h, f"docker exec operator-gpu-job {OPEN_GPU}").strip()]
    two = gpu_host["run"]("first-again")
    opened.append(sh(h, f"docker exec operator-gpu-job {OPEN_GPU}").strip())
    gpu = {"before": gpu_job, "after": container(h, "operator-gpu-job"), "scope": scope,
           "allow_before": allow_before, "allow": device_allow(h, scope)}
    sh(h, "systemctl daemon-reload")    # and any reload after the runs keeps it too
    opened.append(sh(h, f"docker exec operator-gpu-job {OPEN_GPU}").strip())
    # gone before the tests after it, which count the GPU containers that keep a restart pending
    sh(h, "docker rm -f operator-gpu-job >/dev/null")
    return {"before": before, "dockerd_before": pid, "one": one, "two": two, "gpu": dict(gpu, opened=opened)}


def test_operator_container_survives_gpufleets_first_run(gpu_host, first):
    h = gpu_host["host"]
    assert first["one"].returncode == 0, first["one"].why
    conf = json.loads(sh(h, "cat /etc/docker/daemon.json"))
    assert conf["live-restore"] is True and conf["default-runtime"] == "nvidia"
    assert sh(h, "docker info --format '{{.LiveRestoreEnabled}}'").strip() == "true"
    # dockerd was restarted (features, ulimits need it), after live-restore came by a reload
    assert dockerd_pid(h) != first["dockerd_before"]
    after = container(h, "operator-job")
    assert after["Running"] and after["Pid"] == first["before"]["Pid"], (first["before"], after)
    assert after["StartedAt"] == first["before"]["StartedAt"]


def test_a_gpu_container_keeps_its_devices_through_the_first_run(gpu_host, first):
    """The first run installs packages that ship units (sysstat's postinst reloads systemd) and
    enables services (`systemctl enable` reloads too): before any of it, the reload guard named
    the operator's GPU job's devices in its scope, so no reload takes them (issue 44 item 4).
    Debian 13's runc (1.1.15) names them itself, without the links: nothing to do there."""
    gpu, out = first["gpu"], first["one"].output
    assert first["one"].returncode == 0, first["one"].why
    assert gpu["after"]["Running"] and gpu["after"]["Pid"] == gpu["before"]["Pid"], gpu
    # after the first run, the second, and a plain reload after them
    assert gpu["opened"] == [GPU_ALLOWED] * 3, gpu
    for mm in ("195:0", "195:255"):
        assert any(a.startswith(f"/dev/char/{mm} rw") for a in gpu["allow"]), gpu["allow"]
    if any(a.startswith("/dev/char/195:0 ") for a in gpu["allow_before"]):   # runc named them
        assert gpu["scope"] not in out, out[-3000:]
    else:
        assert "/dev/char/195:0 rw" in gpu["allow"] and "/dev/char/195:255 rw" in gpu["allow"], gpu["allow"]
        assert "named the GPU devices of running containers in their systemd scopes" in out, out[-3000:]
        assert gpu["scope"] in out, out[-3000:]


def test_smoke_test_runs_and_prints_the_simulated_gpus(gpu_host, first):
    h = gpu_host["host"]
    uuid = sh(h, "nvidia-smi --query-gpu=uuid --format=csv,noheader").strip()
    out = first["one"].output
    assert f"[{h.name}] GPU smoke test: container sees GPU 0: Tesla T4 (UUID: {uuid})" in out, first["one"].why
    assert f"[{h.name}] GPU smoke test PASSED" in out
    assert "SKIPPED" not in out
    # the image has no nvidia-smi of its own: the stand-in toolkit mounted the simulator's
    r = testhosts.ssh(h, f"docker run --rm {smoke_image.IMAGE} nvidia-smi -L", check=False)
    assert r.returncode != 0 and "not found" in r.stderr, r


def test_first_run_again_changes_nothing(first):
    assert first["two"].returncode == 0, first["two"].why
    assert changed_operations(first["two"]) == [], first["two"].output[-3000:]


# A 2-process DDP job with DataLoader workers, in a container (issue 30 item 4): each rank reads
# 8 items of 16 MB (4 x 1024 x 1024 float32, item i filled with i) in batches of 4 through two
# workers (pin_memory=False: CPU), adds them up and all-reduces the sum over gloo: 2 x 28 = 56.
# The workers hand each 64 MB batch to their rank through /dev/shm: more than Docker's own
# 64m default holds, well within the 1g gpufleet sets.
DDP_JOB = """
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.utils.data import DataLoader, Dataset

class Items(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.full((4, 1024, 1024), float(i))

def rank_main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    total = torch.zeros(1)
    for batch in DataLoader(Items(), batch_size=4, num_workers=2, pin_memory=False):
        total += batch.sum() / (4 * 1024 * 1024)
    dist.all_reduce(total)
    if rank == 0:
        print("all-reduced sum", total.item(), flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    shm = os.statvfs("/dev/shm")
    print("shm KiB", shm.f_blocks * shm.f_frsize // 1024, flush=True)
    mp.start_processes(rank_main, nprocs=2, start_method="fork")  # torch imported once
"""
SITE = "/usr/local/lib/python3.11/dist-packages"
DDP_IMAGE = "gpufleet-ddp:local"
# An image with Debian 12's python3.11, its standard library and the shared libraries python and
# torch's own libraries load (torch itself is mounted read-only from the host, as a job mounts its
# environment): built on the host, no registry is reachable.
_DDP_BUILD = r"""set -e
r=$(mktemp -d); trap 'rm -rf "$r"' EXIT
py=$(readlink -f /usr/bin/python3)
libs=$( (ldd /bin/dash; ldd "$py"; for f in /usr/lib/python3.11/lib-dynload/*.so "$SITE"/torch/lib/*.so* "$SITE"/torch/_C*.so; do ldd "$f"; done) 2>/dev/null \
  | grep -o '/[^ ]*' | grep -v "^$SITE" | sort -u)
for f in /bin/dash "$py" $libs; do mkdir -p "$r$(dirname "$f")"; cp -L "$f" "$r$f"; done
mkdir -p "$r/usr/lib"; cp -a /usr/lib/python3.11 "$r/usr/lib/"
ln -s dash "$r/bin/sh"; ln -s "$(basename "$py")" "$r/usr/bin/python3"
mkdir -p "$r/etc" "$r/tmp" "$r/proc" "$r/sys" "$r/dev" "$r$SITE" "$r/job"
tar -C "$r" -c . | docker import -m "gpufleet DDP test image" - "$IMAGE" >/dev/null
"""


@pytest.fixture(scope="module")
def ddp_job(gpu_host, first):
    """The job run under the daemon's defaults, and under Docker's own 64m /dev/shm."""
    from testing import torch_cpu

    h = gpu_host["host"]
    if h.release != "bookworm":
        pytest.skip("the cached PyTorch CPU wheel is cp311: Debian 12's python3")
    torch_site, why = torch_cpu.site()
    if torch_site is None:
        pytest.fail(f"no PyTorch CPU build: {why}")
    started = time.monotonic()
    torch_cpu.install(h, torch_site)
    (h.root / "root/ddp_job.py").write_text(DDP_JOB)
    copied = time.monotonic()
    testhosts.ssh(h, f"SITE={SITE} IMAGE={DDP_IMAGE} sh -c " + shlex.quote(_DDP_BUILD), timeout=300)
    built = time.monotonic()
    run = (f"docker run --rm -v {SITE}:{SITE}:ro -v /root/ddp_job.py:/job/ddp_job.py:ro {DDP_IMAGE} "
           "sh -c 'ulimit -s; python3 /job/ddp_job.py'")
    default = testhosts.ssh(h, run, check=False, timeout=300)
    ran = time.monotonic()
    docker_default = testhosts.ssh(h, run.replace("docker run --rm", "docker run --rm --shm-size 64m"),
                                   check=False, timeout=300)
    print(f"\nDDP in a container: torch copied {copied - started:.1f} s, image {built - copied:.1f} s, "
          f"job {ran - built:.1f} s, under 64m {time.monotonic() - ran:.1f} s")
    # the tests after this one know a host without PyTorch (the gate's probe would import it)
    names = " ".join(shlex.quote(f"{SITE}/{p.name}") for p in torch_site.iterdir())
    testhosts.ssh(h, f"rm -rf {names} /root/ddp_job.py; docker rmi -f {DDP_IMAGE} >/dev/null", timeout=120)
    return {"default": default, "docker_default": docker_default}


def test_ddp_job_with_dataloader_workers_runs_under_gpufleets_container_defaults(ddp_job):
    """What a 2-process DDP job with DataLoader workers needs is what gpufleet's daemon.json
    gives every container (docker_shm_size 1g, docker_ulimits stack 64 MiB): it runs; under
    Docker's own 64m /dev/shm the same job fails."""
    ok = ddp_job["default"]
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    stack, shm, *rest = ok.stdout.splitlines()
    assert stack.strip() == str(67108864 // 1024), stack  # ulimit -s, in KiB
    assert shm == f"shm KiB {1024 * 1024}", shm  # 1g of /dev/shm
    assert "all-reduced sum 56.0" in rest, ok.stdout
    small = ddp_job["docker_default"]
    assert small.returncode != 0 and "all-reduced sum" not in small.stdout, small.stdout[-3000:]
    assert small.stdout.splitlines()[1] == f"shm KiB {64 * 1024}", small.stdout[-3000:]
    said = small.stdout + small.stderr
    print("under Docker's 64m /dev/shm:", next((ln for ln in said.splitlines() if "Bus error" in ln
                                               or "No space left" in ln or "shared memory" in ln), "?"))
    assert "Bus error" in said or "No space left on device" in said or "shared memory" in said, said[-3000:]


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
    assert one.returncode == 0, one.why
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
    assert one.returncode == 0, one.why
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
    assert applied.returncode == 0, applied.why
    assert "PENDING" not in applied.output
    assert json.loads(sh(h, "cat /etc/docker/daemon.json"))["default-ulimits"]["stack"]["Soft"] == 16777216
    after = container(h, "operator-job")
    assert after["Running"] and after["Pid"] == pending["operator_job"]["Pid"]
    assert changed_operations(pending["applied_again"]) == [], pending["applied_again"].output[-3000:]
