"""DCGM's diagnostic, `dcgmi diag -r N -j`: the fact reads both JSON shapes DCGM prints (DCGM's
own legacy sample, recorded in tests/fixtures/dcgm/; the current shape, checked against DCGM's
own schema), and the health verdict classes each failure by the severity DCGM gave it.

The stand-in dcgmi (testing/aptrepo.py, a TEST DOUBLE) runs here against the GPU simulator: its
output must satisfy DCGM's schema, so the e2e tests that use it read DCGM's shape, not ours."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from gpufleet.facts.dcgm_diag import DcgmDiag, parse_dcgm_diag
from gpufleet.facts.health import GpuHealth
from gpufleet.plans.health import assess, diag_findings, health_rules, summary_line
from testing import aptrepo
from testing.gpusim.local import LocalSim

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm"
# DCGM names no draft ("http://json-schema.org/schema#": the latest one)
SCHEMA = jsonschema.Draft202012Validator(json.loads((FIXTURES / "dcgm_diag_schema.json").read_text()))


def lines(doc: object, rc: int, level: int = 1) -> list[str]:
    return [f"::gpufleet:: level {level}", *json.dumps(doc, indent=3).splitlines(), f"::gpufleet:: rc {rc}"]


def test_dcgms_own_legacy_sample_names_each_failed_gpu_and_its_severity():
    text = (FIXTURES / "legacy-per-gpu.json").read_text()
    diag = parse_dcgm_diag(["::gpufleet:: level 3", *text.splitlines(), "::gpufleet:: rc 226"])
    assert (diag.status, diag.level, diag.failed, diag.version) == ("fail", 3, ["sm_stress"], "1.7")
    assert [(r.test, r.gpu, r.status) for r in diag.results] == [("sm_stress", 0, "fail"), ("sm_stress", 2, "fail"),
                                                                  ("sm_stress", 3, "fail")]
    assert [(w.error_id, w.severity) for w in diag.results[1].warnings] == [(50, 1)]
    assert "1096.5 did not exceed desired stress level" in diag.results[1].warnings[0].text


def current_doc(results: list[dict], summary: str) -> dict:
    """A current-shape answer as dcgmi/Diag.cpp builds it (HelperJsonBuildOutput)."""
    return {"DCGM Diagnostic": {"test_categories": [
        {"category": "Deployment", "tests": [{"name": "software", "results": [
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
            {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Pass"}],
            "test_summary": {"status": "Pass"}}]},
        {"category": "Hardware", "tests": [{"name": "memory", "results": results,
                                            "test_summary": {"status": summary}}]}]},
        "entity_groups": [{"entities": [{"device_id": "2335", "entity_id": 0}, {"device_id": "2335", "entity_id": 1}],
                           "entity_group": "GPU", "entity_group_id": 1}],
        "metadata": {"version": "4.6.0", "Driver Version Detected": "580.159.04"}}


DBE = {"warning": "Detected 2 volatile double-bit ECC error(s) in GPU 1.", "error_id": 4, "error_category": 10,
       "error_severity": 2}


def test_current_shape_fails_the_gpu_it_names_and_passes_when_every_test_passes():
    failing = current_doc([{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"},
                           {"entity_group": "GPU", "entity_group_id": 1, "entity_id": 1, "status": "Fail",
                            "warnings": [DBE]}], "Fail")
    SCHEMA.validate(failing)
    diag = parse_dcgm_diag(lines(failing, 226, level=2))
    assert (diag.status, diag.level, diag.failed, diag.version) == ("fail", 2, ["memory"], "4.6.0")
    assert [(r.category, r.test, r.gpu) for r in diag.results] == [("Hardware", "memory", 1)]
    passing = current_doc([{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}], "Pass")
    SCHEMA.validate(passing)
    assert parse_dcgm_diag(lines(passing, 0)).status == "pass"
    # exit non-zero with every test passed: not a pass
    assert parse_dcgm_diag(lines(passing, 226)).status == "error"


@pytest.mark.parametrize("output, status, detail", [
    (["::gpufleet:: level 1", "::gpufleet:: no-dcgmi"], "not-installed", "not installed"),
    (["::gpufleet:: level 2", "::gpufleet:: busy 4242, python3 "], "busy", "4242, python3"),
    (["::gpufleet:: level 1", "Error: Unable to connect to host engine. Host engine connection invalid/disconnected.",
      "::gpufleet:: rc 255"], "error", "Unable to connect to host engine"),
    (lines({"DCGM Diagnostic": {"version": "4.6.0", "runtime_error": "No GPUs found"}}, 226),
     "error", "No GPUs found"),
    (lines({"something": "else"}, 0), "error", "without a 'DCGM Diagnostic' object"),
])
def test_what_is_not_a_diagnostic_is_never_a_pass(output, status, detail):
    diag = parse_dcgm_diag(output)
    assert diag.status == status and detail in diag.detail


def test_the_verdict_classes_by_dcgms_severity_and_names_the_gpu():
    health = GpuHealth().process(json.loads(
        (Path(__file__).parent / "facts/health.GpuHealth/healthy_h200.json").read_text())["output"])
    doc = current_doc([{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Fail",
                        "warnings": [{**DBE, "warning": "Detected 2 volatile double-bit ECC error(s) in GPU 0."}]}],
                      "Fail")
    verdict = assess(health, diag=parse_dcgm_diag(lines(doc, 226, level=2)))
    (gpu,) = verdict.gpus
    (finding,) = gpu.findings
    assert (finding.check, finding.cls) == ("dcgm_memory", "drain")   # severity 2 ISOLATE
    assert "level 2, Hardware memory: Detected 2 volatile double-bit ECC" in finding.detail
    assert "DCGM error 4" in finding.detail and verdict.diag_status == "fail"
    assert summary_line(verdict).startswith(f"drain: GPU 0 ({gpu.bus_id}): DCGM diagnostic level 2")
    # every severity DCGM defines has a class, and RESET is one that needs action
    rules = health_rules()
    assert set(rules.dcgm_severities) == {0, 1, 2, 3, 4, 5, 6} and rules.dcgm_severities[6].cls == "reset"


def test_the_fact_checks_idle_gpus_first_only_where_the_level_loads_them():
    quick, medium = (DcgmDiag().command(level=n).get_raw_value() for n in (1, 2))
    assert quick.endswith(" dcgm-diag 1 300 0") and medium.endswith(" dcgm-diag 2 1200 1")
    with pytest.raises(ValueError, match="allowed 1, 2, 3"):
        DcgmDiag().command(level=4)


# ------------------------------------------------------------------- the stand-in, on the simulator

@pytest.fixture
def standin(tmp_path):
    """The stand-in dcgmi with the simulator's nvidia-smi and a host engine that runs (a shim)."""
    sim = LocalSim(tmp_path / "sim", "h200x2")
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "nvidia-smi").write_text(f"#!/bin/sh\nexec {sys.executable} {sim.root}/usr/lib/gpusim/nvidia-smi \"$@\"\n")
    (shims / "systemctl").write_text("#!/bin/sh\nexit 0\n")
    (shims / "dcgmi").write_text(aptrepo._DCGMI.replace("#!/usr/bin/python3", f"#!{sys.executable}", 1))
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = dict(os.environ, GPUSIM_ROOT=str(sim.root), PATH=f"{shims}:{os.environ['PATH']}")

    def diag(level: int) -> tuple[subprocess.CompletedProcess, object]:
        run = subprocess.run([str(shims / "dcgmi"), "diag", "-r", str(level), "-j"], capture_output=True, text=True,
                             env=env, check=False)
        return run, parse_dcgm_diag([f"::gpufleet:: level {level}", *run.stdout.splitlines(),
                                     f"::gpufleet:: rc {run.returncode}"])
    return sim, diag


