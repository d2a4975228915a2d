"""gpufleet/plans/health.py on recorded and composed GpuHealth output (tests/unit/facts/health.GpuHealth/):
each finding's class comes from gpufleet/data/health.yaml, whose every row names its source."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gpufleet.facts.health import GpuHealth
from gpufleet.plans.health import CLASSES, assess, gpu_findings, health_rules, rules_from, summary_line

pytestmark = pytest.mark.unit

CASES = Path(__file__).parent / "facts/health.GpuHealth"


def reading(case: str):
    return GpuHealth().process(json.loads((CASES / f"{case}.json").read_text())["output"])


def test_a_healthy_h200_is_ok_and_needs_nothing():
    verdict = assess(reading("healthy_h200"))
    assert verdict.worst == "ok" and not verdict.needs_action
    assert summary_line(verdict) == "ok: 1 GPU(s) healthy"


def test_each_failing_reading_gets_the_class_nvidias_guidance_gives_on_its_own_gpu():
    verdict = assess(reading("failing_gpus"))
    found = {(g.index, f.check): f.cls for g in verdict.gpus for f in g.findings}
    assert found == {
        (0, "row_remap_pending"): "reset", (0, "ecc_uncorrected_volatile"): "reset", (0, "xid_63"): "monitor",
        (1, "hw_thermal_slowdown"): "drain", (1, "pcie_width_degraded"): "drain", (1, "nvlink_down"): "drain",
        (1, "xid_79"): "reboot"}
    # an XID of a GPU nvidia-smi does not list is the host's, and an application's XID 13 needs nothing
    assert [(f.check, f.cls) for f in verdict.host_findings] == [("xid_13", "monitor")]
    assert verdict.worst == "drain" and verdict.needs_action
    line = summary_line(verdict)
    assert line.startswith("drain: GPU 1 (00000000:00:07.0): ") and line.endswith("more). Fix: " + line.split("Fix: ")[1])
    link = next(f for f in verdict.gpus[1].findings if f.check == "nvlink_down")
    assert link.detail == "NVLink link(s) 3 of 18 inactive"


def test_no_driver_and_an_unreadable_kernel_log_are_said_not_hidden():
    assert assess(reading("no_nvidia_smi")).worst == "drain"
    unread = assess(reading("kernel_log_unreadable"))
    assert [f.check for f in unread.host_findings] == ["kernel_log_unreadable"] and not unread.needs_action


def test_nvlink_required_by_the_tier_and_missing_is_a_finding():
    verdict = assess(reading("healthy_h200"), nvlink="required")
    assert [f.check for f in verdict.gpus[0].findings] == ["nvlink_missing"]


def test_every_rule_has_a_class_a_fix_and_a_listed_source():
    rules = health_rules()
    for rule in [*rules.checks.values(), *rules.xids.values(), rules.xid_other]:
        assert rule.cls in CLASSES and rule.fix and rule.source in rules.sources
    doc = yaml.safe_load((Path(__file__).parents[2] / "gpufleet/data/health.yaml").read_text())
    doc["checks"]["row_remap_failure"]["source"] = "S99"
    with pytest.raises(ValueError, match="S99"):
        rules_from(doc)


def test_xid_lines_as_real_drivers_print_them():
    """Lines quoted from real hosts (NVIDIA/open-gpu-kernel-modules#1151, NVIDIA/gpu-operator#1146,
    NVIDIA's memory error guide Table 3, NVIDIA/NVSentinel#155): with and without pid, with
    'PCI:' or without, a MIG instance suffix, and the fall off the bus without an XID."""
    from gpufleet.facts.health import parse_xids

    lines = [
        "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
        "[240314.528856] NVRM: Xid (PCI:0000:07:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable double bit error (DBE) has been detected",
        "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
        "[ 12.5] NVRM: Xid (0000:03:00): 14, Channel 00000001",
        "NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330) installed in this system has fallen off the bus and is not responding to commands.",
        "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.",   # the line after an XID 79: not counted twice
    ]
    assert parse_xids(lines) == [("2b:00", 79), ("07:00", 48), ("01:00", 94), ("03:00", 14), ("b3:00", 79)]


def test_retired_pages_at_dcgms_limit_are_an_rma_case():
    from dataclasses import replace

    base = reading("healthy_h200").gpus[0]
    old = replace(base, retired_single_bit=60, retired_double_bit=3, remapped_correctable=None)
    assert [(f.check, f.cls) for f in gpu_findings(old, health_rules())] == [("retired_pages_limit", "rma")]
    assert gpu_findings(replace(old, retired_single_bit=59), health_rules()) == []


def test_nvml_readings_recorded_on_the_h200_are_read_and_healthy():
    data = reading("healthy_h200_with_nvml")
    (gpu,) = data.gpus
    assert data.nvml and (gpu.pcie_replays, gpu.temperature_slowdown, gpu.thermal_violation_ms) == (0, 89, 0)
    assert assess(data).worst == "ok"
    # without nvidia-ml-py on the host nothing is read through NVML, and nothing is made up
    assert not reading("healthy_h200").nvml and reading("healthy_h200").gpus[0].pcie_replays is None


@pytest.mark.parametrize("change, check, cls", [
    ({"recovery_action": 1}, "recovery_reset", "reset"),
    ({"recovery_action": 4}, "recovery_reset", "reset"),
    ({"recovery_action": 2}, "recovery_reboot", "reboot"),
    ({"recovery_action": 3}, "recovery_drain", "drain"),
    ({"pcie_replays": 12}, "pcie_replays", "monitor"),
    ({"temperature": 86}, "near_slowdown_temperature", "monitor"),
])
def test_what_nvml_adds_is_classed(change, check, cls):
    import dataclasses

    (gpu,) = reading("healthy_h200_with_nvml").gpus
    found = gpu_findings(dataclasses.replace(gpu, **change), health_rules())
    assert [(f.check, f.cls) for f in found] == [(check, cls)]
    assert gpu_findings(dataclasses.replace(gpu, recovery_action=0), health_rules()) == []


def test_the_nvml_reader_runs_and_without_a_driver_reads_nothing(tmp_path):
    """The script sent to the host, run here with this machine's nvidia-ml-py and no NVIDIA driver:
    NVML cannot start, the script exits non-zero, and the fact keeps nvidia-smi's readings alone."""
    import subprocess
    import sys

    from gpufleet.facts.health import NVML_SCRIPT

    run = subprocess.run([sys.executable, "-c", NVML_SCRIPT], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode != 0 and "NVMLError" in run.stderr, run.stderr
    lines = json.loads((CASES / "healthy_h200.json").read_text())["output"]
    data = GpuHealth().process([*lines, "::gpufleet:: begin nvml", *run.stdout.splitlines(),
                                f"::gpufleet:: rc nvml {run.returncode}"])
    assert not data.nvml and data.gpus[0].temperature_slowdown is None


def test_a_gpu_listing_fewer_nvlinks_than_its_model_has_is_drained_where_the_tier_requires_nvlink():
    """The recorded 2 x H200 host lists 18 links per GPU, as health.yaml's nvlink_links says an H200
    has; a GPU that lists 16 of them, on a tier that requires NVLink, is a drain case."""
    import dataclasses

    from gpufleet.facts.health import parse_nvlinks

    recorded = (Path(__file__).parents[1] / "fixtures/nvidia/h200-x2/nvlink-status.txt").read_text().splitlines()
    links = parse_nvlinks(recorded)
    assert {gpu: len(found) for gpu, found in links.items()} == {0: 18, 1: 18}
    (gpu,) = reading("healthy_h200").gpus
    assert gpu.name == "NVIDIA H200" and health_rules().nvlink_links[gpu.name] == 18
    full = dataclasses.replace(gpu, nvlinks=links[0])
    assert gpu_findings(full, health_rules(), nvlink="required") == []
    fewer = dataclasses.replace(gpu, nvlinks=links[0][:16])
    found = gpu_findings(fewer, health_rules(), nvlink="required")
    assert [(f.check, f.cls) for f in found] == [("nvlink_fewer_links", "drain")]
    assert found[0].detail.startswith("16 NVLink link(s) listed where an NVIDIA H200 has 18")
    # only where the tier requires NVLink, and only for models whose count is known
    assert gpu_findings(fewer, health_rules(), nvlink="any") == []
    assert gpu_findings(dataclasses.replace(fewer, name="NVIDIA H100 NVL"), health_rules(), nvlink="required") == []


def test_an_nvlink_count_without_a_listed_source_is_refused():
    doc = yaml.safe_load((Path(__file__).parents[2] / "gpufleet/data/health.yaml").read_text())
    doc["nvlink_links"]["NVIDIA H200"]["source"] = "S99"
    with pytest.raises(ValueError, match="nvlink_links.NVIDIA H200"):
        rules_from(doc)
