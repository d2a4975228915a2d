"""End-to-end: deploys/all.py tunes real systemd test hosts whose GPUs are SIMULATED.

The GPUs, nvidia-smi and nvidia-persistenced on these hosts are the gpufleet GPU simulator
(testing/gpusim/, a test double, not NVIDIA software): it keeps clocks and persistence mode in
/run like a real GPU (lost on a real reboot), rejects what the real nvidia-smi rejects, and logs
every set command to /run/gpusim/commands.log. Debian's real `nvidia-persistenced` package is
installed from the archive; the simulator's stand-in daemon sits behind a dpkg diversion.

Hosts: 1 x H200 and 2 x H200 NVLink (hgx), 1 x T4 (dev), 4 x A100 (research), plus 2 x A100 on
driver R595 (research: -ac is deprecated there, so clocks are locked with -lgc/-lmc).

The deploy is all.py's order cut to the steps tuning stands on (validate the inventory, preflight,
base, tuning), like tests/e2e/test_docker.py: the driver and docker steps need package
repositories the test hosts only get from the aptrepo fixture, and are tested on their own.
"""
from __future__ import annotations

import json
import subprocess
import textwrap
import time

import pytest

from testing import testhosts
from testing.inventory import write_inventory
from tests.e2e.pyinfra_cli import REPO, NoResultsTable, changed_operations, pyinfra
from tests.e2e.remote import remote

pytestmark = pytest.mark.e2e

LOG = "/run/gpusim/commands.log"
QUERY = "nvidia-smi --query-gpu=pci.bus_id,persistence_mode,{} --format=csv,noheader,nounits"
APP = "clocks.applications.memory,clocks.applications.graphics"
CURRENT = "clocks.current.memory,clocks.current.graphics"
CLOCK_CHECK = "GPU clocks are what the tier's clock policy sets"

# (pool key, simulator spec, inventory data, clock pair every GPU must end at, how: app or locked clocks)
HGX = {"tier": "hgx", "tier_mismatch": "warn", "tuning_nccl_socket_ifname": "auto"}
FLEET = [
    ("h200x1", "h200", HGX, (3201, 1980), "app"),
    ("h200x2", "h200x2", HGX, (3201, 1980), "app"),
    ("t4", "t4", {"tier": "dev"}, (5001, 585), "app"),  # dev: clock_policy default
    ("a100x4", "a100x4", {"tier": "research"}, (1215, 1410), "app"),
    ("a100x2-r595", "a100x2@595.45.04", {"tier": "research"}, (1215, 1410), "locked"),
]
REBOOTED = ("a100x4", "a100x2-r595")

DEPLOY = textwrap.dedent("""\
    from pyinfra import host, state
    from gpufleet.deploys.base import base
    from gpufleet.deploys.preflight import preflight
    from gpufleet.deploys.tuning import tuning
    from gpufleet.config.failures import host_failed
    from gpufleet.config.settings import validate_inventory

    validate_inventory(state.inventory)
    for step in (preflight, base, tuning):
        if host_failed(host):
            break
        step()
    """)


def deploy_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("deploy") / "tuning_deploy.py"
    path.write_text(DEPLOY)
    return str(path)


def sh(host, command: str) -> str:
    return testhosts.ssh(host, command).stdout


def gpu_rows(host, fields: str) -> list[list[str]]:
    return [line.split(", ") for line in sh(host, QUERY.format(fields)).splitlines()]


def set_commands(host) -> list[str]:
    return sh(host, f"cat {LOG} 2>/dev/null || true").splitlines()


@pytest.fixture(scope="module")
def fleet(hostpool, tmp_path_factory):
    hosts = {key: hostpool.get(f"tuning-{key}", 1, release="bookworm", gpu=spec)[0] for key, spec, *_ in FLEET}
    data = {hosts[key].name: {**extra, "validate_os_release": "debian-12"} for key, _, extra, *_ in FLEET}
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", list(hosts.values()), data=data)
    deploy = deploy_file(tmp_path_factory)
    started = time.monotonic()
    first = pyinfra(inv, deploy)
    first_seconds = time.monotonic() - started
    print(f"\nfirst run: {first_seconds:.1f} s, {first.changed} changed operations")
    return {"hosts": hosts, "inv": inv, "deploy": deploy, "first": first, "first_seconds": first_seconds, "after_first": {}}