def test_standin_prints_dcgms_schema_and_passes_healthy_gpus_at_every_level(standin):
    _, diag = standin
    for level in (1, 2, 3):
        run, parsed = diag(level)
        SCHEMA.validate(json.loads(run.stdout))
        assert (run.returncode, parsed.status) == (0, "pass"), run.stdout


@pytest.mark.parametrize("fault, level, test, error_id, cls", [
    ("row-remap-pending", 1, "software", 85, "reset"),
    ("ecc-uncorrected", 2, "memory", 4, "drain"),
    ("pcie-degraded", 2, "pcie", 46, "monitor"),
    ("nvlink-down", 2, "pcie", 14, "drain"),
    ("hw-slowdown", 3, "targeted_stress", 43, "monitor"),
])
def test_standin_fails_the_faulty_gpu_at_the_level_that_sees_it(standin, fault, level, test, error_id, cls):
    sim, diag = standin
    assert sim.ctl("fault", "--gpu", "1", fault).returncode == 0
    if level > 1:   # the levels below do not look at it
        assert diag(level - 1)[1].status == "pass"
    run, parsed = diag(level)
    SCHEMA.validate(json.loads(run.stdout))
    assert (run.returncode, parsed.status, parsed.failed) == (226, "fail", [test]), run.stdout
    assert {r.gpu for r in parsed.results} == {1}
    assert error_id in {w.error_id for r in parsed.results for w in r.warnings}
    rules = health_rules()
    found = [f for r in parsed.results for f in diag_findings(r, parsed.level, rules) if str(error_id) in f.detail]
    assert [f.cls for f in found] == [cls], found
