"""End-to-end: a node earns its way into service (issue 46), on three research hosts behind
gpufleet's own firewall, each in a network namespace of its own (nftables really loads).

The hosts have simulated A100s at the old driver (tests/e2e/rollout_fleet.py) and real PyTorch
(the CPU build, testing/torch_cpu.py): the GPUs are a test double, so the acceptance's all-reduce
runs on gloo on the CPU, and says so. Hosts 0 and 1 trust all three as training peers; host 2's
firewall trusts none (firewall_cluster_cidrs: []), so it drops what its peers send it.

1. the first converge is `gpufleet-deploy INVENTORY`: all.py, then the acceptance of the hosts
   it converged, none of which is accepted yet (no known-good peer: they pair with host 0, said
   as a WARN): hosts 0 and 1 pass and get their record (0600 root's in root's 0700
   /var/lib/gpufleet, for the driver and CUDA they run), host 2 fails the all-reduce through its
   firewall, is named with the fix, gets no record, and the exit code is 4; a second
   gpufleet-deploy accepts no host again (the records untouched).
2. tools/rollout (canary 1, batch of 2, max_fail 1): the canary is accepted on its own (no known-
   good peer yet); in the batch, host 1 runs the all-reduce with the canary through the firewall
   and is resumed, host 2 fails acceptance naming the peer, stays drained (no undrain) and is
   named with the fix; the acceptance shows in the progress lines and in --json; the accepted
   hosts' records are written again, for the new driver.
3. tools/health --burn-in on host 1 with host 0 as its peer: a simulated InfiniBand port (a TEST
   DOUBLE: a sysfs-shaped tree in the host, read through GPUFLEET_TEST_SYSFS_ROOT, its
   symbol_error counter growing while the acceptance runs) fails it naming the port.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing import torch_cpu
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import environment_data, write_inventory
from tests.e2e import rollout_fleet as rf

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
REPO = Path(__file__).resolve().parents[2]
FAKE_SYS = "/var/lib/gpufleet-test-sys"   # the test double's sysfs root inside the hosts
PORT = f"{FAKE_SYS}/class/infiniband/mlx5_0/ports/1"
DEPLOY = Path(sys.executable).with_name("gpufleet-deploy")
RECORD = "/var/lib/gpufleet/acceptance.json"
FIRST: dict = {}    # the first gpufleet-deploy: its process and seconds


@pytest.fixture(scope="module")
def trio(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    torch_site, why = torch_cpu.site()
    if torch_site is None:
        pytest.fail(f"no PyTorch CPU build: {why}")
    started = time.monotonic()
    hosts = hostpool.get("acceptance", 3, release="bookworm", gpu=rf.GPU, private_network=True,
                         forward=(aptrepo.port,))
    rf.prepare_all(hosts, aptrepo)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda h: torch_cpu.install(h, torch_site), hosts))
    print(f"\nthree hosts at the old driver with torch in {time.monotonic() - started:.1f} s")
    peers = [f"{h.address}/32" for h in hosts]
    data = {h.name: {**environment_data(h, "research", aptrepo), "tier_mismatch": "warn", "driver_version": "auto",
                     "firewall_cluster_cidrs": peers if h is not hosts[2] else [],
                     "monitoring_node_exporter": False, "monitoring_dcgm_exporter": False,
                     "acceptance_timeout": 20,
                     # the shape all.py passes: the hosts' torch is the CPU build (testing/torch_cpu.py),
                     # and the CUDA toolkit installed by hand (rollout_fleet.prepare) took its components'
                     # newest releases, which the gate FAILs as changed by hand; the acceptance needs neither
                     "pytorch_version": "none", "cuda_version": "none", "cudnn_version": "none"} for h in hosts}
    work = tmp_path_factory.mktemp("acceptance")
    inv = write_inventory(work / "fleet.py", hosts, data=data)
    started = time.monotonic()
    # the first converge as an operator runs it: all.py, then the new hosts' acceptance
    FIRST["run"] = tool(hosts, inv, str(DEPLOY), str(inv), "-y")
    FIRST["seconds"] = time.monotonic() - started
    print(f"gpufleet-deploy (all.py and the acceptance) on the three: {FIRST['seconds']:.1f} s")
    return hosts, inv


def tool(hosts, inv: Path, *argv: str, env: dict | None = None, timeout: int = 1200) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", "netns", "exec", hosts[0].netns, *argv], cwd=inv.parent, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    print(proc.stdout[-8000:], proc.stderr[-8000:])
    return proc


def record(h) -> dict:
    return json.loads(rf.sh(h, f"cat {RECORD}").stdout)


def record_stat(h) -> str:
    """The record's and its folder's mode, owner and type, the record's mtime (ns) and content hash."""
    return rf.sh(h, f"stat -c '%a %U %F' /var/lib/gpufleet {RECORD} && stat -c %y {RECORD} && "
                    f"sha256sum {RECORD}").stdout


