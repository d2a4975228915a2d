"""End-to-end for deploys/docker.py on real Debian 12 and 13 test hosts (systemd-nspawn), GPUs
SIMULATED (testing/gpusim), NVIDIA's container toolkit as STAND-IN packages from the tests' signed
local repository (testing/aptrepo.py), the engine as Debian's real docker.io.

dockerd runs inside these containers only with an operator configuration that avoids what nspawn
forbids (iptables, IP forwarding, overlay mounts): the pre-existing daemon.json the tests write is
exactly such an operator file, so "keeps the operator's keys" is also what keeps dockerd alive.
These hosts share the machine's network, where containers cannot start (runc needs CAP_NET_ADMIN
for the container's loopback, and more: testing/testhosts.py CONTAINER_NSPAWN), and the smoke
image is not pullable: here the smoke test says why it did not run. It runs for real, printing
the simulated GPUs, on the `--containers` host of tests/e2e/test_docker_gpu.py.

The run is base + docker (the deploy under test), not all.py: the driver, tuning, hardening and
validate steps are separate issues.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
TOOLKIT = ("nvidia-container-toolkit", "nvidia-container-toolkit-base", "libnvidia-container-tools",
           "libnvidia-container1")
OPERATOR_KEYS = {
    "log-driver": "json-file",
    "log-opts": {"max-file": "3", "max-size": "50m"},
    "registry-mirrors": ["https://mirror.example.org"],
    # what lets dockerd start inside systemd-nspawn (no CAP_NET_ADMIN, read-only /proc/sys, no overlay)
    "bridge": "none", "iptables": False, "ip6tables": False, "ip-forward": False, "ip-masq": False,
    "storage-driver": "vfs",
}
DEPLOY = textwrap.dedent("""\
    from pyinfra import host, state
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


def sh(host, cmd: str) -> str:
    return testhosts.ssh(host, cmd).stdout


def _data(host, aptrepo, **extra):  # noqa: F811
    return {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn",
            "docker_toolkit_repo_url": aptrepo.container_repo_base(),
            "docker_toolkit_repo_fingerprint": aptrepo.fingerprint, **extra}


def _unit(host) -> dict:
    out = sh(host, "systemctl show docker.service -p MainPID -p NRestarts -p ExecMainStartTimestampMonotonic "
                   "-p ActiveState")
    return dict(line.split("=", 1) for line in out.split())


