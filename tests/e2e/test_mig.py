"""End-to-end (issue 32): MIG partitions from the tier, on ONE sandbox-shaped HGX host (2 x H200,
the recorded host's GPUs, SIMULATED: testing/gpusim, a test double; its MIG mode is kept across a
reboot, its instances are not, as on a real GPU).

The deploy is all.py's order cut to the steps MIG stands on and the ones that must keep working
around it: preflight, base, the driver (which installs DCGM, from the stand-in CUDA repository,
testing/aptrepo.py), tuning, and monitoring (DCGM's host engine and its exporter: stand-ins from
that repository, test doubles serving the simulated GPUs), as the operator runs it, as root.
After the layout is applied, after the real reboot and after ``gpu_mig: none``,
nvidia-dcgm.service and nvidia-dcgm-exporter.service are active and the exporter, asked from
outside the host, answers /metrics with every GPU: in MIG mode with a line per GPU instance
labelled GPU_I_PROFILE and GPU_I_ID, as NVIDIA's exporter does (its stand-in learns the instances
only when it starts: they show only if it was restarted after they were made). In order, on the
same host:

1. ``gpu_mig: {"all": ["3g.40gb"]}`` (an H100 profile) is refused at planning naming gpu_mig, the
   host and the H200's profiles; nothing changes;
2. ``{"all": ["3g.71gb", "3g.71gb"]}`` with a GPU process running on GPU 0 (listed by nvidia-smi and
   holding GPU 0's device node): the first run installs everything else, GPU 1 gets its partitions
   (work on GPU 0 does not hold it up) and GPU 0 is reported PENDING, not changed (no command for it
   reaches the GPUs);
3. the process gone: GPU 0 too in MIG mode with 2 GPU instances (each with its compute
   instance; its mode change, left pending by the simulated GPU, made effective by a GPU reset in
   the same gated command), the plan view and the gate say so, clocks left to the driver; a second run changes nothing;
4. a real reboot of the test host loses the instances; the boot unit re-creates them;
5. ``gpu_mig: none`` turns MIG off (instances destroyed first) and the clocks come back; the boot
   unit goes; a second run changes nothing.
"""
from __future__ import annotations

import re
import textwrap
import time

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra
from tests.e2e.test_monitoring import scrape
from tests.e2e.test_tuning import HGX, sh

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

LOG = "/run/gpusim/commands.log"
LAYOUT = {"all": ["3g.71gb", "3g.71gb"]}
MODES = "nvidia-smi --query-gpu=index,mig.mode.current,mig.mode.pending --format=csv,noheader"
DCGM_UNITS = ("nvidia-dcgm.service", "nvidia-dcgm-exporter.service")

# all.py's order, cut to the steps MIG stands on (driver: DCGM; tuning: MIG) and monitoring
DEPLOY = textwrap.dedent("""\
    from pyinfra import host, state
    from gpufleet.deploys.base import base
    from gpufleet.deploys.driver import driver
    from gpufleet.deploys.monitoring import monitoring
    from gpufleet.deploys.preflight import preflight
    from gpufleet.deploys.tuning import tuning
    from gpufleet.config.failures import host_failed
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    for step in (preflight, base, driver, tuning, monitoring):
        if host_failed(host):
            break
        step()
    """)


def instances(host) -> dict[int, list[str]]:
    """GPU index -> the profiles of its GPU instances (nvidia-smi mig -lgi), and each has its
    compute instance (nvidia-smi mig -lci)."""
    out: dict[int, list[str]] = {}
    for line in sh(host, "nvidia-smi mig -lgi 2>/dev/null; true").splitlines():
        words = line.split()
        if len(words) > 3 and words[0] == "|" and words[2] == "MIG":
            out.setdefault(int(words[1]), []).append(words[3])
    cis = [line for line in sh(host, "nvidia-smi mig -lci 2>/dev/null; true").splitlines()
           if len(line.split()) > 4 and line.split()[3] == "MIG"]
    assert len(cis) == sum(map(len, out.values())), cis
    return out


