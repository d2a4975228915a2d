"""End-to-end (issue 27 item 6): gpufleet's daemon-reload never cuts a running GPU container off
its GPU devices, on a real Debian 12 test host with Debian's real docker.io (systemd cgroup
driver, cgroup v2) and real runc.

The GPU device nodes are SIMULATED: `mknod /dev/nvidia0 c 195 0` and `/dev/nvidiactl c 195 255`
with no driver behind them, so opening one in a container answers ENXIO ("No such device or
address") while the container's device policy lets it in, and EPERM ("Operation not
permitted") once systemd has taken it away: exactly what NVIDIA's bug does to a real GPU
container (NVIDIA/nvidia-docker#1730). The control at the end shows it happens here: a plain
`systemctl daemon-reload` takes the device from a container started without /dev/char links.

1. a container started with the devices and no /dev/char links; a unit drop-in changes: the
   gated reload is deferred, said with the container's scope, recorded; the container keeps
   its device; a second run changes nothing and says it is still pending;
2. the links made (NVIDIA's fix), the first container gone, a second one started: the next run
   does the deferred reload (the drop-in is then in force) and the second container keeps its
   device across it; a run after that changes nothing.
"""
from __future__ import annotations

import time

import pytest

from testing import smoke_image, testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
DEPLOY = "tests/e2e/deploys/daemon_reload.py"
UNIT = "gf-test.service"
OPEN = ("python3 -c \"import os\ntry:\n    os.close(os.open('/dev/nvidia0', os.O_RDONLY))\n    print('open')\n"
        "except OSError as e:\n    print(os.strerror(e.errno))\"")
ALLOWED = "No such device or address"      # the device policy let it through to the (absent) driver
CUT_OFF = "Operation not permitted"        # the device policy refused it


def sh(host, cmd: str) -> str:
    return testhosts.ssh(host, cmd, timeout=300).stdout


def start(host, name: str) -> str:
    """A long-running container given the (simulated) GPU device nodes; its systemd scope."""
    cid = sh(host, f"docker run -d --name {name} --device /dev/nvidia0 --device /dev/nvidiactl "
                   f"{smoke_image.IMAGE} python3 -c 'import time; time.sleep(3600)'").strip()
    assert len(cid) == 64, cid
    return f"docker-{cid}.scope"


def sees(host, name: str) -> str:
    return sh(host, f"docker exec {name} {OPEN}").strip()


def need_reload(host) -> str:
    return sh(host, f"systemctl show -p NeedDaemonReload --value {UNIT}").strip()


@pytest.fixture(scope="module")
def gpu_host(hostpool, tmp_path_factory):
    t0 = time.monotonic()
    (h,) = hostpool.get("daemon-reload", 1, release="bookworm", private_network=True, containers=True)
    sh(h, "command -v docker >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io >/dev/null")
    smoke_image.build(h)
    # SIMULATED device nodes (no driver), no /dev/char links; a test unit systemd knows
    sh(h, "rm -f /dev/char/195:0 /dev/char/195:255 /run/gpufleet/daemon-reload-pending; "
          "[ -c /dev/nvidia0 ] || mknod -m 666 /dev/nvidia0 c 195 0; [ -c /dev/nvidiactl ] || mknod -m 666 /dev/nvidiactl c 195 255; "
          f"docker rm -f gf-a gf-b gf-c >/dev/null 2>&1; rm -rf /etc/systemd/system/{UNIT}.d; "
          # active, so that systemd keeps it loaded: a changed drop-in then waits for a reload
          f"printf '[Service]\\nType=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/true\\n' > /etc/systemd/system/{UNIT}; "
          f"systemctl daemon-reload && systemctl restart {UNIT}")
    inv = write_inventory(tmp_path_factory.mktemp("reload") / "inventory.py", [h],
                          data={h.name: {"tier": "dev", "validate_os_release": OS_RELEASE[h.release]}})
    print(f"[timing] daemon-reload host ready (docker.io, image): {time.monotonic() - t0:.1f} s")
    yield h, inv
    sh(h, "docker rm -f gf-a gf-b gf-c >/dev/null 2>&1; true")


def test_a_reload_that_would_cut_a_gpu_container_off_is_deferred_and_said(gpu_host):
    h, inv = gpu_host
    scope = start(h, "gf-a")
    assert sees(h, "gf-a") == ALLOWED
    first = pyinfra(inv, DEPLOY, netns=h.netns)
    assert first.returncode == 0, first.output[-4000:]
    assert "systemd daemon-reload PENDING (not done)" in first.output and scope in first.output, first.output[-4000:]
    assert sees(h, "gf-a") == ALLOWED                      # its device is still its own
    assert need_reload(h) == "yes"                          # the drop-in is written, not yet read
    assert sh(h, "cat /run/gpufleet/daemon-reload-pending").split() == [scope]
    assert sh(h, "stat -c '%U %a' /run/gpufleet/daemon-reload-pending").strip() == "root 600"   # gpufleet's files: 0600
    second = pyinfra(inv, DEPLOY, netns=h.netns)
    assert second.returncode == 0 and changed_operations(second) == [], second.output[-4000:]
    assert "systemd daemon-reload still PENDING" in second.output, second.output[-4000:]
    assert sees(h, "gf-a") == ALLOWED and need_reload(h) == "yes"


def test_with_the_links_the_deferred_reload_is_done_and_containers_keep_their_devices(gpu_host):
    h, inv = gpu_host
    # NVIDIA's fix (what its udev rule runs, and the toolkit's nvidia-ctk here by hand: this
    # host has no toolkit), then the container the reload was deferred for goes away
    sh(h, "ln -sfn ../nvidia0 /dev/char/195:0 && ln -sfn ../nvidiactl /dev/char/195:255 && docker rm -f gf-a >/dev/null")
    start(h, "gf-b")                                        # started with the links: its unit names them
    assert sees(h, "gf-b") == ALLOWED
    run = pyinfra(inv, DEPLOY, netns=h.netns)
    assert run.returncode == 0, run.output[-4000:]
    assert "(and the one an earlier run deferred)" in run.output, run.output[-4000:]
    assert "PENDING" not in run.output, run.output[-4000:]
    assert need_reload(h) == "no"                           # the reload happened: the drop-in is in force
    assert sh(h, f"systemctl show -p Environment --value {UNIT}").strip() == "GF_TEST=1"
    assert sh(h, "test -e /run/gpufleet/daemon-reload-pending && echo there || echo gone").strip() == "gone"
    assert sees(h, "gf-b") == ALLOWED                       # and gf-b kept its device across it
    again = pyinfra(inv, DEPLOY, netns=h.netns)
    assert again.returncode == 0 and changed_operations(again) == [], again.output[-4000:]


def test_control_a_plain_reload_cuts_a_container_started_without_links_off(gpu_host):
    """What the gate prevents is real on this host: without the links, systemd takes the
    device from a running container at the next reload."""
    h, _ = gpu_host
    sh(h, "rm -f /dev/char/195:0 /dev/char/195:255")
    start(h, "gf-c")
    assert sees(h, "gf-c") == ALLOWED
    sh(h, "systemctl daemon-reload")
    assert sees(h, "gf-c") == CUT_OFF
    sh(h, "docker rm -f gf-c gf-b >/dev/null; ln -sfn ../nvidia0 /dev/char/195:0; ln -sfn ../nvidiactl /dev/char/195:255")
