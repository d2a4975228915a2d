"""End-to-end (issue 27 item 6, issue 44 item 4): no systemd daemon-reload of a gpufleet run, its
own or one a package or `systemctl enable` does, cuts a running GPU container off its GPU
devices. A real Debian 12 test host with Debian's real docker.io (systemd cgroup driver, cgroup
v2) and real runc, booted `--containers`, GPU SIMULATED (testing/gpusim), NVIDIA's container
toolkit as the STAND-IN packages of testing/aptrepo, installed by the operator before gpufleet.

The GPU device nodes are SIMULATED too: `mknod /dev/nvidia0 c 195 0` and `/dev/nvidiactl c 195
255` with no driver behind them, as the driver makes them (without /dev/char links). Opening one
in a container answers ENXIO ("No such device or address") while the container's device policy
lets it in, and EPERM ("Operation not permitted") once systemd has taken it away: exactly what
NVIDIA's bug does to a real GPU container (NVIDIA/nvidia-docker#1730). The control at the end
shows it happens here: a plain `systemctl daemon-reload` takes the device from a container
started without /dev/char links.

1. a host gpufleet adopts: the operator's GPU job started with the device nodes (no links), then
   a first deploys/all.py (packages whose postinst reloads systemd, `systemctl enable`s): the
   job keeps its device through it and through a reload after it; the second run is a no-op;
2. gpufleet's own gated reload (a unit drop-in changes) with such a container: its devices are
   named in its scope, then the reload is done, and the container keeps its device;
3. a container whose /dev/char link is someone else's (it cannot be fixed): the reload is
   deferred, said with the container's scope, recorded; a second run changes nothing and says
   it is still pending; once it is gone the next run does the reload.
"""
from __future__ import annotations

import time

import pytest

from gpufleet.plans.repos import TOOLKIT_KEYRING, TOOLKIT_LIST, TOOLKIT_PACKAGES, toolkit_sources_line
from gpufleet.catalog.tiers import tier_defaults
from testing import smoke_image, testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
DEPLOY = "tests/e2e/deploys/daemon_reload.py"
UNIT = "gf-test.service"
DROPIN = f"/etc/systemd/system/{UNIT}.d/gpufleet-test.conf"
OPEN = ("python3 -c \"import os\ntry:\n    os.close(os.open('/dev/nvidia0', os.O_RDWR))\n    print('open')\n"
        "except OSError as e:\n    print(os.strerror(e.errno))\"")
ALLOWED = "No such device or address"      # the device policy let it through to the (absent) driver
CUT_OFF = "Operation not permitted"        # the device policy refused it
NO_LINKS = "rm -f /dev/char/195:0 /dev/char/195:255"


def sh(host, cmd: str, timeout: float = 300) -> str:
    return testhosts.ssh(host, cmd, timeout=timeout).stdout


def start(host, name: str) -> str:
    """A long-running container given the (simulated) GPU device nodes; its systemd scope."""
    cid = sh(host, f"docker run -d --name {name} --network none --device /dev/nvidia0 --device /dev/nvidiactl "
                   f"{smoke_image.IMAGE} python3 -c 'import time; time.sleep(3600)'").strip()
    assert len(cid) == 64, cid
    return f"docker-{cid}.scope"


def sees(host, name: str) -> str:
    return sh(host, f"docker exec {name} {OPEN}").strip()


def device_allow(host, scope: str) -> list[str]:
    return sh(host, f"systemctl show -p DeviceAllow --value {scope}").splitlines()


def need_reload(host) -> str:
    return sh(host, f"systemctl show -p NeedDaemonReload --value {UNIT}").strip()


