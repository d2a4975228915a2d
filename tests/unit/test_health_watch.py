"""The health watch's rules (gpufleet/plans/health_watch.py, issue 45): XIDs judged since a GPU's
last reset, escalation of repeats, what each health_action does, no false alarm on the recorded
healthy H200 and H100, on the kernel log lines recorded on the H200 (tests/fixtures/nvidia/
h200-x1/health/dmesg-xid.txt) with XID lines in the driver's format put between them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.config.settings import host_settings
from gpufleet.facts.health import GpuHealth, parse_resets, parse_xid_events, since_reset
from gpufleet.facts.slurm import SlurmNodeData
from gpufleet.plans import health_watch as w
from gpufleet.plans.health import assess

pytestmark = pytest.mark.unit

HERE = Path(__file__).parent
FIXTURES = HERE.parent / "fixtures/nvidia"
CASES = HERE / "facts/health.GpuHealth"
BOOT = "5c6f1a2e-0d1b-4c3e-9f8a-1b2c3d4e5f60"
NOW = 1_800_000_000.0


def recorded(path: Path) -> list[str]:
    """A recording's output lines: without its `$ command` line and its `[rc=N]` line."""
    return [line for line in path.read_text().splitlines() if not line.startswith(("$ ", "[rc="))]


def h200_kernel_log(*xids: tuple[float, str, int]) -> list[str]:
    """The recorded H200 kernel log, with XID lines (time, bus, code) in the driver's format."""
    lines = recorded(FIXTURES / "h200-x1/health/dmesg-xid.txt")
    for t, bus, code in xids:
        lines.append(f"[{t:12.6f}] NVRM: Xid (PCI:0000:{bus}): {code}, pid=4242, name=python3, Ch 00000008")
    return sorted(lines, key=lambda line: float(line[1:line.index("]")]))


def h200_output(kernel_log: list[str], watch: list[str] = ()) -> list[str]:
    """The recorded healthy H200's GpuHealth output, its xid section replaced, a watch section added."""
    out, skip = [], False
    for line in json.loads((CASES / "healthy_h200_with_nvml.json").read_text())["output"]:
        if line.startswith("::gpufleet:: begin"):
            skip = line.endswith(" xid")
            if skip:
                out += [line, *kernel_log, "::gpufleet:: kernel-log yes", "::gpufleet:: begin watch",
                        f"::gpufleet:: boot {BOOT}", *watch]
                continue
        if not skip:
            out.append(line)
    return out


def settings(**over):
    from pyinfra.api.inventory import Inventory

    inv = Inventory(([("gpu-a01", over)], {}), pod=(["gpu-a01"], {"tier": "hgx"}))
    return host_settings(inv.get_host("gpu-a01"))


def plan(**over) -> w.WatchPlan:
    base = dict(enabled=True, interval=300, action="remediate", escalate_count=3, escalate_window=86400,
                escalate_to="drain", slurm_check=False, slurm_interval=300, slurm_node_states=("any",),
                slurm_prolog=False, dcgm_watches=True, textfile_dir="/var/lib/prometheus/node-exporter",
                nvlink="any", slurm_node="")
    return w.WatchPlan(**{**base, **over})


def reset(bus_id: str, when: float) -> w.Event:
    return w.Event(when, BOOT, 0, bus_id, "xid_48", "reset", "reset", "the GPU was idle: reset (nvidia-smi -r)")


# --- the recorded healthy GPUs: nothing seen, nothing done ------------------------------------


def test_the_recorded_healthy_h200_and_h100_raise_no_alarm():
    h100 = GpuHealth().process(recorded(FIXTURES / "h100-x1/health/gpufleet-health-script.txt"))
    h200 = GpuHealth().process(h200_output(h200_kernel_log()))
    for data, model in ((h200, "NVIDIA H200"), (h100, "NVIDIA H100 80GB HBM3")):
        verdict = assess(data)
        assert [g.name for g in verdict.gpus] == [model] and data.kernel_log
        assert verdict.worst == "ok", [f for g in verdict.gpus for f in g.findings]
        needs = w.escalated(verdict, [], NOW, plan())
        assert needs == [] and w.plan_steps(needs, "remediate", None, held_by_run=False) == []
        text = w.metrics(verdict, needs, [], NOW, True)
        assert 'gpufleet_gpu_health_class{gpu="0",bus_id="00000000:00:06.0",finding="",class="ok"} 0' in text
        assert "gpufleet_health_worst_class 0" in text


