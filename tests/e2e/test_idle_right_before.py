"""End-to-end (issue 26 items 6 and 8): nothing half done, idle right before.

On one simulated HGX H100 host (stand-in NVIDIA repository), deploys/driver.py as all.py runs it:

1. a GPU job started after pyinfra's planning (read live from its output: "--> Beginning
   operation run") makes the first install's reboot refuse: the host is reported busy, pending,
   and not rebooted (its boot count unchanged; the simulator's old module still loaded);
2. once the job ends, a re-run reboots it into the installed driver;
3. an interrupted dpkg (a stack package unpacked, never configured) is repaired by all.py's
   package change, which runs as the rollout's transient unit; a next run changes nothing.
"""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import write_inventory
from tests.e2e import rollout_fleet as rf
from tests.e2e.pyinfra_cli import PYINFRA, REPO, changed_operations, pyinfra
from tests.e2e.test_driver import OLD, RUNNER, _nvidia_data, loaded_module, sh, upstream, versions

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
CUDNN = "libcudnn9-cuda-13"


def boots(host) -> int:
    return int((host.dir / "boots").read_text()) if (host.dir / "boots").exists() else 0


def start_job(host) -> str:
    """A "training job": holds a GPU device node (seen even during a driver/library mismatch) and
    is listed by the simulator's nvidia-smi as a compute process."""
    pid = sh(host, "[ -e /dev/nvidia0 ] || touch /dev/nvidia0; "
                   "(nohup sh -c 'exec sleep 3600 3</dev/nvidia0' >/dev/null 2>&1 & echo $!)").strip()
    sh(host, f"gpusimctl add-process --gpu 0 --pid {pid} --name python3 --used-mib 1024")
    return pid


