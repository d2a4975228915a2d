"""End-to-end: the health watch as Slurm's own HealthCheckProgram (issue 45), on a real Slurm
cluster of test hosts (testing/slurm.py: Debian's slurm-wlm, slurmctld on one host, slurmd on a
node whose H200 is SIMULATED, testing/gpusim). deploys/health_watch.py alone sets the node's
HealthCheckProgram (interval 10 s; the controller's slurm.conf gets the same lines, as a site's
shared slurm.conf has them); the watch's own timer is set to an hour, so what drains the
node here is slurmd running the check. A GPU in hardware slowdown drains the node with the
finding as the reason; once the fault clears, the node is resumed; an admin's drain is kept.
"""
from __future__ import annotations

import json
import shlex
import time

import pytest

from testing import slurm, testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

ADMIN = "admin: fan swap, ticket 99"


def sh(host, cmd: str) -> str:
    r = testhosts.ssh(host, cmd, check=False)
    assert r.returncode == 0, f"{cmd}: {r.stdout}{r.stderr}"
    return r.stdout


def wait_state(ctl, node: str, ok, timeout: float = 90) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        state = slurm.node_state(ctl, node)
        if ok(state):
            return state
        assert time.monotonic() < deadline, f"{node}: {state} after {timeout} s"
        time.sleep(2)


def after_runs(node, count: int = 2, timeout: float = 90) -> None:
    """Wait until the node's health check has run `count` times from now: each run writes the
    time it ran into the watch's state.json (slurmd runs it every HealthCheckInterval)."""
    def ran() -> float:
        return json.loads(sh(node, "cat /var/lib/gpufleet-health/state.json"))["time"]
    seen, deadline = [ran()], time.monotonic() + timeout
    while len(seen) <= count:
        assert time.monotonic() < deadline, f"{node.name}: {len(seen) - 1} health check(s) in {timeout} s"
        time.sleep(1)
        if (now := ran()) != seen[-1]:
            seen.append(now)


@pytest.fixture(scope="module")
def cluster(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    ctl = hostpool.get("health-slurm-ctl", 1, release="bookworm")[0]  # its own: test_rollout_slurm reconfigures "slurm-ctl"
    (node,) = hostpool.get("health-slurm", 1, release="bookworm", gpu=f"h200x1@{TEST_DRIVER}")
    slurm.setup(ctl, [node])
    tmp = tmp_path_factory.mktemp("health-slurm")
    data = {node.name: {**environment_data(node, "research", aptrepo), "tier_mismatch": "warn",
                        "health_watch": True, "health_interval": 3600, "health_slurm_check": True,
                        "health_slurm_interval": 10, "health_action": "drain-only"}}
    inv = write_inventory(tmp / "inventory.py", [node], data=data)
    runs = {"first": pyinfra(inv, "deploys/health_watch.py"), "again": pyinfra(inv, "deploys/health_watch.py")}
    for label, run in runs.items():
        (tmp / f"{label}.log").write_text(run.output)
    # slurmctld asks the nodes for their health check every HealthCheckInterval: a site's slurm.conf
    # is one file for the whole cluster, so the controller gets the node's lines, as docs/health.md says
    lines = sh(node, "grep -E '^HealthCheck' /etc/slurm/slurm.conf")
    sh(ctl, f"printf '%s' {shlex.quote(lines)} >> /etc/slurm/slurm.conf && systemctl restart slurmctld")
    slurm.wait_idle(ctl, 1)
    yield ctl, node, runs
    sh(node, "gpusimctl fault --clear")


def test_the_deploy_sets_slurms_health_check_and_a_second_run_changes_nothing(cluster):
    _, node, runs = cluster
    assert runs["first"].returncode == 0, runs["first"].output[-5000:]
    assert changed_operations(runs["again"]) == [], runs["again"].output[-5000:]
    conf = sh(node, "grep -E '^HealthCheck' /etc/slurm/slurm.conf").splitlines()
    assert conf == ["HealthCheckProgram=/usr/local/sbin/gpufleet-health-watch", "HealthCheckInterval=10",
                    "HealthCheckNodeState=ANY"]


def test_slurms_health_check_drains_the_node_with_the_finding_and_resumes_it_when_the_fault_clears(cluster):
    ctl, node, _ = cluster
    assert wait_state(ctl, node.name, lambda s: s[0] == "idle") == ("idle", "")
    sh(node, "gpusimctl fault --gpu 0 hw-slowdown")
    state, reason = wait_state(ctl, node.name, lambda s: s[0].startswith("drain"))
    assert reason.startswith("gpufleet health: drain: GPU 0 (") and "hardware slowdown" in reason, reason
    journal = [json.loads(line) for line in sh(node, "cat /var/lib/gpufleet-health/journal.jsonl").splitlines()]
    assert [e for e in journal if e["action"] == "drain" and e["check"] == "hw_slowdown"], journal
    sh(node, "gpusimctl fault --clear")
    assert wait_state(ctl, node.name, lambda s: s[0] == "idle") == ("idle", "")
    assert [e for e in (json.loads(line) for line in sh(node, "cat /var/lib/gpufleet-health/journal.jsonl")
                        .splitlines()) if e["action"] == "resume"]


def test_an_admins_drain_is_never_overridden_nor_resumed(cluster):
    ctl, node, _ = cluster
    sh(ctl, f"scontrol update NodeName={node.name} State=DRAIN Reason='{ADMIN}'")
    try:
        sh(node, "gpusimctl fault --gpu 0 hw-slowdown")
        after_runs(node)   # two health checks, each seeing the fault
        assert slurm.node_state(ctl, node.name)[1] == ADMIN
        journal = [json.loads(line) for line in sh(node, "cat /var/lib/gpufleet-health/journal.jsonl").splitlines()]
        assert [e for e in journal if e["action"] == "kept" and "admin" in e["reason"]], journal[-5:]
        sh(node, "gpusimctl fault --clear")
        after_runs(node)   # two healthy checks: the admin's drain is not theirs to resume
        state, reason = slurm.node_state(ctl, node.name)
        assert state.startswith("drain") and reason == ADMIN
    finally:
        sh(node, "gpusimctl fault --clear")
        sh(ctl, f"scontrol update NodeName={node.name} State=RESUME")