# --- XIDs since the GPU's last reset ---------------------------------------------------------


def test_xid_lines_keep_the_kernels_timestamp_among_the_recorded_lines():
    log = h200_kernel_log((2.5, "00:06", 48), (4200.25, "00:06", 48))
    assert parse_xid_events(log) == [("00:06", 48, 2.5), ("00:06", 48, 4200.25)]


def test_an_xid_before_the_gpus_last_reset_is_not_held_against_it_one_after_is():
    events = parse_xid_events(h200_kernel_log((2.5, "00:06", 79), (900.0, "00:06", 48)))
    assert since_reset(events, {}) == [("00:06", 79), ("00:06", 48)]   # never reset: since boot
    assert since_reset(events, {"00:06": 100.0}) == [("00:06", 48)]
    assert since_reset(events, {"00:06": 1000.0}) == []
    assert since_reset(events, {"00:07": 1000.0}) == [("00:06", 79), ("00:06", 48)]   # another GPU's reset


def test_resets_of_another_boot_say_nothing_of_this_boots_xids():
    lines = [f"reset 00:06 {BOOT} 120.5", "reset 00:06 00000000-0000-0000-0000-000000000000 9999.0",
             f"reset 00:06 {BOOT} 80.0", "garbage", f"reset ../x {BOOT} 1"]
    assert parse_resets(lines, BOOT) == {"00:06": 120.5}


def test_the_fact_judges_xids_since_the_reset_the_watch_recorded():
    """The bug of facts/health.py:90,288 (issue 45): a GPU reset after an XID stayed 'reset' until a
    reboot, so tools/health --slurm never resumed the node."""
    log = h200_kernel_log((2.5, "00:06", 48))
    before = GpuHealth().process(h200_output(log))
    assert before.gpus[0].xids == (48,) and assess(before).worst == "reset"
    after = GpuHealth().process(h200_output(log, [f"reset 00:06 {BOOT} 10.0", f"event {NOW} reset reset"]))
    assert after.gpus[0].xids == () and assess(after).worst == "ok"
    assert after.last_event == (NOW, "reset", "reset")
    again = GpuHealth().process(h200_output(h200_kernel_log((2.5, "00:06", 48), (11.0, "00:06", 48)),
                                            [f"reset 00:06 {BOOT} 10.0"]))
    assert again.gpus[0].xids == (48,)


# --- escalation -------------------------------------------------------------------------------


def verdict_with_xid(code: int = 48):
    return assess(GpuHealth().process(h200_output(h200_kernel_log((2.5, "00:06", code)))))


def test_a_third_reset_of_one_gpu_within_the_window_escalates_to_drain():
    bus = "00000000:00:06.0"
    verdict = verdict_with_xid(48)
    first = w.escalated(verdict, [], NOW, plan())
    assert [(n.cls, n.check) for n in first] == [("reset", "xid_48")]
    second = w.escalated(verdict, [reset(bus, NOW - 3600)], NOW, plan())
    assert second[0].cls == "reset"
    third = w.escalated(verdict, [reset(bus, NOW - 7200), reset(bus, NOW - 3600)], NOW, plan())
    assert third[0].cls == "drain" and "the 3rd reset of this GPU within 86400 s" in third[0].detail
    assert w.plan_steps(third, "remediate", None, held_by_run=False)[0].why == "not a Slurm node: reported"


def test_resets_outside_the_window_or_of_another_gpu_do_not_count():
    verdict = verdict_with_xid(48)
    old = [reset("00000000:00:06.0", NOW - 90000), reset("00000000:00:06.0", NOW - 88000)]
    other = [reset("00000000:00:07.0", NOW - 60), reset("00000000:00:07.0", NOW - 30)]
    assert w.escalated(verdict, old + other, NOW, plan())[0].cls == "reset"


def test_the_tier_sets_the_count_and_the_class_a_repeat_becomes():
    verdict = verdict_with_xid(48)
    journal = [reset("00000000:00:06.0", NOW - 60)]
    assert w.escalated(verdict, journal, NOW, plan(escalate_count=2, escalate_to="rma"))[0].cls == "rma"
    assert w.escalated(verdict, journal, NOW, plan(escalate_count=4))[0].cls == "reset"