def test_gpufleet_deploy_accepts_the_new_hosts_and_drains_the_walled_off_one(trio):
    hosts, inv = trio
    h0, h1, h2 = hosts
    run = FIRST["run"]
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-6000:]   # all.py converged all three; one failed its acceptance
    assert "converged, NOT ACCEPTED yet: gpufleet-deploy runs their acceptance now" in out   # all.py's run end
    assert (f"[WARN] acceptance of {h0.name}, {h1.name}, {h2.name}: no known-good peer (no host of the inventory is "
            f"accepted): the new hosts pair with {h0.name}") in out
    for h in (h0, h1):
        found = rf.sh(h, f"stat -c '%a %U %F' /var/lib/gpufleet {RECORD}").stdout.split("\n")
        assert found[:2] == ["700 root directory", "600 root regular file"], found
        doc = record(h)
        assert doc["format"] == 1 and doc["host"] == h.name and doc["driver"] == rf.loaded(h) == rf.OLD
        stack = rf.sh(h, "cat /var/lib/gpufleet/installed/stack 2>/dev/null || true").stdout
        assert doc["cuda"] == dict(line.split() for line in stack.splitlines() if line.startswith("cuda-toolkit-"))
        assert doc["gpufleet"] and doc["accepted_at"].endswith("Z")
    findings = {f["name"]: f for f in record(h1)["findings"]}
    ran = findings["multi-node all-reduce with a known-good peer"]
    assert ran["status"] == "pass" and f"with {h0.name} (first of the group" in ran["message"], ran
    assert "gloo" in ran["message"] and record(h1)["peer"] == h0.name and record(h0)["peer"] == ""
    # the walled-off host: named with the measurement and the fix, no record
    assert re.search(rf"{h2.name}: FAILED acceptance, no Slurm node to drain; not accepted \(no record: the gate "
                     rf"WARNs\): multi-node all-reduce with a known-good peer: with {h0.name}.*Fix: .*firewall", out), out
    assert f"1 host(s) FAILED acceptance, not accepted (a Slurm node drained): {h2.name} (each named" in out
    assert rf.sh(h2, f"test -e {RECORD}", check=False).returncode == 1

    # a second gpufleet-deploy of the accepted hosts accepts no host again: the records untouched
    before = {h.name: record_stat(h) for h in (h0, h1)}
    started = time.monotonic()
    again = tool(hosts, inv, str(DEPLOY), str(inv), "-y", "--exclude", h2.name)
    print(f"gpufleet-deploy again: {time.monotonic() - started:.1f} s")
    assert again.returncode == 0, again.stdout[-6000:] + again.stderr[-3000:]
    assert {h.name: record_stat(h) for h in (h0, h1)} == before


