"""End-to-end: the node's own health watch (issue 45) on a real test host whose two H200s are
SIMULATED (testing/gpusim, a test double: `gpusimctl fault` makes its nvidia-smi, dmesg and pynvml
stand-ins print what a real GPU in that state prints; an XID is stamped with the kernel clock of
its injection). all.py installs the watch (health_interval 10 s: the test inventory's short
interval) and a second run changes nothing; then no controller command runs: faults are
injected on the host and the node's own timer finds them, records them in its journal, acts
(health_action remediate: an idle GPU is reset, a busy one is not) and serves its metrics through
the node exporter, asked from outside the host.
"""
from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import REPO, changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

INTERVAL = 10
WATCH = "/var/lib/gpufleet-health"


def sh(host, cmd: str) -> str:
    r = testhosts.ssh(host, cmd, check=False)
    assert r.returncode == 0, f"{cmd}: {r.stdout}{r.stderr}"
    return r.stdout


def journal(host) -> list[dict]:
    return [json.loads(line) for line in sh(host, f"cat {WATCH}/journal.jsonl 2>/dev/null || true").splitlines()
            if line.startswith("{")]


def wait_for(host, what, timeout: float = 4 * INTERVAL) -> tuple[dict, float]:
    """The first journal event matching `what`, and when it was seen (seconds from the call)."""
    start = time.monotonic()
    while True:
        found = [e for e in journal(host) if what(e)]
        if found:
            return found[0], time.monotonic() - start
        assert time.monotonic() - start < timeout, f"no such event after {timeout} s: {journal(host)[-8:]}"
        time.sleep(1)


def scrape(host) -> str:
    url = f"http://{host.address}:9100/metrics"
    with urllib.request.urlopen(url, timeout=20) as answer:  # noqa: S310 - a test host's loopback address
        return answer.read().decode()


@pytest.fixture(scope="module")
def watched(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    (host,) = hostpool.get("health-watch", 1, release="trixie", gpu=f"h200x2@{TEST_DRIVER}")
    tmp = tmp_path_factory.mktemp("health-watch")
    data = {host.name: {**environment_data(host, "hgx", aptrepo), "tier_mismatch": "warn",
                        "tuning_nccl_socket_ifname": "auto", "health_watch": True, "health_interval": INTERVAL,
                        "health_action": "remediate"}}
    inv = write_inventory(tmp / "inventory.py", [host], data=data)
    runs = {"first": pyinfra(inv), "again": pyinfra(inv)}
    for label, run in runs.items():
        (tmp / f"{label}.log").write_text(run.output)
    yield host, inv, runs
    sh(host, "gpusimctl fault --clear; gpusimctl remove-process --pid 4242 || true")


def test_all_py_installs_the_watch_root_only_and_a_second_run_changes_nothing(watched):
    host, _, runs = watched
    assert runs["first"].returncode == 0, runs["first"].output[-5000:]
    assert changed_operations(runs["again"]) == [], runs["again"].output[-5000:]
    assert sh(host, "systemctl is-enabled gpufleet-health-watch.timer; systemctl is-active gpufleet-health-watch.timer"
              ).split() == ["enabled", "active"]
    sh(host, f"test -e {WATCH}/state.json || sleep {2 * INTERVAL}")   # the timer's first run
    modes = sh(host, f"stat -c '%n %U %a' {WATCH} {WATCH}/config.json {WATCH}/state.json").splitlines()
    assert modes == [f"{WATCH} root 700", f"{WATCH}/config.json root 600", f"{WATCH}/state.json root 600"]


def test_a_fault_is_found_by_the_nodes_own_run_within_one_interval_and_served_as_a_metric(watched):
    host, _, _ = watched
    sh(host, "gpusimctl fault --gpu 1 hw-slowdown")
    event, took = wait_for(host, lambda e: e["check"] == "hw_slowdown" and e["action"] == "seen")
    # one interval, plus the run itself on a loaded machine
    assert took < 2 * INTERVAL + 10, took
    assert (event["gpu"], event["bus_id"], event["class"]) == (1, "00000000:00:07.0", "drain")
    assert sh(host, f"stat -c '%U %a' {WATCH}/journal.jsonl").split() == ["root", "600"]
    metrics = scrape(host)   # the node exporter sorts the labels
    assert ('gpufleet_gpu_health_class{bus_id="00000000:00:07.0",class="drain",finding="hw_slowdown",gpu="1"} 4'
            in metrics), [line for line in metrics.splitlines() if "gpufleet" in line]
    assert "gpufleet_health_last_run_timestamp_seconds " in metrics
    sh(host, "gpusimctl fault --clear --gpu 1")
    wait_for(host, lambda e: e["check"] == "hw_slowdown" and e["action"] == "cleared")
    deadline = time.monotonic() + 3 * INTERVAL
    while 'gpufleet_gpu_health_class{bus_id="00000000:00:07.0",class="ok",finding="",gpu="1"} 0' not in scrape(host):
        assert time.monotonic() < deadline, scrape(host)
        time.sleep(1)


def test_a_reset_is_refused_while_a_process_holds_that_gpu_and_done_once_it_is_idle(watched):
    host, _, _ = watched
    sh(host, "gpusimctl add-process --gpu 1 --pid 4242 --name python3 --used-mib 2048")
    sh(host, "gpusimctl fault --gpu 1 xid:48")
    busy, _ = wait_for(host, lambda e: e["gpu"] == 1 and e["check"] == "xid_48" and e["action"] == "busy")
    assert "in use" in busy["reason"] and "python3" in busy["reason"]
    assert not [e for e in journal(host) if e["gpu"] == 1 and e["action"] == "reset"]
    sh(host, "gpusimctl remove-process --pid 4242")
    done, _ = wait_for(host, lambda e: e["gpu"] == 1 and e["action"] == "reset")
    assert done["check"] == "xid_48"


def health(inv, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / "tools/health"), str(inv), "--quiet", *args], capture_output=True, text=True,
                          timeout=300)