@pytest.fixture(scope="module")
def fleet(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    good = hostpool.get("docker-bookworm", 1, release="bookworm", gpu="t4")
    good += hostpool.get("docker-trixie", 1, release="trixie", gpu="t4")
    bad = hostpool.get("docker-malformed", 1, release="bookworm", gpu="t4")[0]
    for h in good:
        testhosts.ssh(h, "mkdir -p /etc/docker && cat > /etc/docker/daemon.json <<'EOF'\n"
                         + json.dumps(OPERATOR_KEYS, indent=2) + "\nEOF")
    testhosts.ssh(bad, "mkdir -p /etc/docker && printf '{\\n  \"log-driver\": \"json-file\",\\n}\\n' > /etc/docker/daemon.json")
    bad_sha = sh(bad, "sha256sum /etc/docker/daemon.json")
    tmp = tmp_path_factory.mktemp("docker")
    deploy = tmp / "docker_deploy.py"
    deploy.write_text(DEPLOY)
    every = write_inventory(tmp / "all.py", [*good, bad], data={h.name: _data(h, aptrepo) for h in [*good, bad]})
    first = pyinfra(every, str(deploy))
    units = {h.name: _unit(h) for h in good}
    only_good = write_inventory(tmp / "good.py", good, data={h.name: _data(h, aptrepo) for h in good})
    second = pyinfra(only_good, str(deploy))
    (tmp / "first.log").write_text(first.output)  # kept under pytest's basetemp for reading
    (tmp / "second.log").write_text(second.output)
    return {"good": good, "bad": bad, "bad_sha": bad_sha, "first": first, "second": second,
            "units_after_first": units, "deploy": deploy, "tmp": tmp}


def test_engine_and_toolkit_installed_and_held(fleet, aptrepo):  # noqa: F811
    for h in fleet["good"]:
        status = dict(line.split(None, 1) for line in sh(h, "dpkg-query -W -f='${Package} ${db:Status-Abbrev}${Version}\\n' "
                                                            "docker.io containerd runc " + " ".join(TOOLKIT)).splitlines())
        for pkg in ("docker.io", "containerd", "runc", *TOOLKIT):
            assert status[pkg].startswith("hi"), (h.release, pkg, status[pkg], fleet["first"].output[-3000:])
        for pkg in TOOLKIT:
            assert status[pkg].endswith("1.18.0-1"), (pkg, status[pkg])
        assert "version 1.18.0" in sh(h, "nvidia-ctk --version")
        assert sh(h, "cat /etc/apt/sources.list.d/nvidia-container-toolkit.list") == (
            f"deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
            f"{aptrepo.container_repo_base()}/stable/deb/$(ARCH) /\n")
        fprs = sh(h, "gpg --with-colons --show-keys /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg "
                     "| awk -F: '$1==\"fpr\"{print $10}'").split()
        assert fprs[0] == aptrepo.fingerprint
        if h.release == "trixie":  # Debian 13 split the CLI out of docker.io
            assert sh(h, "dpkg-query -W -f='${db:Status-Abbrev}' docker-cli").startswith("hi")
        assert sh(h, "docker version --format '{{.Server.Version}}'").strip()


def test_daemon_json_keeps_operator_keys_and_gains_runtime_and_tier_defaults(fleet):
    for h in fleet["good"]:
        conf = json.loads(sh(h, "cat /etc/docker/daemon.json"))
        for key, value in OPERATOR_KEYS.items():
            assert conf[key] == value, (h.release, key)
        assert conf["runtimes"]["nvidia"] == {"args": [], "path": "nvidia-container-runtime"}
        assert conf["default-runtime"] == "nvidia"
        assert conf["default-shm-size"] == "1g"
        assert conf["default-ulimits"] == {"memlock": {"Name": "memlock", "Hard": -1, "Soft": -1},
                                           "stack": {"Name": "stack", "Hard": 67108864, "Soft": 67108864}}
        assert conf["features"] == {"cdi": True}
        # the running engine really uses it
        info = sh(h, "docker info --format '{{.DefaultRuntime}} {{json .Runtimes}}'")
        assert info.startswith("nvidia ") and '"nvidia"' in info, info


def test_dockerd_validate_passes_where_the_engine_has_it(fleet):
    checked = 0
    for h in fleet["good"]:
        major = int(sh(h, "dockerd --version").split()[2].split(".")[0])
        if major < 23:
            # Docker 20.10 (Debian 12) has no --validate: the deploy says so instead of pretending
            assert f"[{h.name}] daemon.json written without `dockerd --validate`: dockerd 20.10" in fleet["first"].output
            continue
        r = testhosts.ssh(h, "dockerd --validate --config-file /etc/docker/daemon.json", check=False)
        assert r.returncode == 0 and "configuration OK" in r.stdout + r.stderr, r.stdout + r.stderr
        checked += 1
    assert checked == 1  # trixie's 26.1


def test_cdi_spec_lists_the_gpu(fleet):
    for h in fleet["good"]:
        uuid = sh(h, "nvidia-smi --query-gpu=uuid --format=csv,noheader").strip()
        assert f"nvidia.com/gpu={uuid}" in sh(h, "nvidia-ctk cdi list").split()
        assert "generate --output=/etc/cdi/nvidia.yaml" in sh(h, "cat /var/log/gpufleet-stand-in.log")


def test_second_run_changes_nothing_and_does_not_restart_docker(fleet):
    second = fleet["second"]
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    for h in fleet["good"]:
        before, after = fleet["units_after_first"][h.name], _unit(h)
        assert after["ActiveState"] == "active"
        assert after == before, (h.release, before, after)  # same MainPID, start time, NRestarts


def test_smoke_test_says_why_it_did_not_run(fleet):
    first = fleet["first"].output
    for h in fleet["good"]:
        line = next((ln for ln in first.splitlines() if f"[{h.name}] GPU smoke test SKIPPED (not passed):" in ln), "")
        assert "cannot be pulled" in line, first[-4000:]
    assert "GPU smoke test SKIPPED" not in fleet["second"].output  # nothing changed: nothing to prove


def test_malformed_daemon_json_stops_only_that_host_and_stays_byte_identical(fleet):
    first, bad = fleet["first"], fleet["bad"]
    assert first.returncode != 0
    assert (f"[{bad.name}] refused (docker daemon.json): /etc/docker/daemon.json "
            "is malformed: invalid JSON at line 3") in first.output, first.output[-3000:]
    assert sh(bad, "sha256sum /etc/docker/daemon.json") == fleet["bad_sha"]
    assert sh(bad, "dpkg-query -W -f='${db:Status-Abbrev}' docker.io 2>/dev/null || true").strip() in ("", "un")
    # the other hosts of the same run converged (checked in detail above)
    assert all(json.loads(sh(h, "cat /etc/docker/daemon.json"))["default-runtime"] == "nvidia" for h in fleet["good"])
