"""gpufleet/apps/health.py: the JSON shape, the table, and what --local --slurm asks of Slurm,
on recorded and composed GpuHealth output (tests/unit/facts/health.GpuHealth/)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufleet.apps.health import SLURM_REASON, main, slurm_action, table, verdict_json
from gpufleet.facts.health import GpuHealth
from gpufleet.facts.slurm import SlurmNodeData
from gpufleet.plans.health import assess

pytestmark = pytest.mark.unit

CASES = Path(__file__).parent / "facts/health.GpuHealth"


def verdict(case: str):
    return assess(GpuHealth().process(json.loads((CASES / f"{case}.json").read_text())["output"]))


def node(state: str | None = "idle", reason: str = "") -> SlurmNodeData:
    return SlurmNodeData(scontrol="/usr/bin/scontrol", node="gpu-01", state=state, reason=reason)


def test_the_json_names_every_gpu_and_finding_as_the_issue_says():
    doc = verdict_json("gpu-01", verdict("failing_gpus"), {"status": "ok"})
    assert doc["name"] == "gpu-01" and doc["worst"] == "drain"
    assert [g["bus_id"] for g in doc["gpus"]] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert set(doc["gpus"][1]["findings"][0]) == {"check", "class", "detail", "fix"}
    unreachable = verdict_json("gpu-02", None, {"status": "unreachable", "error": "timed out"})
    assert unreachable["status"] == "unreachable" and unreachable["gpus"] == []


def test_the_table_puts_the_worst_first_and_a_healthy_host_on_one_line():
    text = table([("sick", verdict("failing_gpus"), {}), ("fine", verdict("healthy_h200"), {})])
    lines = text.splitlines()
    assert lines[0].split() == ["HOST", "GPU", "CLASS", "FINDING", "FIX"]
    assert lines[1].split()[:4] == ["sick", "1", "00000000:00:07.0", "drain"]
    assert [line.split()[:3] for line in lines if line.startswith("fine")] == [["fine", "-", "ok"]]


def test_slurm_drains_at_drain_or_worse_with_the_finding_as_reason():
    action = slurm_action(verdict("failing_gpus"), node())
    assert action[:4] == ["/usr/bin/scontrol", "update", "NodeName=gpu-01", "State=DRAIN"]
    assert action[4].startswith("Reason=" + SLURM_REASON + "drain: GPU 1 (00000000:00:07.0)")
    assert slurm_action(verdict("failing_gpus"), node("drained", "admin: bad DIMM")) is None  # already out


def test_slurm_resumes_only_what_gpufleet_health_drained():
    healthy = verdict("healthy_h200")
    assert slurm_action(healthy, node("drained", SLURM_REASON + "drain: GPU 1 ...")) == [
        "/usr/bin/scontrol", "update", "NodeName=gpu-01", "State=RESUME"]
    assert slurm_action(healthy, node("drained", "admin: bad DIMM")) is None
    assert slurm_action(healthy, node("drained", "gpufleet driver upgrade to 580.126.09")) is None  # the rollout's
    assert slurm_action(healthy, SlurmNodeData(scontrol=None, node="gpu-01")) is None


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["--slurm", "inv.py"], ["--local", "inv.py"]):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2


def test_local_json_is_the_fleet_form_for_this_one_host(monkeypatch, capsys):
    """tools/health --local --json prints the same JSON as without --local (it printed the text
    line before), the host named by its host name; the exit status is the same as the line's."""
    import socket

    from gpufleet.apps import health

    recorded = json.loads((CASES / "failing_gpus.json").read_text())["output"]
    monkeypatch.setattr(health, "_run", lambda command: recorded)
    assert main(["--local", "--json"]) == 1
    out = capsys.readouterr().out
    doc = json.loads(out)
    assert list(doc) == ["hosts"] and len(doc["hosts"]) == 1
    assert doc["hosts"][0] == verdict_json(socket.gethostname(), verdict("failing_gpus"), {"status": "ok"})
    assert set(doc["hosts"][0]) == {"name", "status", "worst", "error", "findings", "gpus"}

    healthy = json.loads((CASES / "healthy_h200.json").read_text())["output"]
    monkeypatch.setattr(health, "_run", lambda command: healthy)
    assert main(["--local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hosts"][0]["worst"] == verdict("healthy_h200").worst
    # without --json: the one line Slurm's HealthCheckProgram reads
    assert main(["--local"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