def test_rollout_accepts_the_batch_with_a_known_good_peer_and_keeps_the_walled_off_host_drained(trio):
    hosts, inv = trio
    h0, h1, h2 = hosts
    def rollout() -> subprocess.CompletedProcess:
        return tool(hosts, inv, str(REPO / "tools/rollout"), "-y", str(inv), "--driver-version", rf.NEW, "--canary",
                    "1", "--batch-size", "2", "--max-fail", "1", "--heartbeat", "0", "--json")

    started = time.monotonic()
    run = rollout()
    print(f"rollout: {time.monotonic() - started:.1f} s")
    doc = json.loads(run.stdout)
    progress = run.stderr
    assert f"[canary] acceptance of {h0.name} with no known-good peer yet" in progress
    assert f"[batch 1] acceptance of {h1.name}, {h2.name} with known-good peer {h0.name}" in progress
    # the canary: no known-good peer yet, said, not failed
    assert (f"[canary] {h0.name}: [WARN] acceptance: multi-node all-reduce with a known-good peer: no known-good "
            "peer to run it with") in progress
    assert re.search(rf"\[batch 1\] {h1.name}: accept ok \([0-9.]+s\) accepted: all-reduce with {h0.name}, 2 ranks, "
                     "gloo", progress), progress
    assert f"[batch 1] {h2.name}: accept FAILED" in progress

    steps = {n: h["steps"] for n, h in doc["hosts"].items()}   # the JSON's keys are sorted
    assert steps[h1.name]["accept"]["ok"] and steps[h1.name]["undrain"]["ok"]
    assert doc["hosts"][h1.name]["status"] == "done"
    # the walled-off host: failed at the acceptance, never given back
    assert doc["hosts"][h2.name]["status"] == "failed" and steps[h2.name]["accept"]["ok"] is False
    assert "undrain" not in steps[h2.name]
    assert doc["hosts"][h2.name]["message"].startswith("accept failed: acceptance: multi-node all-reduce")
    assert "firewall" in doc["hosts"][h2.name]["message"]

    accepted = {f["name"]: f for f in doc["hosts"][h1.name]["acceptance"]["findings"]}
    ran = accepted["multi-node all-reduce with a known-good peer"]
    assert ran["status"] == "pass" and f"with {h0.name}, 2 ranks, gloo" in ran["message"]
    assert "GPUs simulated: gloo on CPU" in ran["message"] and "sum 3 as expected" in ran["message"]
    assert accepted["multi-node all-reduce bus bandwidth (nccl_profile roce)"]["status"] == "skip"
    refused = {f["name"]: f for f in doc["hosts"][h2.name]["acceptance"]["findings"]}
    assert refused["multi-node all-reduce with a known-good peer"]["status"] == "fail"
    assert doc["exit"] != 0 and run.returncode == doc["exit"]
    # the drivers moved on the accepted hosts as on the refused one: the acceptance judged, it did not undo
    for h in hosts:
        assert rf.loaded(h) == rf.NEW
    # the rollout's passed acceptance is recorded, for the new driver; the refused host has none
    assert record(h0)["driver"] == record(h1)["driver"] == rf.NEW
    assert record(h1)["peer"] == h0.name and record(h0)["peer"] == ""
    assert rf.sh(h2, f"test -e {RECORD}", check=False).returncode == 1


def test_burn_in_fails_a_port_counting_symbol_errors_naming_it(trio):
    hosts, inv = trio
    h0, h1, _ = hosts
    counters = {"symbol_error": 0, "link_downed": 0, "link_error_recovery": 0, "port_rcv_errors": 0}
    script = [f"mkdir -p {PORT}/counters", f"echo '4: ACTIVE' > {PORT}/state", f"echo '5: LinkUp' > {PORT}/phys_state"]
    script += [f"echo {v} > {PORT}/counters/{k}" for k, v in counters.items()]
    rf.sh(h1, " && ".join(script))
    env = {"GPUFLEET_TEST_SYSFS_ROOT": FAKE_SYS}

    clean = tool(hosts, inv, str(REPO / "tools/health"), str(inv), "--limit", h1.name, "--burn-in", "--diag", "0",
                 "--peer", h0.name, "--json", env=env)
    doc = json.loads(clean.stdout)
    ports = {f["name"]: f for f in doc["hosts"][0]["findings"]}["InfiniBand/RoCE ports up, no errors during the acceptance"]
    assert ports["status"] == "pass" and "mlx5_0 port 1" in ports["message"], doc
    assert clean.returncode == 0, clean.stdout

    # the test double's flapping link: symbol errors counted while the acceptance runs
    rf.sh(h1, f"systemd-run --unit=gpufleet-test-ib-errors sh -c 'n=0; while :; do n=$((n+3)); "
              f"echo $n > {PORT}/counters/symbol_error; sleep 0.2; done'")
    try:
        bad = tool(hosts, inv, str(REPO / "tools/health"), str(inv), "--limit", h1.name, "--burn-in", "--diag", "0",
                   "--peer", h0.name, "--json", env=env)
    finally:
        rf.sh(h1, "systemctl stop gpufleet-test-ib-errors", check=False)
    assert bad.returncode == 1, bad.stdout
    host = json.loads(bad.stdout)["hosts"][0]
    assert host["host"] == h1.name and host["status"] == "fail"
    found = {f["name"]: f for f in host["findings"]}["InfiniBand/RoCE ports up, no errors during the acceptance"]
    assert found["status"] == "fail" and found["message"].startswith("mlx5_0 port 1: symbol_error "), found
    assert "cable" in found["fix"]