def test_an_xid_reset_leaves_the_gpu_ok_and_the_third_escalates_as_the_tier_says(watched):
    host, inv, _ = watched
    resets = lambda: [e for e in journal(host) if e["gpu"] == 0 and e["action"] == "reset"]  # noqa: E731
    for n in (1, 2):
        sh(host, "gpusimctl fault --gpu 0 xid:48")
        wait_for(host, lambda e, n=n: len(resets()) >= n)
        # read from the controller too: the XID logged before the reset is not held against the GPU
        run = health(inv, "--json")
        (found,) = json.loads(run.stdout)["hosts"]
        assert [f["check"] for g in found["gpus"] if g["index"] == 0 for f in g["findings"]] == [], found
    sh(host, "gpusimctl fault --gpu 0 xid:48")
    third, _ = wait_for(host, lambda e: e["gpu"] == 0 and e["action"] == "seen" and e["class"] == "drain")
    assert "the 3rd reset of this GPU within 86400 s" in third["detail"] and "escalated to drain" in third["detail"]
    time.sleep(INTERVAL + 5)
    assert len(resets()) == 2, "the third was not reset: it escalated"
    history = health(inv, "--history", host.name)
    assert history.returncode == 0, history.stderr
    assert "reset" in history.stdout and "escalated to drain" in history.stdout and "hw_slowdown" in history.stdout
    sh(host, "gpusimctl fault --clear --gpu 0")


def test_a_flapping_infiniband_port_is_found_by_the_nodes_watch_naming_it(watched):
    """Issue 46 item 3: the fabric feeds the health classes. The host has no HCA: a sysfs-shaped
    tree stands in for /sys/class/infiniband (TEST DOUBLE, given to the watch's own command as
    root through GPUFLEET_TEST_SYSFS_ROOT; the timer is stopped meanwhile, it reads the real /sys)."""
    host, _, _ = watched
    fake = "/run/gpufleet-test-sys"
    port = f"{fake}/class/infiniband/mlx5_0/ports/1"

    def put(state: str, phys: str, downed: int, symbols: int) -> None:
        sh(host, f"mkdir -p {port}/counters && echo '{state}' > {port}/state && echo '{phys}' > {port}/phys_state && "
                 f"echo {downed} > {port}/counters/link_downed && echo {symbols} > {port}/counters/symbol_error")

    def watch() -> None:
        testhosts.ssh(host, f"GPUFLEET_TEST_SYSFS_ROOT={fake} /usr/local/sbin/gpufleet-health-watch --timer", check=False)

    sh(host, "systemctl stop gpufleet-health-watch.timer")
    try:
        put("4: ACTIVE", "5: LinkUp", 2, 5)     # counted before the watch saw it: history
        watch()
        assert not [e for e in journal(host) if e["check"].startswith("ib_")]
        put("4: ACTIVE", "5: LinkUp", 2, 40)
        watch()
        put("1: DOWN", "3: Disabled", 3, 40)
        watch()
        ib = {e["check"]: e for e in journal(host) if e["check"].startswith("ib_") and e["action"] == "seen"}
        assert ib["ib_link_errors:mlx5_0/1"]["class"] == "monitor"
        assert "mlx5_0 port 1: symbol_error 5 -> 40" in ib["ib_link_errors:mlx5_0/1"]["detail"]
        assert ib["ib_link_flapped:mlx5_0/1"]["class"] == "drain"
        assert "link_downed 2 -> 3" in ib["ib_link_flapped:mlx5_0/1"]["detail"]
        assert ib["ib_port_down:mlx5_0/1"]["class"] == "drain" and "DOWN/Disabled" in ib["ib_port_down:mlx5_0/1"]["detail"]
        assert 'finding="ib_port_down:mlx5_0/1"' in scrape(host)
    finally:
        sh(host, f"rm -rf {fake} {WATCH}/state.json; systemctl start gpufleet-health-watch.timer")
