"""Fleet report rendering and its JSON format: every kind of row validates against
gpufleet/apps/report/report.schema.json, and every host appears in the terminal, Markdown and HTML."""
from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator, validate

from gpufleet.apps.report.gather import classify
from gpufleet.apps.report.render import SCHEMA_PATH, cell, document, html_page, markdown, terminal, write_all
from gpufleet.checks.validation import Result

pytestmark = pytest.mark.unit


def _checks(*results: Result) -> dict:
    return {"counts": {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "warn", "skip", "unmanaged")},
            "failed": [f"{r.area}: {r.name}: {r.message}" for r in results if r.status == "fail"],
            "checks": [r.to_json() for r in results]}


def _row(name: str, state: str, **extra) -> dict:
    row = {"host": name, "address": "127.0.0.9", "status": "ok", "state": state, "tier": "dev", "seconds": 1.2,
           "gpus": [{"model": "Tesla T4", "count": 1}], "gpu_status": "ok", "driver_loaded": "580.95.05",
           "driver_installed": "580.95.05", "mismatch": False, "cuda": None, "cudnn": None,
           "container_toolkit": None, "kernel": "6.1.0-40-amd64", "held_packages": ["libcudnn9-cuda-13"],
           "reboot_pending": False, "persistence": "on", "clocks": "5001,1590", "firewall": "ok",
           "ssh_hardening": "ok", "marker": "ok", "validation": _checks(Result("base", "x", "pass")),
           "drift": {"method": "plan", "changes": 0, "operations": [], "conditional": [], "error": None}}
    row.update(extra)
    return row


ROWS = [
    _row("prov", "provisioned"),
    _row("fresh", "fresh", marker="fail: /etc/gpufleet/managed is missing",
         drift={"method": "plan", "changes": 22, "operations": ["Base system | Install"], "conditional": [], "error": None}),
    _row("changed", "changed", validation=_checks(Result("base", "the marker", "fail", "says tier research", "run")),
         pytorch="fail: torch 2.13.0+cpu (/usr/local/lib/python3.11/dist-packages/torch) is a CPU-only build"),
    _row("mismatch", "mismatch-pending", mismatch=True, driver_loaded="580.95.05", driver_installed="580.126.09",
         reboot_pending=True),
    {"host": "dead", "address": "127.0.0.250", "status": "unreachable", "state": "unreachable", "tier": "dev",
     "error": "Could not connect (Unable to connect to port 22 on 127.0.0.250)", "seconds": 0.0, "drift": None},
    _row("broken", "error", status="error", error="InventoryError: host broken: key 'tier': missing",
         drift={"method": "plan", "changes": None, "operations": [], "conditional": [], "error": "InventoryError"}),
]


@pytest.fixture
def doc():
    return document(ROWS, "inventories/test.py", 3.4)


def test_every_kind_of_row_matches_the_schema(doc):
    schema = json.loads(SCHEMA_PATH.read_text())
    validate(json.loads(json.dumps(doc)), schema)
    assert {k: doc["summary"][k] for k in ("hosts", "states")} == {"hosts": 6, "states": {"provisioned": 1, "fresh": 1, "changed": 1,
                                                     "mismatch-pending": 1, "unreachable": 1, "error": 1}}


def test_the_schema_rejects_what_it_should(doc):
    schema = json.loads(SCHEMA_PATH.read_text())
    bad = json.loads(json.dumps(doc))
    bad["hosts"][0]["state"] = "fine"
    del bad["hosts"][4]["error"]  # optional, fine
    bad["hosts"][1]["surprise"] = 1
    del bad["hosts"][2]["drift"]
    problems = [e.message for e in Draft202012Validator(schema).iter_errors(bad)]
    assert any("'fine'" in p for p in problems)
    assert any("surprise" in p for p in problems)
    assert any("'drift' is a required property" in p for p in problems)


def test_cells(doc):
    by = {r["host"]: r for r in ROWS}
    assert cell(by["prov"], "gpus") == "Tesla T4 x 1"
    assert cell(by["mismatch"], "driver") == "580.95.05 / 580.126.09 MISMATCH"
    assert cell(by["fresh"], "drift") == "22 changes"
    assert cell(by["prov"], "drift") == "0 changes"
    assert cell(by["dead"], "problems").startswith("Could not connect")
    assert cell(by["dead"], "kernel") == ""
    assert cell(by["changed"], "problems") == "base: the marker: says tier research"
    assert cell(by["broken"], "drift").startswith("error: ")


def test_every_host_is_in_every_format(doc, tmp_path):
    text, md, page = terminal(doc), markdown(doc), html_page(doc)
    for row in ROWS:
        assert row["host"] in text and f"| {row['host']} |" in md and f'data-host="{row["host"]}"' in page
    assert "6 hosts (1 changed, 1 error, 1 fresh, 1 mismatch-pending, 1 provisioned, 1 unreachable)" in text
    assert page.count("<tr class=\"state-") == 6
    paths = write_all(doc, tmp_path / "out")
    assert json.loads(paths["json"].read_text())["hosts"][4]["state"] == "unreachable"


