"""facts/docker parsers and operations/docker planning (fake host: which commands would run)."""
import base64
from types import SimpleNamespace


import pytest
from pyinfra.context import ctx_host, ctx_state

from gpufleet.plans.repos import docker_sources_line, toolkit_sources_line
from gpufleet.facts import docker as f
from gpufleet.facts import packages
from gpufleet.facts._common import MARK
from gpufleet.plans import dockerconf
from gpufleet.operations import docker as ops
from gpufleet.config.hostcontext import host_context

pytestmark = pytest.mark.unit

TIER = dockerconf.DockerDefaults(default_runtime="nvidia", cdi=True, shm_size="1g",
                                 ulimits={"memlock": -1, "stack": 67108864})


# ---- fact parsers --------------------------------------------------------------------------

def test_daemon_json_fact_keeps_exact_bytes():
    raw = b'{ "log-driver":"local" }\n\n'
    out = f.parse_daemon_json_output([f"{MARK} exists yes", base64.b64encode(raw).decode()])
    assert out.exists and out.raw == raw
    assert f.parse_daemon_json_output([f"{MARK} exists no"]) == f.DaemonJsonFile(False)
    assert f.parse_daemon_json_output([f"{MARK} exists yes", ""]).raw == b""


def test_docker_engine_fact():
    out = f.parse_docker_engine([
        f"{MARK} begin version", "Docker version 26.1.5+dfsg1, build a72d7cd",
        f"{MARK} begin unit", "LoadState=loaded", "ActiveState=active", "SubState=running", "NRestarts=0",
        "ExecMainStartTimestampMonotonic=123456", f"{MARK} cli yes"])
    assert out.dockerd_version == "26.1.5+dfsg1" and out.major == 26 and out.can_validate
    assert out.running and out.cli and out.main_start_monotonic == 123456
    old = f.parse_docker_engine([f"{MARK} begin version", "Docker version 20.10.24+dfsg1, build 297e128",
                                 f"{MARK} begin unit", f"{MARK} cli no"])
    assert old.major == 20 and not old.can_validate and not old.running
    none = f.parse_docker_engine([f"{MARK} begin version", f"{MARK} begin unit", "LoadState=not-found",
                                  "ActiveState=inactive", "NRestarts=", f"{MARK} cli no"])
    assert not none.installed and not none.can_validate


def test_cdi_fact_and_staleness():
    st = f.parse_cdi([f"{MARK} ctk yes", f"{MARK} spec_mtime 200", f"{MARK} driver_mtime 100",
                      f"{MARK} begin list", "INFO[0000] Found 3 CDI devices", "nvidia.com/gpu=0",
                      "nvidia.com/gpu=GPU-a", "nvidia.com/gpu=all"])
    assert st.ctk and st.devices == ["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-a", "nvidia.com/gpu=all"]
    assert st.stale_reasons(["GPU-a"]) == []
    assert "lacks GPU-b" in st.stale_reasons(["GPU-a", "GPU-b"])[0]
    newer_driver = f.CdiState(ctk=True, spec_mtime=100, driver_mtime=200, devices=st.devices)
    assert "driver packages changed" in newer_driver.stale_reasons(["GPU-a"])[0]
    assert f.CdiState(ctk=True).stale_reasons([]) == ["no CDI spec yet"]


def test_keyring_and_candidates_facts():
    # the apt facts docker's deploy shares with the driver deploy (facts/packages.py)
    fpr = "C95B321B61E88C1809C4F759DDCAE044F796ECB0"
    assert packages.KeyringFingerprints().process([fpr, ""]) == [fpr]
    assert packages.KeyringFingerprints().process(["A" * 64]) == ["A" * 64]  # OpenPGP v5 keys
    assert packages.AptCandidates().process(["docker-cli 26.1.5+dfsg1-9", "nope (none)", "gone (none)"]) == {
        "docker-cli": "26.1.5+dfsg1-9", "nope": None, "gone": None}


def test_sources_lines():
    assert docker_sources_line("https://download.docker.com/linux/", "debian", "bookworm", "amd64") == (
        "deb [arch=amd64 signed-by=/etc/apt/keyrings/gpufleet-docker.gpg] "
        "https://download.docker.com/linux/debian bookworm stable\n")
    assert toolkit_sources_line("https://nvidia.github.io/libnvidia-container") == (
        "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
        "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n")


# ---- operations, planned against a fake host -----------------------------------------------

class FakeHost:
    name = "fake"
    print_prefix = "[fake] "
    current_op_global_arguments: dict = {}

    def __init__(self, facts, executing=False):
        self.facts, self.noops = facts, []
        self.state = SimpleNamespace(is_executing=executing)

    def get_fact(self, cls, *args, **kwargs):
        return self.facts.get(cls)  # pyinfra file facts: None = absent

    def noop(self, description):
        self.noops.append(description)