def test_a_row_remap_failure_is_rma_at_once():
    import dataclasses

    data = GpuHealth().process(h200_output(h200_kernel_log()))
    failed = dataclasses.replace(data, gpus=(dataclasses.replace(data.gpus[0], remap_failure=True),))
    needs = w.escalated(assess(failed), [], NOW, plan())
    assert ("rma", "row_remap_failure") in [(n.cls, n.check) for n in needs] and needs[0].cls == "rma"


def test_the_journal_reads_back_what_was_written_and_skips_a_torn_line():
    event = w.Event(NOW, BOOT, 1, "00000000:00:07.0", "xid_79", "reboot", "reboot", "gpufleet health: ...", "d")
    assert w.parse_journal([event.as_json(), '{"time": 1, "boo']) == [event]


# --- what each health_action does -------------------------------------------------------------


def slurm(state: str = "idle", reason: str = "") -> SlurmNodeData:
    return SlurmNodeData(scontrol="/usr/bin/scontrol", node="gpu1", state=state, reason=reason)


def needs_of(cls: str) -> list[w.Need]:
    gpu = verdict_with_xid(48).gpus[0]
    return [w.Need(gpu, "x", cls, "something")]


@pytest.mark.parametrize("mode, cls, node, steps", [
    ("report-only", "drain", slurm(), [w.Step("none", why="health_action report-only")]),
    ("drain-only", "drain", slurm(), [w.Step("drain")]),
    ("drain-only", "reset", slurm(), [w.Step("none", why="health_action drain-only: a reset or reboot is left to people")]),
    ("remediate", "reset", slurm(), [w.Step("reset", gpu=0)]),
    ("remediate", "reset", None, [w.Step("reset", gpu=0)]),
    ("remediate", "reboot", slurm(), [w.Step("reboot")]),
    ("remediate", "reboot", None, [w.Step("none", why="not a Slurm node: the reboot is reported, not made")]),
    ("remediate", "rma", slurm(), [w.Step("drain")]),
    # an admin's drain is never overridden, nor resumed
    ("remediate", "drain", slurm("drained", "disk swap, ticket 42"), [w.Step("none", why="drained by an admin: kept as it is")]),
    ("remediate", "reboot", slurm("drained", "disk swap"), [w.Step("none", why="drained by an admin: kept as it is")]),
    # drained by the watch already: nothing more
    ("drain-only", "drain", slurm("drained", "gpufleet health: drain: ..."), []),
])
def test_each_mode_acts_as_the_tier_says(mode, cls, node, steps):
    assert w.plan_steps(needs_of(cls), mode, node, held_by_run=False) == steps


def test_a_healthy_node_is_resumed_only_when_the_watch_drained_it():
    assert w.plan_steps([], "drain-only", slurm("drained", "gpufleet health: drain: x"), False) == [
        w.Step("resume", why="healthy again")]
    assert w.plan_steps([], "drain-only", slurm("drained", "gpufleet rollout: upgrading"), False) == []
    assert w.plan_steps([], "drain-only", slurm("drained", "admin"), False) == []
    assert w.plan_steps([], "report-only", slurm("drained", "gpufleet health: x"), False) == []


def test_nothing_acts_while_a_gpufleet_run_holds_the_host():
    steps = w.plan_steps(needs_of("drain"), "remediate", slurm(), held_by_run=True)
    assert [s.kind for s in steps] == ["none"] and "holds the host" in steps[0].why
    # nothing to do: nothing said either (a rollout's hour is not a journal's hundred lines)
    assert w.plan_steps([], "remediate", slurm("drained", "gpufleet health: x"), True) == []


def test_the_reset_script_checks_that_gpu_idle_right_before_the_reset():
    from gpufleet.operations.drain import GPU_WORK_ON

    script = w.reset_script(GPU_WORK_ON)
    assert script.index('what=$(gpu_work "$1")') < script.index("exit 75") < script.index('nvidia-smi -r -i "$1"')


# --- the tier's keys -------------------------------------------------------------------------