def test_html_escapes_host_text():
    row = _row("x", "changed", validation=_checks(Result("base", "m", "fail", "<script>alert(1)</script>")))
    page = html_page(document([row], "inv.py", 1))
    assert "<script>alert" not in page and "&lt;script&gt;" in page


def test_classify():
    fresh = [Result("base", "the gpufleet marker matches the tier", "fail", "/etc/gpufleet/managed is missing")]
    changed = [Result("base", "the gpufleet marker matches the tier", "fail", "changed by hand")]
    fine = [Result("base", "the gpufleet marker matches the tier", "pass"), Result("tuning", "x", "unmanaged")]
    assert classify({"status": "ok"}, fresh) == "fresh"
    assert classify({"status": "ok"}, changed) == "changed"
    assert classify({"status": "ok"}, fine) == "provisioned"
    assert classify({"status": "ok", "mismatch": True}, fine) == "mismatch-pending"
    assert classify({"status": "unreachable"}, []) == "unreachable"
    assert classify({"status": "error"}, []) == "error"


def test_a_pending_driver_upgrade_is_drift_and_fits_the_schema():
    row = _row("behind", "provisioned", drift={
        "method": "plan", "changes": 0, "operations": [], "conditional": [], "error": None,
        "pending": ["driver upgrade pending: 580.95.05 -> 580.126.09, run tools/rollout"]})
    assert cell(row, "drift") == "0 changes; driver upgrade pending: 580.95.05 -> 580.126.09, run tools/rollout"
    validate(json.loads(json.dumps(document([row], "inv.py", 1.0))), json.loads(SCHEMA_PATH.read_text()))


def test_the_pytorch_column(doc):
    by = {r["host"]: r for r in doc["hosts"]}
    assert ("pytorch", "PyTorch") in [(c["key"], c["heading"]) for c in doc["columns"]]
    assert cell(by["changed"], "pytorch").startswith("fail: torch 2.13.0+cpu ")
    assert cell(by["prov"], "pytorch") == "-"


def test_the_compact_table_fits_160_columns_for_20_recorded_hosts():
    """20 hosts of the recorded report (tests/fixtures/report/, each recorded row repeated under
    a new name): every line of the default table is at most 160 columns, every host is there
    under its whole name, the hosts that need attention first."""
    from gpufleet.apps.report.view import ordered
    from testing.report_fixture import recorded_document

    doc = recorded_document(20)
    lines = terminal(doc).splitlines()
    assert max(len(line) for line in lines) <= 160, [len(line) for line in lines]
    first = [line.split()[0] for line in lines[2:22]]
    assert first == [r["host"] for r in ordered(doc["hosts"])] and len(set(first)) == 20
    assert lines[0].split() == ["Host", "State", "Tier", "GPUs", "Driver", "CUDA", "cuDNN", "PyTorch", "Health",
                                "Drift", "Problems"]
    by = {line.split()[0]: line for line in lines[2:22]}
    assert "9.16.0.29*" in by["gf-htmlreport-2"] and "cuDNN: libcudnn9-cuda-13 9.16" in by["gf-htmlreport-2"]
    assert " fail " in by["gf-htmlreport-5"] and "GPU health: GPU 2" in by["gf-htmlreport-5"]
    assert "2.11.0+cu128" in by["gf-htmlreport-4"]
    # the old table, every column at up to 40 characters, was 268-436 wide; the wide one is wider still
    assert max(len(line) for line in terminal(doc, wide=True).splitlines()) > 400


def test_the_compact_table_stays_within_its_width_whatever_the_hosts_say():
    long = _row("gpu-" + "x" * 70, "changed", validation=_checks(Result("base", "the marker", "fail", "y" * 300, "run")),
                gpus=[{"model": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "count": 8}], tier="t" * 40)
    doc = document([*ROWS, long], "inventories/test.py", 1.0)
    for width in (160, 120, 80):
        lines = terminal(doc, width=width).splitlines()
        assert max(len(line) for line in lines) <= width, width
        assert any(line.startswith("gpu-xxxx") for line in lines)


def test_wide_shows_the_details_the_compact_table_drops():
    from testing.report_fixture import recorded_document

    doc = recorded_document()
    compact, wide = terminal(doc), terminal(doc, wide=True)
    rows = {r["host"]: r for r in doc["hosts"]}
    dropped = [
        rows["gf-htmlreport-4"]["kernel"],                        # the kernel
        "NVIDIA A100-SXM4-40GB x 4",                              # the GPU model in full
        "(resolved 9.17.0.29)",                                   # the resolved cuDNN beside the installed one
        "535.247.01 / 535.309.01 MISMATCH",                       # loaded / installed driver
        "skip: this host cannot load rules",                      # firewall
        rows["gf-htmlreport-4"]["endpoints"][0]["url"],           # the metrics endpoints
        "application 1215,1410 = planned",                        # clocks
        rows["gf-htmlreport-4"]["held_packages"][0] + ",",        # held packages
    ]
    for text in dropped:
        assert text in wide and text not in compact, text
    assert len(wide.splitlines()) == len(compact.splitlines()) - 1  # the same hosts, one line each (no legend)