@pytest.fixture(scope="module")
def converged(fleet):
    first = fleet["first"]
    assert first.returncode == 0, first.output
    assert first.errors == 0, first.output
    return fleet


def test_persistence_daemon_holds_every_gpu(converged):
    for key, host in converged["hosts"].items():
        t = remote(host)
        assert t.package("nvidia-persistenced").is_installed, key
        daemon = t.service("nvidia-persistenced")
        assert daemon.is_enabled and daemon.is_running, key
        # the real package's binary went to the diverted name; the unit runs the simulator's stand-in
        assert t.file("/usr/bin/nvidia-persistenced.distrib").exists, key
        rows = gpu_rows(host, "index")
        assert rows and all(row[1] == "Enabled" for row in rows), (key, rows)
        # gpufleet never used the legacy nvidia-smi -pm
        assert not [c for c in set_commands(host) if " -pm " in c], key


def test_clocks_at_the_tiers_pair_and_unit_enabled(converged):
    for key, _, _, pair, how in FLEET:
        host = converged["hosts"][key]
        rows = gpu_rows(host, CURRENT if how == "locked" else APP)
        assert [tuple(map(int, row[2:4])) for row in rows] == [pair] * len(rows), (key, rows)
        unit = remote(host).service("gpufleet-gpu-clocks")
        assert unit.is_enabled, key
        assert sh(host, "systemctl show -p After gpufleet-gpu-clocks.service").count("nvidia-persistenced.service")
        env = sh(host, "cat /etc/gpufleet/gpu-clocks.env")
        assert env.startswith("# Managed by gpufleet (deploys/tuning.py) for tier "), key
    log = set_commands(converged["hosts"]["a100x4"])
    assert [c.split(" nvidia-smi ")[1] for c in log] == [
        f"-i 00000000:00:{n:02X}.0 -ac 1215,1410" for n in range(6, 10)]
    # the H200s already ran at their highest pair, the T4 at its default: no set command at all
    for key in ("h200x1", "h200x2", "t4"):
        assert set_commands(converged["hosts"][key]) == [], key
    locked = set_commands(converged["hosts"]["a100x2-r595"])
    assert [c.split(" nvidia-smi ")[1] for c in locked] == [
        "-i 00000000:00:06.0 -lgc 1410,1410", "-i 00000000:00:06.0 -lmc 1215,1215",
        "-i 00000000:00:07.0 -lgc 1410,1410", "-i 00000000:00:07.0 -lmc 1215,1215"]