def run_starting_a_job_after_planning(inv, host) -> tuple[int, str, str]:
    proc = subprocess.Popen([str(PYINFRA), "-y", str(inv), RUNNER], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"))
    assert proc.stdout is not None
    head, pid = [], ""
    for line in proc.stdout:
        head.append(line)
        if "--> Beginning operation run" in line:
            pid = start_job(host)   # planning is over: what it read says "idle"
            break
    rest, _ = proc.communicate(timeout=1200)
    assert pid, "".join(head)
    return proc.returncode, "".join(head) + rest, pid


def test_job_after_planning_stops_the_reboot_rerun_reboots_interrupted_dpkg_repaired(hostpool, aptrepo, tmp_path):  # noqa: F811
    (host,) = hostpool.get("idle-right-before", 1, release="bookworm", gpu="h100x8")
    inv = write_inventory(tmp_path / "inv.py", [host], data={host.name: _nvidia_data(
        host, aptrepo, driver_version=OLD, driver_reboot="if-idle")})
    before = boots(host)
    t0 = time.monotonic()
    rc, out, pid = run_starting_a_job_after_planning(inv, host)
    t1 = time.monotonic()
    assert rc == 0, out
    tail = out[out.index("--> Results:"):]
    assert "NEED A REBOOT" in tail and "BUSY, PENDING: not rebooted" in tail and f"/dev/nvidia*: {pid}" in tail, tail
    assert "GPU work started after planning" in tail
    assert boots(host) == before                          # not rebooted
    assert "580.159.04" in loaded_module(host)            # the module from before the install
    assert upstream(versions(host, "nvidia-open")["nvidia-open"]) == OLD   # installed by the unit
    # the first install ran as the package change unit, with the exact version decided before it
    log = sh(host, "cat /var/log/gpufleet/package-change.log")
    assert "package change: " in log and f"install=nvidia-open={OLD}-" in log, log

    sh(host, f"kill {pid}; gpusimctl remove-process --pid {pid}")
    again = pyinfra(inv, RUNNER)
    t2 = time.monotonic()
    assert again.returncode == 0, again.output
    assert boots(host) > before
    assert f"Open Kernel Module for x86_64  {OLD}  " in loaded_module(host)

    # an interrupted change: a stack package unpacked and never configured
    sh(host, f"cd /tmp && apt-get download -q {CUDNN}=9.17.0.29-1 && dpkg --unpack --force-hold /tmp/{CUDNN}_*.deb")
    assert CUDNN in sh(host, "dpkg --audit")
    repaired = pyinfra(inv, RUNNER)
    t3 = time.monotonic()
    assert repaired.returncode == 0, repaired.output
    assert sh(host, "dpkg --audit").strip() == ""
    assert sh(host, f"dpkg-query -W -f='${{db:Status-Abbrev}}' {CUDNN}").strip() in ("ii", "hi")
    unit = sh(host, "systemctl show -p Result -p ExecMainStatus gpufleet-package-change.service")
    assert "Result=success" in unit and "ExecMainStatus=0" in unit
    last = pyinfra(inv, RUNNER)
    assert last.returncode == 0 and changed_operations(last) == [], last.output
    print(f"\n[timing] install + busy refusal {t1 - t0:.1f} s; re-run with reboot {t2 - t1:.1f} s; "
          f"dpkg repair {t3 - t2:.1f} s; no-op run {time.monotonic() - t3:.1f} s")
    testhosts.ssh(host, "true")


# --- tools/rollout: a job started after the drain --------------------------------------------------

def rollout_starting_a_job_after(work, host, marker: str, start) -> tuple[int, str]:
    """tools/rollout on `host`; `start()` runs as soon as its output shows `marker`."""
    proc = subprocess.Popen([str(REPO / "tools/rollout"), f"{host.name}.py", "--driver-version", rf.NEW, "-y"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    head, started = [], False
    for line in proc.stdout:
        head.append(line)
        if marker in line:
            start()
            started = True
            break
    rest, _ = proc.communicate(timeout=900)
    out = "".join(head) + rest
    print(out)
    assert started, out
    return proc.returncode, out


def test_rollout_job_after_planning_refuses_the_swap_then_the_reboot_busy_pending(hostpool, aptrepo, tmp_path):  # noqa: F811
    import json

    (h,) = hostpool.get("idle-right-before-rollout", 1, release="bookworm", gpu=rf.GPU)
    t0 = time.monotonic()
    rf.prepare_all([h], aptrepo)
    rf.inventory(tmp_path / f"{h.name}.py", [h], aptrepo)
    status = lambda: json.loads((tmp_path / ".gpufleet/rollouts" / f"{h.name}.json").read_text())["hosts"][h.name]  # noqa: E731
    before = boots(h)
    t1 = time.monotonic()
    # 1. a simulated GPU process from right after the drain: the package swap is refused
    rc, out = rollout_starting_a_job_after(tmp_path, h, f"{h.name}: drain ok", lambda: rf.sh(
        h, "gpusimctl add-process --gpu 0 --pid 4242 --name python3 --used-mib 2048"))
    t2 = time.monotonic()
    assert rc == 3, out
    assert "upgrade BUSY" in out and "GPU work is running, not changing the driver packages: 4242, python3" in out
    assert status()["status"] == "busy" and "packages not changed" in status()["message"]
    assert rf.version(h, "nvidia-open") == f"ii {rf.OLD_DEB}" and rf.loaded(h) == rf.OLD and boots(h) == before
    rf.sh(h, "gpusimctl remove-process --pid 4242")

    # 2. a job started right after the package change (by a test-only apt hook on the host, inside
    # the unit, once the swap's idle check has passed): the reboot is refused, the host pending
    rf.sh(h, "[ -e /dev/nvidia0 ] || touch /dev/nvidia0; touch /run/test-start-job; "
             "printf '#!/bin/sh\\n[ -e /run/test-start-job ] || exit 0\\nrm -f /run/test-start-job\\n"
             "systemd-run --unit=gpu-job --quiet sh -c \"exec sleep 600 3</dev/nvidia0\"\\n' > /usr/local/sbin/test-start-job; "
             "chmod 755 /usr/local/sbin/test-start-job; "
             "echo 'DPkg::Post-Invoke { \"/usr/local/sbin/test-start-job\"; };' > /etc/apt/apt.conf.d/99gpufleet-test-job")
    rc, out = rollout_starting_a_job_after(tmp_path, h, "surveying", lambda: None)
    t3 = time.monotonic()
    jobs = [rf.sh(h, "systemctl show -p MainPID --value gpu-job").stdout.strip()]
    assert rc == 3, out
    assert "reboot BUSY" in out and "GPU work is running, not rebooting" in out
    assert status()["status"] == "busy" and "upgraded, not rebooted" in status()["message"]
    assert rf.version(h, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(h) == rf.OLD and boots(h) == before

    # 3. the job ends: the re-run reboots and finishes
    assert jobs[0] not in ("", "0") and f"/dev/nvidia*: {jobs[0]}" in out
    rf.sh(h, "systemctl stop gpu-job; rm -f /etc/apt/apt.conf.d/99gpufleet-test-job")
    r = subprocess.run([str(REPO / "tools/rollout"), f"{h.name}.py", "--driver-version", rf.NEW, "-y"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=900)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout
    assert status()["status"] == "done" and rf.loaded(h) == rf.NEW and boots(h) > before
    print(f"\n[timing] rollout host prepared {t1 - t0:.1f} s; swap refused {t2 - t1:.1f} s; reboot refused "
          f"{t3 - t2:.1f} s; re-run {time.monotonic() - t3:.1f} s")