def _plan(op, facts, executing=False, seen=None, **kwargs):
    fake = FakeHost(facts, executing)
    if seen is not None:
        seen.append(fake)
    with ctx_host.use(fake):
        return [str(c) for c in op._inner(**kwargs)], fake.noops


@pytest.fixture(autouse=True)
def fake_files(monkeypatch):
    """pyinfra's files.put/directory need a real state; here they only report what they were asked."""
    def put(src, dest, mode=None):
        yield f"PUT {dest}"

    def directory(path, mode=None):
        yield f"DIR {path}"

    monkeypatch.setattr(ops, "files", SimpleNamespace(put=SimpleNamespace(_inner=put),
                                                      directory=SimpleNamespace(_inner=directory)))


ENGINE26 = f.DockerEngineState(dockerd_version="26.1.5", cli=True, active_state="active")
ENGINE20 = f.DockerEngineState(dockerd_version="20.10.24", cli=True, active_state="active")


def test_daemon_json_unchanged_yields_nothing():
    text = dockerconf.render(dockerconf.merge({"log-driver": "local"}, TIER)).encode()
    # no DockerEngine / DockerLive fact given: a no-op run asks dockerd nothing
    cmds, noops = _plan(ops.daemon_json, {f.DaemonJson: f.DaemonJsonFile(True, text)}, defaults=TIER)
    assert cmds == [] and "already has gpufleet's keys" in noops[0]


IDLE = f.DockerLiveState(answered=True, live_restore=False)


def test_daemon_json_validated_where_dockerd_can():
    cmds, _ = _plan(ops.daemon_json, {f.DaemonJson: f.DaemonJsonFile(True, b'{"log-driver": "local"}'),
                                      f.DockerEngine: ENGINE26, f.DockerLive: IDLE}, defaults=TIER)
    assert cmds[:2] == ["DIR /etc/docker", "PUT /etc/docker/daemon.json.gpufleet-new"], cmds
    assert "dockerd --validate" in cmds[2] and "mv -f" in cmds[2]
    assert cmds[3:] == ["sh -c 'systemctl reset-failed docker.service 2>/dev/null; systemctl restart docker.service'"]  # idle: nothing to keep alive


def test_daemon_json_with_gpu_containers_turns_live_restore_on_by_reload_then_restarts():
    busy = f.DockerLiveState(answered=True, live_restore=False, gpu_containers=["train"], containers=1)
    cmds, _ = _plan(ops.daemon_json, {f.DaemonJson: f.DaemonJsonFile(True, b'{"log-driver": "local"}'),
                                      f.DockerEngine: ENGINE20, f.DockerLive: busy}, defaults=TIER)
    assert cmds[0] == "DIR /etc/docker"
    assert cmds[1:3] == ["PUT /etc/docker/daemon.json", "systemctl reload docker.service"]
    assert "LiveRestoreEnabled" in cmds[3] and "not restarting it under running containers" in cmds[3]
    assert cmds[4:] == ["PUT /etc/docker/daemon.json", "sh -c 'systemctl reset-failed docker.service 2>/dev/null; systemctl restart docker.service'"]


def test_daemon_json_change_pending_under_gpu_containers_without_live_restore():
    busy = f.DockerLiveState(answered=True, live_restore=False, gpu_containers=["train"], containers=1)
    no_live = dockerconf.DockerDefaults(**{**TIER.__dict__, "live_restore": False})
    seen: list = []
    cmds, noops = _plan(ops.daemon_json, {f.DaemonJson: f.DaemonJsonFile(True, b'{"log-driver": "local"}'),
                                          f.DockerEngine: ENGINE20, f.DockerLive: busy}, defaults=no_live,
                        restart_with_gpu_containers="live-restore", seen=seen)
    assert "sh -c 'systemctl reset-failed docker.service 2>/dev/null; systemctl restart docker.service'" not in cmds
    assert cmds[-1] == "systemctl reload docker.service"  # the reloadable part only
    assert any("daemon.json change PENDING (not applied): default-ulimits, features" in n for n in noops)
    assert host_context(seen[0]).outcome.docker_pending[0] == ("default-ulimits", "features")


def test_daemon_json_written_directly_and_said_on_docker_20():
    cmds, noops = _plan(ops.daemon_json, {f.DaemonJson: f.DaemonJsonFile(False), f.DockerEngine: ENGINE20,
                                          f.DockerLive: IDLE}, defaults=TIER)
    assert cmds == ["DIR /etc/docker", "PUT /etc/docker/daemon.json", "sh -c 'systemctl reset-failed docker.service 2>/dev/null; systemctl restart docker.service'"]
    assert any("has no --validate (Docker < 23)" in n for n in noops)