def _fleet_report(inv, out, *args: str) -> dict:
    proc = subprocess.run([str(REPO / "tools/fleet-report"), str(inv), "--out", str(out), "--no-drift", "--quiet",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return {r["host"]: r for r in json.loads((out / "fleet-report.json").read_text())["hosts"]}


def test_the_fleet_report_shows_the_applied_pair_beside_the_planned_one(converged, tmp_path):
    """tools/fleet-report on the converged fleet: application clocks read back from nvidia-smi
    (R580 hosts), locked clocks from gpufleet's records (the R595 host), each = planned; then the
    inventory asks for another pair (--data) and the same clocks are ≠ planned, as the gate says."""
    hosts, started = converged["hosts"], time.monotonic()
    rows = _fleet_report(converged["inv"], tmp_path / "at-plan")
    for key, _, _, (mem, gfx), how in FLEET:
        row = rows[hosts[key].name]
        method = "locked" if how == "locked" else "application"
        label = f"{method} {mem},{gfx} = planned" + (" default" if key == "t4" else "")
        assert (row["gpu_clocks"]["method"], row["clocks"]) == (method, label), (key, row["gpu_clocks"])
        clock_check = [c for c in row["validation"]["checks"] if c["name"] == CLOCK_CHECK]
        assert [c["status"] for c in clock_check] == ["pass"], (key, clock_check)
    asked = '{"memory": 1215, "graphics": 1395}'
    names = [hosts["a100x4"].name, hosts["a100x2-r595"].name]
    rows = _fleet_report(converged["inv"], tmp_path / "other-pair", "--limit", names[0], "--limit", names[1],
                         "--data", f"clock_policy={asked}")
    assert sorted(rows) == sorted(names)
    for name, method in zip(names, ("application", "locked")):
        row = rows[name]
        assert row["clocks"] == f"{method} 1215,1410 ≠ planned 1215,1395", row["gpu_clocks"]
        assert {(g["applied"], g["planned"], g["at_plan"]) for g in row["gpu_clocks"]["gpus"]} == {
            ("1215,1410", "1215,1395", False)}
        clock_check = [c for c in row["validation"]["checks"] if c["name"] == CLOCK_CHECK]
        assert [c["status"] for c in clock_check] == ["fail"] and "wants 1215,1395" in clock_check[0]["message"]
    print(f"\ntwo fleet reports: {time.monotonic() - started:.1f} s")


def test_environment_for_login_shells_services_and_nccl(converged):
    for key, _, extra, *_ in FLEET:
        host = converged["hosts"][key]
        cores = int(sh(host, "lscpu -p=Core,Socket | grep -v '^#' | sort -u | wc -l"))
        gpus = len(gpu_rows(host, "index"))
        threads = max(1, cores // gpus)
        want = f"{threads} {threads} expandable_segments:True expandable_segments:True PCI_BUS_ID"
        got = sh(host, "bash -lc 'echo $OMP_NUM_THREADS $MKL_NUM_THREADS $PYTORCH_CUDA_ALLOC_CONF "
                       "$PYTORCH_ALLOC_CONF $CUDA_DEVICE_ORDER'").strip()
        assert got == want, (key, cores, gpus)
        # a job started by systemd sees the same values
        got = sh(host, "systemd-run --wait -q sh -c 'echo $OMP_NUM_THREADS $MKL_NUM_THREADS "
                       "$PYTORCH_CUDA_ALLOC_CONF $PYTORCH_ALLOC_CONF $CUDA_DEVICE_ORDER > /root/job-env'; "
                       "cat /root/job-env").strip()
        assert got == want, key
        # /etc/nccl.conf names the host's real, up interfaces (never lo, docker, veth)
        up = sorted(sh(host, "cd /sys/class/net && for i in *; do [ \"$(cat $i/operstate)\" = up ] && echo $i; "
                             "done; true").split())
        up = [i for i in up if i != "lo" and not i.startswith(("docker", "veth"))]
        assert up, key
        nccl = sh(host, "cat /etc/nccl.conf")
        assert nccl.startswith(f"# Managed by gpufleet (deploys/tuning.py) for tier {extra['tier']}.")
        assert f"\nNCCL_SOCKET_IFNAME=={','.join(up)}\n" in nccl, (key, nccl)
        for debug in ("NCCL_IB_DISABLE=", "NCCL_NET_GDR_LEVEL=", "NCCL_P2P_LEVEL=", "NCCL_ALGO=", "NCCL_PROTO=",
                      "NCCL_DEBUG="):
            assert f"\n{debug}" not in nccl, key
        for path in ("/etc/profile.d/gpufleet-gpu.sh", "/etc/systemd/system.conf.d/gpufleet-gpu-env.conf",
                     "/etc/environment.d/60-gpufleet-gpu.conf"):
            assert sh(host, f"head -n 1 {path}").startswith("# Managed by gpufleet (deploys/tuning.py) for tier "
                                                             f"{extra['tier']}."), (key, path)


@pytest.fixture(scope="module")
def rebooted(converged):
    for key in REBOOTED:
        host = converged["hosts"][key]
        boot = sh(host, "cat /proc/sys/kernel/random/boot_id")
        testhosts.reboot(host)
        assert sh(host, "cat /proc/sys/kernel/random/boot_id") != boot
        # the unit runs once the host is up; wait for it rather than race it
        sh(host, "for i in $(seq 50); do systemctl is-active -q gpufleet-gpu-clocks && break; sleep 0.2; done; true")
    return converged


def test_real_reboot_forgets_clocks_and_the_unit_reapplies_them(rebooted):
    for key, _, _, pair, how in FLEET:
        if key not in REBOOTED:
            continue
        host = rebooted["hosts"][key]
        assert sh(host, "systemctl is-active gpufleet-gpu-clocks nvidia-persistenced").split() == ["active", "active"]
        rows = gpu_rows(host, CURRENT if how == "locked" else APP)
        assert [tuple(map(int, row[2:4])) for row in rows] == [pair] * len(rows), (key, rows)
        assert all(row[1] == "Enabled" for row in rows)
        # /run was wiped by the reboot: every line in the log comes from the boot unit
        log = [c.split(" nvidia-smi ")[1] for c in set_commands(host)]
        flag = "-ac" if how == "app" else "-lgc"
        assert len([c for c in log if f" {flag} " in c]) == len(rows), (key, log)
        journal = sh(host, "journalctl -b -o cat -u gpufleet-gpu-clocks.service")
        assert "Finished gpufleet-gpu-clocks.service" in journal or "Started gpufleet-gpu-clocks" in journal, journal


def test_second_run_changes_nothing_and_issues_no_set_command(rebooted):
    hosts = rebooted["hosts"]
    before = {key: set_commands(host) for key, host in hosts.items()}
    started = time.monotonic()
    second = pyinfra(rebooted["inv"], rebooted["deploy"])
    print(f"\nsecond run: {time.monotonic() - started:.1f} s (first: {rebooted['first_seconds']:.1f} s)")
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    assert second.changed == 0 and second.unchanged > 0
    assert {key: set_commands(host) for key, host in hosts.items()} == before
    assert "already at their clocks" in second.output or "No changes" in second.output


# --- refusals at planning time --------------------------------------------------------------------


def test_unsupported_pair_or_unsettable_gpu_fails_at_planning_and_changes_nothing(hostpool, tmp_path_factory):
    h200 = hostpool.get("tuning-refuse-h200", 1, release="bookworm", gpu="h200")[0]
    t4 = hostpool.get("tuning-refuse-t4-r595", 1, release="bookworm", gpu="t4@595.45.04")[0]
    # validate_gpu_models narrows the tier to H200s: then no model in the compatibility data rules the pair
    # out before the run (the inventory check would stop the whole run), and the host's own GPU decides.
    data = {
        h200.name: {**HGX, "validate_os_release": "debian-12", "validate_gpu_models": ["NVIDIA H200"],
                    "clock_policy": {"memory": 1234, "graphics": 999}},
        t4.name: {"tier": "dev", "validate_os_release": "debian-12", "clock_policy": "max"},
    }
    inv = write_inventory(tmp_path_factory.mktemp("refuse") / "inventory.py", [h200, t4], data=data)
    # files newer than boot (the simulator's lock file appears on any nvidia-smi query: not a change)
    snapshot = "find /etc /usr/local /var/lib/dpkg/status /run/gpusim -newer /etc/hostname -type f ! -name lock | sort"
    before = {h.name: (sh(h, snapshot), sh(h, "dpkg -l | md5sum")) for h in (h200, t4)}
    run = pyinfra(inv, deploy_file(tmp_path_factory))
    assert run.returncode != 0
    assert (f"[{h200.name}] refused (clock_policy): clock pair memory 1234 MHz, graphics 999 MHz is not "
            "supported by GPU 0 NVIDIA H200 (00000000:00:06.0). Fix: set clock_policy to what this host allows: "
            "memory 3201 with "
            "graphics 1980..345 (step 15); memory 2201 with graphics 1980..345 (step 15); or max | default | "
            "unmanaged") in run.output, run.output
    assert (f"[{t4.name}] refused (clock_policy): GPU 0 Tesla T4 (00000000:00:06.0) "
            "(compute capability 7.5) has no settable clock pair on driver 595.45.04") in run.output, run.output
    assert "Fix: set clock_policy to what this host allows: default | unmanaged" in run.output
    # both refused at planning: pyinfra never executed, so it printed no results table at all
    with pytest.raises(NoResultsTable):
        changed_operations(run)
    assert "No hosts remaining" in run.output, run.output
    for host in (h200, t4):
        assert (sh(host, snapshot), sh(host, "dpkg -l | md5sum")) == before[host.name], host.name
        assert set_commands(host) == []
        assert sh(host, "ls /etc/nccl.conf /etc/gpufleet /etc/systemd/system/gpufleet-gpu-clocks.service "
                        "2>/dev/null; true") == ""


# --- one clock model; settings that depend on the host's hardware ----------------------------------


def test_max_means_the_gpus_own_highest_pair_in_plan_deploy_and_gate(hostpool, tmp_path_factory):
    """An A100 board whose supported-clocks list tops out at 1215,1395 (the simulator's list cut
    on this host, as on a power-capped board) while the catalogue's A100-SXM4-40GB says 1410: the
    plan view, the clocks applied and the gate all say 1395. The same runs show what the test
    host's hardware makes of tuning_cpu_governor (a container has no cpufreq), validate_min_ram_gb
    and validate_min_nic_gbps, against /proc and /sys read on the host."""
    host = hostpool.get("tuning-capped", 1, release="bookworm", gpu="a100")[0]
    sh(host, "sed -i 's/\"gfx_max\": 1410/\"gfx_max\": 1395/' /etc/gpusim/gpus.json")
    top = sh(host, "nvidia-smi -q -d SUPPORTED_CLOCKS | grep -m1 -A1 'Memory' ; true")
    assert "1395 MHz" in top and "1410" not in top, top
    inv = write_inventory(tmp_path_factory.mktemp("capped") / "inventory.py", [host],
                          data={host.name: {"tier": "research", "tier_mismatch": "warn",
                                            "validate_os_release": "debian-12"}})
    plan = pyinfra(inv, "deploys/plan.py")
    assert plan.returncode == 0, plan.output
    assert ("clocks: -ac 1215,1395 on GPU 0 (NVIDIA A100-SXM4-40GB) (the GPUs' own supported clocks)"
            in plan.output), plan.output

    run = pyinfra(inv, deploy_file(tmp_path_factory), "-v")  # -v: pyinfra prints the no-op messages
    assert run.returncode == 0, run.output
    assert [tuple(map(int, row[2:4])) for row in gpu_rows(host, APP)] == [(1215, 1395)]
    assert [c.split(" nvidia-smi ")[1] for c in set_commands(host)] == ["-i 00000000:00:06.0 -ac 1215,1395"]
    # tuning_cpu_governor: performance on a host without cpufreq: a no-op that says why, nothing written
    assert sh(host, "ls -d /sys/devices/system/cpu/cpu*/cpufreq 2>/dev/null; true") == ""
    assert "no cpufreq on this host (no /sys/devices/system/cpu/cpu*/cpufreq" in run.output, run.output
    assert sh(host, "ls /etc/tmpfiles.d/gpufleet-cpu-governor.conf "
                    "/etc/systemd/system/gpufleet-cpu-governor.service 2>/dev/null; true") == ""
    again = pyinfra(inv, deploy_file(tmp_path_factory))
    assert again.returncode == 0 and changed_operations(again) == [], again.output

    gate = pyinfra(inv, "deploys/validate.py")
    lines = [line.split(f"[{host.name}] ", 1)[1] for line in gate.output.splitlines() if f"[{host.name}] [" in line]
    assert ("[PASS] tuning: GPU clocks are what the tier's clock policy sets: 1 GPUs at policy max: "
            "-ac 1215,1395 on GPU 0 (NVIDIA A100-SXM4-40GB)") in lines, gate.output
    assert any(line.startswith("[SKIP] tuning: every CPU runs the tier's frequency governor: no cpufreq on this host")
               for line in lines), gate.output
    # research asks for 256 GB of RAM and a 25 Gbit/s NIC; the test host has what the machine has
    kib = int(sh(host, "grep MemTotal /proc/meminfo").split()[1])
    ram = (f"[WARN] preflight: the host has the tier's minimum RAM: {kib * 1024 / 1e9:.1f} GB of RAM (MemTotal), "
           "tier research expects at least 256 GB (validate_min_ram_gb; tier_mismatch: warn)")
    assert kib * 1024 / 1e9 >= 256 or any(line.startswith(ram) for line in lines), (ram, gate.output)
    speeds = {}
    for line in sh(host, "cd /sys/class/net && for i in *; do echo $i $(cat $i/type) $(cat $i/speed 2>/dev/null); "
                         "done").splitlines():
        name, kind, *speed = line.split()
        if kind in ("1", "32") and speed and speed[0].isdigit() and int(speed[0]) > 0 \
                and not name.startswith(("lo", "docker", "veth", "br-", "virbr", "ifb", "dummy", "tun", "tap", "wg")):
            speeds[name] = int(speed[0])
    nic = [line for line in lines if "the fastest data NIC reaches the tier's minimum speed" in line]
    assert len(nic) == 1, gate.output
    if speeds:
        best = max(speeds, key=lambda n: (speeds[n], n))
        assert nic[0].startswith(f"[WARN] preflight: the fastest data NIC reaches the tier's minimum speed: fastest "
                                 f"data NIC {best} runs at {speeds[best] / 1000:g} Gbit/s") or speeds[best] >= 25000, nic
    else:
        assert nic[0].startswith("[SKIP] preflight: the fastest data NIC reaches the tier's minimum speed: no Ethernet "
                                 "or InfiniBand interface reports its link speed"), nic