def test_the_plan_and_its_files_follow_the_tier():
    p = w.watch_plan(settings(health_watch=True, health_interval=15, health_slurm_check=True,
                              health_slurm_node_states=["idle", "cycle"], health_slurm_prolog=True))
    assert "OnUnitActiveSec=15\n" in w.timer_unit(p) and "OnActiveSec=15\n" in w.timer_unit(p)
    assert w.slurm_lines(p) == {"HealthCheckProgram": f"HealthCheckProgram={w.COMMAND}",
                                "HealthCheckInterval": "HealthCheckInterval=300",
                                "HealthCheckNodeState": "HealthCheckNodeState=IDLE,CYCLE",
                                "Prolog": f"Prolog={w.COMMAND}"}
    assert json.loads(p.node_config())["action"] == "drain-only"
    off = w.watch_plan(settings())
    assert not off.enabled and set(w.slurm_lines(off).values()) == {None}


@pytest.mark.parametrize("key, value, said", [
    ("health_action", "fix-it", "report-only | drain-only | remediate"),
    ("health_interval", 5, "10"),
    ("health_escalate_to", "reboot", "drain | rma"),
    ("health_slurm_node_states", ["busy"], "nondrained_idle"),
    ("health_textfile_dir", "relative/dir", "absolute path"),
])
def test_a_wrong_value_is_refused_at_planning_naming_key_and_allowed(key, value, said):
    from gpufleet.errors import InventoryError

    with pytest.raises(InventoryError) as exc:
        settings(**{key: value})
    assert key in str(exc.value) and said in str(exc.value)


@pytest.mark.parametrize("over, key", [
    ({"health_slurm_check": True}, "health_slurm_check"),
    ({"health_watch": True, "health_slurm_node_states": ["cycle"]}, "health_slurm_node_states"),
    ({"health_watch": True, "health_slurm_node_states": ["any", "idle"]}, "health_slurm_node_states"),
])
def test_keys_that_contradict_each_other_are_refused(over, key):
    from gpufleet.errors import InventoryError

    with pytest.raises(InventoryError) as exc:
        settings(**over)
    assert f"key '{key}'" in str(exc.value)


def test_the_reports_health_column_shows_the_last_event_and_its_age():
    from gpufleet.apps.report.render import health_event_text

    assert health_event_text({"health_event": {"time": NOW - 7300, "class": "reset", "action": "reset"}},
                             now=NOW) == "reset, 2h ago"
    assert health_event_text({"health_event": {"time": NOW - 30, "class": "reset", "action": "busy"}},
                             now=NOW, short=True) == "reset busy 30s"
    assert health_event_text({"health_event": None}) == ""


# --- DCGM's health watches --------------------------------------------------------------------

# `dcgmi health -c -j` as dcgmi/Health.cpp and DcgmiOutput (jsoncpp: "value", "overflow",
# "children") build it; composed from that source, not recorded on a host with DCGM
DCGM_HEALTH = json.dumps({
    "header": ["Health Monitor Report"],
    "body": {"Overall Health": {"value": "Failure"},
             "GPU": {"children": {"0": {"value": "Failure", "children": {"Errors": {"children": {
                 "NVLINK system": {"value": "Failure", "overflow": ["Detected a fatal NVLink error", "on link 3"]},
                 "PCIe system": {"value": "Warning", "overflow": ["Detected more than 8 PCIe replays per minute"]},
             }}}}}}}})


def test_dcgm_health_incidents_fold_into_the_same_classes_on_their_gpu():
    from gpufleet.plans.health import health_rules

    incidents = w.parse_dcgm_health(DCGM_HEALTH)
    assert incidents == [("GPU", "0", "NVLINK system", "Failure", "Detected a fatal NVLink error on link 3"),
                         ("GPU", "0", "PCIe system", "Warning", "Detected more than 8 PCIe replays per minute")]
    healthy = assess(GpuHealth().process(h200_output(h200_kernel_log())))
    verdict = w.with_dcgm(healthy, incidents, health_rules())
    found = {(f.check, f.cls) for f in verdict.gpus[0].findings}
    assert found == {("dcgm_nvlink_system", "drain"), ("dcgm_pcie_system", "monitor")}
    assert w.parse_dcgm_health("Error: Health watches not enabled. Please enable watches.") == []
    healthy_report = json.dumps({"header": ["Health Monitor Report"], "body": {"Overall Health": {"value": "Healthy"}}})
    assert w.with_dcgm(healthy, w.parse_dcgm_health(healthy_report), health_rules()) == healthy


# --- InfiniBand/RoCE ports in the watch (issue 46 item 3: the fabric feeds the health classes) ---

