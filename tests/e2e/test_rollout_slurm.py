"""End-to-end: tools/rollout with real Slurm (Debian's slurmctld on one test host, slurmd on two
GPU hosts, munge; testing/slurm.py).

- a GPU job running on a node delays that node's upgrade until the job has ended (it is not
  refused as busy): the drain waits for DRAINED, the packages change after the job's last
  second, and the node is resumed after;
- a node an admin drained before the rollout is upgraded (it is out of service) but stays
  drained, with the admin's reason, after it;
- the inventory host maps to its Slurm node name (rollout_slurm_node_name), which differs from
  the host name for one node;
- that node is rebooted by Slurm (rollout_slurm_reboot: slurm: `scontrol reboot ASAP
  nextstate=DOWN`, a real reboot of the test host), stays DOWN until gpufleet's validation has
  passed, and then gets back in service; every node carries the feature gpufleet_driver_<driver>.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from testing import slurm
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from tests.e2e import rollout_fleet as rf

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ADMIN_REASON = "admin: bad DIMM, ticket 4711"


@pytest.fixture(scope="module")
def cluster(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    ctl = hostpool.get("slurm-ctl", 1, release="bookworm")[0]
    nodes = hostpool.get("rollout-slurm", 2, release="bookworm", gpu=rf.GPU)
    names = {nodes[0].name: f"gpu-{nodes[0].name.rsplit('-', 1)[-1]}", nodes[1].name: nodes[1].name}
    # Slurm first: preparing the driver refreshes only the NVIDIA source's index
    slurm.setup(ctl, nodes, names={nodes[0].name: names[nodes[0].name]})
    rf.prepare_all(nodes, aptrepo)
    slurm.wait_idle(ctl, len(nodes))
    work = tmp_path_factory.mktemp("slurm")
    rf.inventory(work / "slurm.py", nodes, aptrepo,
                 extra={nodes[0].name: {"rollout_slurm_node_name": names[nodes[0].name],
                                        "rollout_slurm_reboot": "slurm"}})
    return ctl, nodes, names, work


def first_change(host) -> float:
    line = rf.sh(host, f"grep -m1 ' upgrade nvidia-.* {rf.OLD_DEB} {rf.NEW_DEB}' /var/log/dpkg.log").stdout
    return datetime.strptime(line[:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def ctl_log_time(ctl, pattern: str) -> float:
    """The time of the last slurmctld.log line matching `pattern` (grep -E)."""
    line = rf.sh(ctl, f"grep -E {shlex.quote(pattern)} /var/log/slurm/slurmctld.log | tail -1").stdout
    assert line.startswith("["), f"slurmctld.log has no line matching {pattern!r}"
    return datetime.strptime(line[1:20], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()


def features(ctl, node: str) -> set[str]:
    out = rf.sh(ctl, f"scontrol show node -o {shlex.quote(node)}").stdout
    found = dict(w.split("=", 1) for w in out.split() if w.startswith(("AvailableFeatures=", "ActiveFeatures=")))
    assert found["AvailableFeatures"] == found["ActiveFeatures"], found
    return set(found["AvailableFeatures"].split(",")) - {"(null)"}


def test_running_job_delays_upgrade_admin_drain_is_kept(cluster):
    ctl, (busy, admin), names, work = cluster
    boot_id = rf.sh(busy, "cat /proc/sys/kernel/random/boot_id").stdout.strip()
    # a feature of the site's own: the driver label is added next to it, not instead
    rf.sh(ctl, f"scontrol update nodename={names[busy.name]} availablefeatures=site_a activefeatures=site_a")
    rf.sh(ctl, f"scontrol update nodename={names[admin.name]} state=drain reason='{ADMIN_REASON}'")
    # a GPU job: the simulator lists it on the node's GPU while it runs
    job = rf.sh(ctl, f"cd /root && sbatch --parsable -w {names[busy.name]} --wrap '"
                     "gpusimctl add-process --gpu 0 --pid $$ --name train.py --used-mib 1000; sleep 25; "
                     "gpusimctl remove-process --pid $$; date +%s.%N > /root/job-ended'").stdout.strip()
    deadline = time.monotonic() + 180
    while rf.sh(ctl, f"squeue -h -j {job} -o %T").stdout.strip() != "RUNNING":
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.5)
    started = time.time()
    assert "train.py" in rf.sh(busy, "nvidia-smi --query-compute-apps=pid,process_name --format=csv,noheader").stdout

    r = subprocess.run([str(REPO / "tools/rollout"), "slurm.py", "--driver-version", rf.NEW, "-y", "--canary", "1",
                        "--batch-size", "1"], cwd=work, capture_output=True, text=True, timeout=1800)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    st = json.loads((work / ".gpufleet/rollouts/slurm.json").read_text())["hosts"]
    for h in (busy, admin):
        assert st[h.name]["status"] == "done", h.name
        assert rf.version(h, "nvidia-open") == f"ii {rf.NEW_DEB}" and rf.loaded(h) == rf.NEW
        assert rf.holds(h) == set(rf.HELD)

    # the job ran to its end on the node, and the packages changed only after it
    ended = float(rf.sh(busy, "cat /root/job-ended").stdout)
    assert ended - started >= 20, "the job was cut short"
    assert first_change(busy) >= int(ended), (first_change(busy), ended)
    assert st[busy.name]["steps"]["drain"]["seconds"] >= 15          # the drain step waited for the job
    print(f"job ended {ended:.1f}, first package change {first_change(busy):.0f}, "
          f"drain step {st[busy.name]['steps']['drain']['seconds']} s")
    # resumed by gpufleet after the upgrade (under its Slurm name), in service again
    assert slurm.settled_state(ctl, names[busy.name]) == ("idle", "")
    # the admin's drain and reason survive the rollout
    assert slurm.settled_state(ctl, names[admin.name]) == ("drained", ADMIN_REASON)

    # Slurm rebooted the busy node (the test host really rebooted), and only gpufleet resumed it,
    # after its validation: slurmctld saw it register (DOWN) before validate started and set it
    # IDLE only after validate had passed (log times in whole seconds)
    node = names[busy.name]
    assert rf.sh(busy, "cat /proc/sys/kernel/random/boot_id").stdout.strip() != boot_id
    steps = st[busy.name]["steps"]
    queued = ctl_log_time(ctl, f"reboot request queued for nodes {node}$")
    registered = ctl_log_time(ctl, f"node {node} returned to service")
    resumed = ctl_log_time(ctl, f"update_node: node {node} state set to IDLE")
    print(f"reboot queued {queued:.0f}, registered {registered:.0f}, validate {steps['validate']['started']:.1f}"
          f"-{steps['validate']['finished']:.1f}, resumed {resumed:.0f}")
    assert steps["reboot"]["started"] - 1 <= queued <= registered <= steps["validate"]["started"] + 1
    assert resumed >= int(steps["validate"]["finished"]), "the node was resumed before gpufleet validated it"
    # each node is labelled with its driver; the site's own feature stays
    assert features(ctl, node) == {"site_a", f"gpufleet_driver_{rf.NEW}"}
    assert features(ctl, names[admin.name]) == {f"gpufleet_driver_{rf.NEW}"}
    # a job can ask for it (dots and all)
    job = rf.sh(ctl, f"cd /root && sbatch --parsable --constraint=gpufleet_driver_{rf.NEW} --wrap true").stdout.strip()
    assert rf.sh(ctl, f"scontrol show job {job}").stdout.count(f"Features=gpufleet_driver_{rf.NEW}") == 1
    rf.sh(ctl, f"scancel {job}")


def test_unknown_slurm_node_name_stops_the_host_before_any_change(cluster, aptrepo):  # noqa: F811
    ctl, (busy, admin), names, work = cluster
    rf.inventory(work / "wrongname.py", [busy], aptrepo,
                 extra={busy.name: {"rollout_slurm_node_name": "no-such-node"}})
    apt_before = rf.sh(busy, "grep -c Start-Date /var/log/apt/history.log").stdout
    r = subprocess.run([str(REPO / "tools/rollout"), "wrongname.py", "--driver-version", rf.OLD, "-y"],
                       cwd=work, capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr)
    assert r.returncode != 0
    assert "Slurm node no-such-node: node no-such-node is not in the Slurm cluster" in r.stdout
    assert rf.sh(busy, "grep -c Start-Date /var/log/apt/history.log").stdout == apt_before
    assert rf.version(busy, "nvidia-open") == f"ii {rf.NEW_DEB}"
    assert slurm.settled_state(ctl, names[busy.name]) == ("idle", "")



def test_health_drains_a_sick_node_with_its_finding_and_resumes_only_its_own(cluster):
    """tools/health --slurm (issue 29): a GPU in hardware slowdown (the simulator's fault) drains
    its node with the finding as the reason; once the fault is gone and the check passes, that
    node is resumed; the node an admin drained stays drained with the admin's reason."""
    ctl, (busy, admin), names, work = cluster
    node = names[busy.name]
    assert slurm.settled_state(ctl, node) == ("idle", "")
    rf.sh(busy, "sudo gpusimctl fault --gpu 0 hw-slowdown")
    try:
        sick = subprocess.run([str(REPO / "tools/health"), "slurm.py", "--slurm", "--quiet"], cwd=work,
                              capture_output=True, text=True, timeout=600)
        print(sick.stdout, sick.stderr)
        assert sick.returncode == 1
        state, reason = slurm.node_state(ctl, node)
        assert state.startswith("drain"), state
        assert reason.startswith("gpufleet health: drain: GPU 0 (") and "hardware slowdown" in reason, reason
        assert slurm.node_state(ctl, names[admin.name])[1] == ADMIN_REASON
    finally:
        rf.sh(busy, "sudo gpusimctl fault --clear")
    well = subprocess.run([str(REPO / "tools/health"), "slurm.py", "--slurm", "--quiet"], cwd=work,
                          capture_output=True, text=True, timeout=600)
    print(well.stdout, well.stderr)
    assert f"{node} resumed" in well.stdout
    assert slurm.settled_state(ctl, node) == ("idle", "")
    assert slurm.node_state(ctl, names[admin.name])[1] == ADMIN_REASON   # not gpufleet health's drain: kept
    # the admin's node is healthy but was not drained by gpufleet health: exit 0 all the same
    assert well.returncode == 0, well.stdout


def test_a_mig_layout_change_is_drained_applied_and_validated(cluster, aptrepo):  # noqa: F811
    """Issue 32: a host whose planned MIG layout differs from its GPUs' is one tools/rollout
    drains (Slurm drain, reason "gpufleet MIG change (gpu_mig)"), changes through the per-GPU gate
    (step mig), validates (the layout read back) and resumes, with no driver change and no reboot;
    its clocks, not settable in MIG mode, are neither restored nor compared; a re-run has nothing to do."""
    ctl, (busy, admin), names, work = cluster
    node = names[busy.name]
    t0 = time.monotonic()
    assert slurm.settled_state(ctl, node) == ("idle", "")
    driver, boot_id = rf.loaded(busy), rf.sh(busy, "cat /proc/sys/kernel/random/boot_id").stdout.strip()
    layout = ["3g.20gb", "3g.20gb"]   # the A100-SXM4-40GB's (compat.yaml: derived from NVIDIA's MIG user guide)
    rf.inventory(work / "mig.py", [busy, admin], aptrepo,
                 extra={busy.name: {"rollout_slurm_node_name": node, "gpu_mig": {"all": layout}}})
    updates = len(rf.slurm_updates(ctl, node))
    # the driver each host has loaded: the only change left is the MIG layout
    r = subprocess.run([str(REPO / "tools/rollout"), "mig.py", "--driver-version", driver, "-y"],
                       cwd=work, capture_output=True, text=True, timeout=1200)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MIG: GPU 0 NVIDIA A100-SXM4-40GB" in r.stdout and "MIG off -> 3g.20gb + 3g.20gb" in r.stdout, r.stdout
    assert "the inventory does not say" not in r.stdout   # the driver did not move: no inventory advice
    st = json.loads((work / ".gpufleet/rollouts/mig.json").read_text())["hosts"]
    assert st[busy.name]["status"] == "done" and st[busy.name]["steps"]["mig"]["ok"], st[busy.name]
    assert admin.name not in st   # at its driver, no MIG change: not in the rollout
    lgi = rf.sh(busy, "nvidia-smi mig -lgi").stdout
    assert [line.split()[3] for line in lgi.splitlines() if " MIG " in line] == ["3g.20gb"] * 4, lgi
    modes = rf.sh(busy, "nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader").stdout.split()
    assert modes == ["Enabled", "Enabled"]
    assert rf.sh(busy, "systemctl is-enabled gpufleet-gpu-mig.service").stdout.strip() == "enabled"
    # drained by gpufleet for the MIG change, resumed after; no driver change, no reboot
    texts = [text for _, text in rf.slurm_updates(ctl, node)[updates:]]
    assert any("reason set to: gpufleet MIG change (gpu_mig)" in t for t in texts), texts
    assert slurm.settled_state(ctl, node) == ("idle", "")
    assert rf.loaded(busy) == driver and rf.sh(busy, "cat /proc/sys/kernel/random/boot_id").stdout.strip() == boot_id
    # nothing left: a re-run leaves the host alone
    again = subprocess.run([str(REPO / "tools/rollout"), "mig.py", "--driver-version", driver, "-y"],
                           cwd=work, capture_output=True, text=True, timeout=900)
    print(again.stdout, again.stderr)
    assert again.returncode == 0 and "MIG:" not in again.stdout, again.stdout
    t1 = time.monotonic()
    # and back: gpu_mig none is a change the rollout drains for too (the done host starts a new round)
    rf.inventory(work / "mig.py", [busy, admin], aptrepo,
                 extra={busy.name: {"rollout_slurm_node_name": node, "gpu_mig": "none"}})
    off = subprocess.run([str(REPO / "tools/rollout"), "mig.py", "--driver-version", driver, "-y"],
                         cwd=work, capture_output=True, text=True, timeout=1200)
    print(off.stdout, off.stderr)
    assert off.returncode == 0 and "3g.20gb + 3g.20gb -> MIG off" in off.stdout, off.stdout + off.stderr
    modes = rf.sh(busy, "nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader").stdout.split()
    assert modes == ["Disabled", "Disabled"]
    assert rf.sh(busy, "systemctl is-enabled gpufleet-gpu-mig.service", check=False).stdout.strip() != "enabled"
    assert slurm.settled_state(ctl, node) == ("idle", "")
    print(f"[timing] MIG rollout + re-run {t1 - t0:.1f} s; back to none {time.monotonic() - t1:.1f} s")