def dcgm_serving(host, lines_per_gpu: int) -> None:
    """DCGM's host engine and its exporter are active (waited for a little: after a reboot they
    start with the host) and the exporter, asked from outside the host, answers /metrics with a
    temperature for every GPU: for a GPU in MIG mode one line per GPU instance, labelled with its
    profile and id (GPU_I_PROFILE, GPU_I_ID) as nvidia-smi mig -lgi lists them, as the real
    dcgm-exporter does; the stand-in learns them only when it starts, so they are there only if
    the exporter was restarted after the instances were made."""
    deadline = time.monotonic() + 60
    while True:
        states = sh(host, "systemctl is-active " + " ".join(DCGM_UNITS) + "; true").split()
        if states == ["active", "active"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert states == ["active", "active"], (states, sh(host, "journalctl -b -n 40 --no-pager -u 'nvidia-dcgm*'; true"))
    lgi: dict[str, list[tuple[str, str]]] = {}
    for line in sh(host, "nvidia-smi mig -lgi 2>/dev/null; true").splitlines():
        words = line.split()
        if len(words) > 5 and words[0] == "|" and words[2] == "MIG":
            lgi.setdefault(words[1], []).append((words[3], words[5]))
    want = [(gpu, bus, *instance) for gpu, bus in (("0", "00000000:00:06.0"), ("1", "00000000:00:07.0"))
            for instance in lgi.get(gpu, [("", "")])]
    text = scrape(f"http://{host.address}:9400/metrics")
    have = re.findall(r'^DCGM_FI_DEV_GPU_TEMP\{gpu="(\d+)",UUID="GPU-[^"]+",pci_bus_id="([^"]+)",device="nvidia\d+",'
                      r'modelName="NVIDIA H200"(?:,GPU_I_PROFILE="([^"]+)",GPU_I_ID="(\d+)")?,Hostname=', text, re.M)
    assert have == want and [[h[0] for h in have].count(g) for g in "01"] == [lines_per_gpu] * 2, text


def dcgm_started(run) -> list[str]:
    """The run's changed operations (their own names, after the deploy's) that concern DCGM."""
    return [op for op in changed_operations(run) if "dcgm" in op.split(" | ")[-1].lower()]


def set_commands(host) -> list[str]:
    return [line.split(" nvidia-smi ", 1)[1] for line in sh(host, f"cat {LOG} 2>/dev/null; true").splitlines()]


def test_mig_from_the_tier_gated_kept_across_reboot_and_turned_off(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    (host,) = hostpool.get("mig-hgx", 1, release="bookworm", gpu=f"h200x2@{TEST_DRIVER}")
    deploy = tmp_path_factory.mktemp("deploy") / "mig_deploy.py"
    deploy.write_text(DEPLOY)
    deploy = str(deploy)
    base = {**environment_data(host, "hgx", aptrepo), **HGX}

    def inventory(gpu_mig):
        return write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host],
                               data={host.name: {**base, "gpu_mig": gpu_mig}})

    t0 = time.monotonic()
    # 1. a profile the H200 lacks: refused at planning, naming the key, the host, what is allowed
    run = pyinfra(inventory({"all": ["3g.40gb"]}), deploy)
    assert run.returncode != 0
    assert (f"[{host.name}] refused (gpu_mig): GPU 0 NVIDIA H200 (00000000:00:06.0) has no MIG profile 3g.40gb. "
            "Fix: set gpu_mig to what this host allows: none | unmanaged | 1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, "
            "3g.71gb, 4g.71gb, 7g.141gb") in run.output, run.output
    assert sh(host, MODES).splitlines() == ["0, Disabled, Disabled", "1, Disabled, Disabled"]
    assert set_commands(host) == []
    t1 = time.monotonic()

    # 2. a GPU process runs on GPU 0: everything else is set up, GPU 1 partitioned, GPU 0 pending
    inv = inventory(LAYOUT)
    pid = sh(host, "[ -e /dev/nvidia0 ] || touch /dev/nvidia0; "
                   "(nohup sh -c 'exec sleep 3600 3</dev/nvidia0' >/dev/null 2>&1 & echo $!)").strip()
    sh(host, f"gpusimctl add-process --gpu 0 --pid {pid} --name python3 --used-mib 2048")
    run = pyinfra(inv, deploy)
    assert run.returncode == 0, run.output
    assert (f"MIG PENDING: partitions not changed where GPU work is running: GPU 0: {pid}, python3 "
            f"processes holding /dev/nvidia0: {pid}") in run.output, run.output
    assert "MIG partitions PENDING" in run.output[run.output.index("--> Results:"):], run.output
    assert sh(host, MODES).splitlines() == ["0, Disabled, Disabled", "1, Enabled, Enabled"]
    assert instances(host) == {1: ["3g.71gb", "3g.71gb"]}
    assert not [c for c in set_commands(host) if "-i 0" in c], set_commands(host)
    assert sh(host, "systemctl is-enabled gpufleet-gpu-mig.service").strip() == "enabled"
    sh(host, f"gpusimctl remove-process --pid {pid}; kill {pid}; rm -f /dev/nvidia0")
    t2 = time.monotonic()

    # 3. idle: MIG on, 2 instances per GPU; clocks not touched on MIG GPUs; the plan and the gate agree.
    # GPU 0's mode change waits for a GPU reset (simulated: gpusimctl fault mig-needs-reset): the
    # gated command, whose idle check found GPU 0 idle, resets it (nvidia-smi -r -i 0)
    sh(host, "gpusimctl fault --gpu 0 mig-needs-reset")
    before = len(set_commands(host))
    run = pyinfra(inv, deploy)
    sh(host, "gpusimctl fault --clear")
    assert run.returncode == 0, run.output
    assert sh(host, MODES).splitlines() == ["0, Enabled, Enabled", "1, Enabled, Enabled"]
    assert instances(host) == {0: ["3g.71gb", "3g.71gb"], 1: ["3g.71gb", "3g.71gb"]}
    new = set_commands(host)[before:]
    assert [c for c in new if "-ac" in c or "-lgc" in c] == [], new   # not settable in MIG mode
    assert "-i 0 -mig 1" in new and "mig -i 0 -cgi 3g.71gb,3g.71gb -C" in new, new
    assert new[new.index("-i 0 -mig 1") + 1] == "-r -i 0" and "-r -i 1" not in new, new
    assert not [c for c in new if "-i 1" in c], new   # made in the first run
    # DCGM and its exporter, stopped for GPU 0's mode change, were started again by the MIG script
    # itself: the monitoring step after it found them running (nothing of DCGM's changed)
    assert dcgm_started(run) == [], dcgm_started(run)
    dcgm_serving(host, 2)   # 2 instances on each GPU
    again = pyinfra(inv, deploy)
    assert again.returncode == 0 and changed_operations(again) == [], again.output
    t3 = time.monotonic()
    plan = pyinfra(inv, "deploys/plan.py")
    assert "mig: GPU 0, 1: 3g.71gb + 3g.71gb" in plan.output, plan.output
    assert "mig: GPU 1 NVIDIA H200 (00000000:00:07.0): has MIG on: 3g.71gb + 3g.71gb; as set" in plan.output
    assert ("mig: clocks are not settable in MIG mode: clock_policy max leaves 2 GPU(s) in MIG mode at the "
            "driver's clocks") in plan.output
    gate = pyinfra(inv, "deploys/validate.py")
    assert "[PASS] tuning: MIG partitions are what gpu_mig sets: GPU 0, 1: 3g.71gb + 3g.71gb" in gate.output, gate.output
    assert "[PASS] monitoring: the DCGM exporter serves metrics" in gate.output, gate.output
    t4 = time.monotonic()

    # 4. a real reboot loses the instances (/run); the boot unit re-creates them
    testhosts.reboot(host)
    assert instances(host) == {0: ["3g.71gb", "3g.71gb"], 1: ["3g.71gb", "3g.71gb"]}
    assert [c for c in set_commands(host) if "-cgi" in c] == ["mig -i 0 -cgi 3g.71gb,3g.71gb -C",
                                                              "mig -i 1 -cgi 3g.71gb,3g.71gb -C"]
    dcgm_serving(host, 2)
    t5 = time.monotonic()

    # 5. none: MIG off, the clocks of the tier back, the boot unit gone; then nothing to do
    inv = inventory("none")
    run = pyinfra(inv, deploy)
    assert run.returncode == 0, run.output
    assert dcgm_started(run) == [], dcgm_started(run)
    assert sh(host, MODES).splitlines() == ["0, Disabled, Disabled", "1, Disabled, Disabled"]
    rows = sh(host, "nvidia-smi --query-gpu=clocks.applications.memory,clocks.applications.graphics "
                    "--format=csv,noheader,nounits").splitlines()
    assert rows == ["3201, 1980", "3201, 1980"], rows
    assert sh(host, "ls /etc/systemd/system/gpufleet-gpu-mig.service /etc/gpufleet/gpu-mig.env 2>/dev/null; true") == ""
    dcgm_serving(host, 1)
    again = pyinfra(inv, deploy)
    assert again.returncode == 0 and changed_operations(again) == [], again.output
    t6 = time.monotonic()
    print(f"\n[timing] refused {t1 - t0:.1f} s; first run, busy {t2 - t1:.1f} s; applied + no-op {t3 - t2:.1f} s; "
          f"plan + gate {t4 - t3:.1f} s; reboot {t5 - t4:.1f} s; none + no-op {t6 - t5:.1f} s; total {t6 - t0:.1f} s")