IB = Path(__file__).resolve().parents[1] / "fixtures" / "infiniband"


def _ports(name: str):
    from gpufleet.facts.network import parse_ib_counters

    return parse_ib_counters((IB / f"counters-{name}.txt").read_text().splitlines())


def _ib(ports, before):
    from gpufleet.plans.health import HostVerdict, health_rules

    verdict, memory = w.with_ib(HostVerdict((), ()), ports, before, health_rules())
    return [(f.check, f.cls, f.detail) for f in verdict.host_findings], memory


def test_the_first_sight_of_the_ports_is_history_not_news():
    found, memory = _ib(_ports("before"), {})
    assert found == [] and memory["mlx5_1/1"] == {"in_use": True, "counters": {
        "symbol_error": 0, "link_downed": 1, "link_error_recovery": 0, "port_rcv_errors": 0,
        "local_link_integrity_errors": 0}}


def test_a_port_that_went_down_and_flapped_drains_naming_it():
    _, memory = _ib(_ports("before"), {})
    found, after = _ib(_ports("after-flap"), memory)
    assert ("ib_port_down:mlx5_0/1", "drain") in [(c, k) for c, k, _ in found]
    flap = [d for c, k, d in found if c == "ib_link_flapped:mlx5_0/1"]
    assert flap and "mlx5_0 port 1" in flap[0] and "link_downed 0 -> 1" in flap[0], found
    assert not any("mlx5_1" in c for c, _, _ in found)   # its link_downed 1 was history
    # the next run with nothing new: the port is still down (drain), no second flap
    again, _ = _ib(_ports("after-flap"), after)
    assert [c for c, _, _ in again] == ["ib_port_down:mlx5_0/1"]


def test_grown_symbol_errors_are_monitored_naming_port_and_counts():
    _, memory = _ib(_ports("before"), {})
    found, _ = _ib(_ports("after-symbol-errors"), memory)
    assert found == [("ib_link_errors:mlx5_1/1", "monitor",
                      "mlx5_1 port 1: symbol_error 0 -> 17 since the last check: a degrading link")]


def test_a_port_never_up_is_no_finding_and_cleared_counters_start_again():
    from dataclasses import replace

    down = [replace(p, state="DOWN", phys_state="Polling") for p in _ports("before")]
    found, memory = _ib(down, {})
    found2, _ = _ib(down, memory)
    assert found == found2 == [] and not memory["mlx5_0/1"]["in_use"]
    _, memory = _ib(_ports("after-symbol-errors"), {})
    cleared, _ = _ib(_ports("before"), memory)   # perfquery -R: counters lower than before
    assert cleared == []


def test_an_hca_gone_from_sysfs_drains_and_unreadable_ports_judge_nothing():
    _, memory = _ib(_ports("before"), {})
    gone, kept = _ib([p for p in _ports("before") if p.device != "mlx5_0"], memory)
    assert [(c, k) for c, k, _ in gone] == [("ib_port_down:mlx5_0/1", "drain")] and "mlx5_0/1" in kept
    assert _ib(None, memory) == ([], memory)


def test_the_node_zip_runs_the_ib_reading_without_pyinfra(tmp_path):
    """The node runs gpufleet's modules from one zip with the system python3 -I and stand-ins for
    pyinfra and PyYAML: facts/network.py must import there too."""
    import shutil
    import subprocess
    import sys

    from gpufleet.deploys.health_watch import bundle

    (tmp_path / "watch.zip").write_bytes(bundle())
    port = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "ports" / "1"   # sysfs's shape (a test double)
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "phys_state").write_text("5: LinkUp\n")
    (port / "counters" / "link_downed").write_text("3\n")
    python = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
    done = subprocess.run([python, "-I", "-c", (
        "import sys; sys.path.insert(0, sys.argv[1]); import os; os.environ['GPUFLEET_TEST_SYSFS_ROOT'] = sys.argv[2]\n"
        "from gpufleet.apps import health_node\nprint(health_node.read_ib())"),
        str(tmp_path / "watch.zip"), str(tmp_path / "sys")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done
    assert done.stdout.strip() == ("[IbPortCounters(device='mlx5_0', port=1, state='ACTIVE', phys_state='LinkUp', "
                                   "counters={'link_downed': 3})]"), done
