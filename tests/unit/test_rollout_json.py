"""`gpufleet-rollout --json` (issue 50 item 3): one JSON document on stdout, with the batches,
each host's outcome and step timings, the hosts left out and what is left."""
from __future__ import annotations

import io
import json
import logging

import pytest

from gpufleet.apps.rollout.cli import rollout_main
from gpufleet.apps.rollout.result import result_doc
from gpufleet.apps.rollout.runner import Options, Runner
from gpufleet.rollout import plan
from gpufleet.rollout.state import HostRecord, RolloutState

pytestmark = pytest.mark.unit


@pytest.fixture
def pyinfra_logger_restored():
    """rollout_main sets up the process's pyinfra logger as a command does (its own handler, no
    propagation): put it back, so later tests' caplog still sees pyinfra's warnings."""
    log = logging.getLogger("pyinfra")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def _steps(*names: str, ok: bool = True) -> dict:
    return {s: {"started": 100.0, "finished": 112.5, "ok": ok, "seconds": 12.5, "message": f"{s} ok"} for s in names}


def test_the_document_after_a_run_parses_and_says_what_is_left(tmp_path):
    runner = Runner(Options(inventory="fleet.py", target="580.126.09", command="gpufleet-rollout fleet.py",
                            assume_yes=True),
                    out=io.StringIO(), stdin=io.StringIO())
    runner.state = RolloutState(tmp_path / "s.json", "580.126.09", "fleet.py", {
        "h1": HostRecord("h1", status="done", batch=0, target="580.126.09", message="undrain ok",
                         steps=_steps("drain", "snapshot", "upgrade", "reboot", "tune", "validate", "accept", "undrain")),
        "h2": HostRecord("h2", status="failed", batch=1, target="580.126.09", message="upgrade failed: apt",
                         steps={**_steps("drain", "snapshot"), **_steps("upgrade", ok=False)}),
        "h3": HostRecord("h3", status="pending", batch=1, target="580.126.09")})
    runner.batches = [plan.Batch(0, ("h1",)), plan.Batch(1, ("h2", "h3"))]
    runner.notes = {"h4": "at 580.126.09 already: nothing to do"}
    runner.unreachable = {"h5": "could not connect"}
    runner.ctx.survey.update({"h1": {"installed": "580.95.05", "loaded": "580.95.05"}})
    runner.stopped = "batch 1: 1 host(s) failed, more than max_fail 0"
    doc = json.loads(json.dumps(result_doc(runner, 1)))   # what a consumer reads back
    assert doc["exit"] == 1 and doc["dry_run"] is False and doc["target"] == "580.126.09"
    assert doc["batches"] == [{"index": 0, "name": "canary", "hosts": ["h1"]},
                              {"index": 1, "name": "batch 1", "hosts": ["h2", "h3"]}]
    assert doc["hosts"]["h1"]["status"] == "done" and doc["hosts"]["h1"]["from"] == {"installed": "580.95.05",
                                                                                      "loaded": "580.95.05"}
    assert list(doc["hosts"]["h1"]["steps"]) == ["drain", "snapshot", "upgrade", "reboot", "tune", "validate",
                                                 "accept", "undrain"]
    assert doc["hosts"]["h2"]["steps"]["upgrade"] == {"ok": False, "seconds": 12.5, "message": "upgrade ok"}
    assert doc["left"] == ["h2", "h3", "h5"] and doc["stopped"].startswith("batch 1")
    assert doc["not_in_rollout"] == {"h4": "at 580.126.09 already: nothing to do"}
    assert doc["unreachable"] == {"h5": "could not connect"}
    assert doc["summary"] == {"done": 1, "failed": 1, "pending": 1}


def test_the_command_prints_only_the_document_on_stdout(tmp_path, monkeypatch, capsys, pyinfra_logger_restored):
    """A run that stops before any host (an inventory with no hosts, exit 2) still prints a
    document, and its words go to stderr."""
    (tmp_path / "empty.py").write_text("")
    monkeypatch.chdir(tmp_path)
    code = rollout_main(["empty.py", "--json", "--dry-run"], prog="gpufleet-rollout")
    out, err = capsys.readouterr()
    assert code == 2
    doc = json.loads(out)
    assert doc["exit"] == 2 and doc["hosts"] == {} and doc["batches"] == [] and doc["left"] == []
    assert "has no hosts: nothing to roll out" in err and "nothing to roll out" not in out