def test_cdi_generated_only_when_stale():
    current = f.CdiState(ctk=True, spec_mtime=200, driver_mtime=100, devices=["nvidia.com/gpu=GPU-a"])
    assert _plan(ops.cdi_spec, {f.NvidiaCdi: current}, gpu_uuids=["GPU-a"])[0] == []
    stale = f.CdiState(ctk=True, spec_mtime=100, driver_mtime=200, devices=["nvidia.com/gpu=GPU-a"])
    assert _plan(ops.cdi_spec, {f.NvidiaCdi: stale}, gpu_uuids=["GPU-a"])[0] == [
        "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"]
    assert _plan(ops.cdi_spec, {f.NvidiaCdi: f.CdiState(ctk=False)}, gpu_uuids=["GPU-a"])[0] == []


def test_keyring_installed_only_when_fingerprint_differs():
    fpr = "C95B321B61E88C1809C4F759DDCAE044F796ECB0"
    assert _plan(ops.apt_keyring, {packages.KeyringFingerprints: [fpr]}, path="/k.gpg", key_url="http://x/gpgkey",
                 fingerprint=fpr)[0] == []
    cmds, _ = _plan(ops.apt_keyring, {packages.KeyringFingerprints: []}, path="/k.gpg", key_url="http://x/gpgkey",
                    fingerprint=fpr.lower())
    assert len(cmds) == 1 and fpr in cmds[0] and "apt-helper download-file" in cmds[0]


def test_smoke_test_is_not_planned_without_a_change():
    assert _plan(ops.gpu_smoke_test, {}, image="ubuntu:24.04", expected=False)[0] == []
    assert _plan(ops.gpu_smoke_test, {}, image="ubuntu:24.04")[0] == [
        "docker run --rm --gpus all ubuntu:24.04 nvidia-smi -L"]


def test_smoke_test_skips_with_a_reason_when_the_engine_is_down(caplog):
    down = f.DockerEngineState(dockerd_version="26.1.5", cli=True, active_state="failed", sub_state="failed")
    with ctx_state.use(SimpleNamespace()):
        cmds, _ = _plan(ops.gpu_smoke_test, {f.DockerEngine: down}, executing=True, image="ubuntu:24.04")
    assert cmds == []
    assert "GPU smoke test SKIPPED (not passed): the Docker engine is not running" in caplog.text


# ---- the running daemon: live-restore and GPU containers ----------------------------------

def _inspect(name, runtime="runc", requests=None, devices=None, env=()):
    return {"Name": f"/{name}", "Id": name * 8, "Config": {"Env": list(env)},
            "HostConfig": {"Runtime": runtime, "DeviceRequests": requests, "Devices": devices or []}}


def test_gpu_containers_are_told_apart():
    gpus_all = [{"Driver": "", "Count": -1, "DeviceIDs": None, "Capabilities": [["gpu"]], "Options": {}}]
    assert f.container_uses_gpu(_inspect("a", requests=gpus_all))                      # --gpus all
    assert f.container_uses_gpu(_inspect("b", requests=[{"Driver": "cdi", "DeviceIDs": ["nvidia.com/gpu=0"]}]))
    assert f.container_uses_gpu(_inspect("c", devices=[{"PathOnHost": "/dev/nvidia0"}]))
    assert f.container_uses_gpu(_inspect("d", runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=all"]))
    assert not f.container_uses_gpu(_inspect("e", runtime="nvidia", env=["NVIDIA_VISIBLE_DEVICES=void"]))
    assert not f.container_uses_gpu(_inspect("f", runtime="nvidia"))                     # default runtime only
    assert not f.container_uses_gpu(_inspect("g", devices=[{"PathOnHost": "/dev/fuse"}]))


def test_docker_live_fact():
    import json
    out = f.parse_docker_live([f"{MARK} live_restore true", f"{MARK} begin containers",
                               json.dumps(_inspect("train", requests=[{"Capabilities": [["gpu"]]}])),
                               json.dumps(_inspect("web"))])
    assert out.answered and out.live_restore and out.gpu_containers == ["train"] and out.containers == 2
    assert f.parse_docker_live([]) == f.DockerLiveState()  # no docker, or dockerd did not answer
    off = f.parse_docker_live([f"{MARK} live_restore false", f"{MARK} begin containers"])
    assert off.answered and not off.live_restore and off.containers == 0


def test_docker_live_fact_recorded():
    # DockerLive's command on a Debian 12 test host (docker.io 20.10, stand-in toolkit hook),
    # with `docker run -d --gpus all ... train` and a plain `docker run -d ... web`.
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "fixtures/facts/samples/docker-live-gpu-container.txt").read_text()
    out = f.parse_docker_live(text.splitlines())
    assert out.answered and not out.live_restore
    assert out.gpu_containers == ["train"] and out.containers == 2