@pytest.fixture(scope="module")
def gpu_host(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    t0 = time.monotonic()
    (h,) = hostpool.get("daemon-reload", 1, release="bookworm", gpu=f"t4@{TEST_DRIVER}", private_network=True,
                        forward=[aptrepo.port], containers=True)
    # The operator's host before gpufleet: Docker, NVIDIA's container toolkit (the stand-in, from
    # its repository as NVIDIA's guide installs it), the device nodes as the driver makes them
    # (no /dev/char links), a test unit systemd knows
    version = tier_defaults("research")["docker_toolkit_version"]
    (h.root / TOOLKIT_KEYRING.lstrip("/")).write_bytes(aptrepo.keyring.read_bytes())
    (h.root / TOOLKIT_LIST.lstrip("/")).write_text(toolkit_sources_line(aptrepo.container_repo_base()))
    sh(h, "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io "
          + " ".join(f"{p}={version}" for p in TOOLKIT_PACKAGES) + " >/dev/null", timeout=900)
    smoke_image.build(h)
    sh(h, f"{NO_LINKS}; [ -c /dev/nvidia0 ] || mknod -m 666 /dev/nvidia0 c 195 0; "
          "[ -c /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255; "
          # active, so that systemd keeps it loaded: a changed drop-in then waits for a reload
          f"printf '[Service]\\nType=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/true\\n' > /etc/systemd/system/{UNIT}; "
          f"systemctl daemon-reload && systemctl restart {UNIT}")
    tmp = tmp_path_factory.mktemp("reload")
    inv = write_inventory(tmp / "inventory.py", [h],
                          data={h.name: {"tier": "dev", "validate_os_release": OS_RELEASE[h.release]}})
    # The tiers' memlock -1 needs CAP_SYS_RESOURCE, which root lacks on this machine (see
    # testhosts.CONTAINER_NSPAWN): the containers get the host's own hard limit instead.
    ulimits = {"memlock": int(sh(h, "ulimit -Hl").strip()) * 1024, "stack": 67108864}
    all_inv = write_inventory(tmp / "all.py", [h], data={h.name: {
        **environment_data(h, "research", aptrepo), "tier_mismatch": "warn",
        "docker_smoke_image": smoke_image.IMAGE, "docker_ulimits": ulimits}})
    print(f"[timing] daemon-reload host ready (docker.io, toolkit, image): {time.monotonic() - t0:.1f} s")
    yield h, inv, all_inv, tmp
    sh(h, "docker rm -f gf-job gf-a gf-b gf-c >/dev/null 2>&1; true")


@pytest.fixture(scope="module")
def first_all(gpu_host):
    """The operator's GPU job, started before the /dev/char links exist; then gpufleet's first
    all.py and its second."""
    h, _, all_inv, tmp = gpu_host
    scope = start(h, "gf-job")
    before = sees(h, "gf-job")
    one = pyinfra(all_inv, netns=h.netns)
    (tmp / "first-all.log").write_text(one.output)
    after_one = sees(h, "gf-job")
    two = pyinfra(all_inv, netns=h.netns)
    (tmp / "second-all.log").write_text(two.output)
    return {"scope": scope, "before": before, "one": one, "after_one": after_one, "two": two}


def test_a_gpu_container_keeps_its_devices_through_a_first_all_py(gpu_host, first_all):
    h = gpu_host[0]
    one, scope = first_all["one"], first_all["scope"]
    assert first_all["before"] == ALLOWED
    assert one.returncode == 0, one.output[-4000:]
    # the run reloaded systemd: packages with units (sysstat, the exporters) and enables
    assert sh(h, "systemctl is-enabled sysstat.service prometheus-node-exporter.service").split() == ["enabled"] * 2
    assert first_all["after_one"] == ALLOWED                  # it kept its device through the run
    assert "/dev/char/195:0 rw" in device_allow(h, scope) and "/dev/char/195:255 rw" in device_allow(h, scope)
    assert "named the GPU devices of running containers in their systemd scopes" in one.output
    assert scope in one.output, one.output[-4000:]
    two = first_all["two"]
    assert two.returncode == 0 and changed_operations(two) == [], two.output[-4000:]
    assert "named the GPU devices" not in two.output          # a no-op sends nothing more
    sh(h, "systemctl daemon-reload")                          # and any later reload keeps it too
    assert sees(h, "gf-job") == ALLOWED
    sh(h, "docker rm -f gf-job >/dev/null")


def test_gpufleets_own_reload_names_the_devices_first(gpu_host, first_all):
    h, inv, _, _ = gpu_host
    sh(h, f"{NO_LINKS}; rm -f {DROPIN} /run/gpufleet/daemon-reload-pending")
    scope = start(h, "gf-a")
    assert sees(h, "gf-a") == ALLOWED
    run = pyinfra(inv, DEPLOY, netns=h.netns)
    assert run.returncode == 0, run.output[-4000:]
    assert "named the GPU devices of running containers in their systemd scopes before the daemon-reload" in run.output
    assert scope in run.output and "PENDING" not in run.output, run.output[-4000:]
    assert need_reload(h) == "no"                             # reloaded: the drop-in is in force
    assert sh(h, f"systemctl show -p Environment --value {UNIT}").strip() == "GF_TEST=1"
    assert sees(h, "gf-a") == ALLOWED                         # and gf-a kept its device across it
    again = pyinfra(inv, DEPLOY, netns=h.netns)
    assert again.returncode == 0 and changed_operations(again) == [], again.output[-4000:]
    sh(h, "docker rm -f gf-a >/dev/null")


def test_a_reload_it_cannot_make_safe_is_deferred_and_said(gpu_host, first_all):
    h, inv, _, _ = gpu_host
    sh(h, f"{NO_LINKS}; rm -f {DROPIN}; systemctl daemon-reload")
    scope = start(h, "gf-b")
    # someone else's link for the device's number, to another device: naming the device through
    # it would allow that one instead, so the guard does not
    sh(h, "ln -s ../null /dev/char/195:0")
    first = pyinfra(inv, DEPLOY, netns=h.netns)
    assert first.returncode == 0, first.output[-4000:]
    assert "systemd daemon-reload PENDING (not done)" in first.output and scope in first.output, first.output[-4000:]
    assert sees(h, "gf-b") == ALLOWED                         # its device is still its own
    assert need_reload(h) == "yes"                            # the drop-in is written, not yet read
    assert sh(h, "cat /run/gpufleet/daemon-reload-pending").split() == [scope]
    assert sh(h, "stat -c '%U %a' /run/gpufleet/daemon-reload-pending").strip() == "root 600"   # gpufleet's files: 0600
    second = pyinfra(inv, DEPLOY, netns=h.netns)
    assert second.returncode == 0 and changed_operations(second) == [], second.output[-4000:]
    assert "systemd daemon-reload still PENDING" in second.output, second.output[-4000:]
    assert sees(h, "gf-b") == ALLOWED and need_reload(h) == "yes"
    # it ends: the next run does the deferred reload
    sh(h, "docker rm -f gf-b >/dev/null; rm -f /dev/char/195:0")
    run = pyinfra(inv, DEPLOY, netns=h.netns)
    assert run.returncode == 0, run.output[-4000:]
    assert "(+ deferred)" in run.output and "PENDING" not in run.output, run.output[-4000:]
    assert need_reload(h) == "no"
    assert sh(h, "test -e /run/gpufleet/daemon-reload-pending && echo there || echo gone").strip() == "gone"


def test_control_a_plain_reload_cuts_a_container_started_without_links_off(gpu_host):
    """What the guard prevents is real on this host: without the links, systemd takes the
    device from a running container at the next reload."""
    h = gpu_host[0]
    sh(h, NO_LINKS)
    start(h, "gf-c")
    assert sees(h, "gf-c") == ALLOWED
    sh(h, "systemctl daemon-reload")
    assert sees(h, "gf-c") == CUT_OFF
    sh(h, "docker rm -f gf-c >/dev/null; ln -sfn ../nvidia0 /dev/char/195:0; ln -sfn ../nvidiactl /dev/char/195:255")
