"""The HTML fleet report's view (gpufleet/apps/report/view.py and templates/report/report.html.j2),
rendered from a report recorded by tools/fleet-report on the sandbox's test hosts
(tests/fixtures/report/, made by testing/report_fixture.py: a driver mismatch, cuDNN 9.16.0.29
where the tier resolves 9.17.0.29, a GPU with a row remap pending, an unreachable entry, a warning
host, a healthy one; every firewall check a skip).

The page is read back with an HTML parser (testing/chromium.parse_report), not searched for
strings the code itself wrote: statuses are the cells' data-status, versions their text."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from jsonschema import validate

from gpufleet.apps.report.gather import _versions, component_versions
from gpufleet.apps.report.render import SCHEMA_PATH, cell, document, html_page
from gpufleet.apps.report.view import (CHECK_OF, DRIVER_CHECK, KERNEL_CHECK, MISMATCH_CHECK, REFUSED, STACK_CHECK,
                                       attention, cells, fleet_summary, ordered, problems, upgrades, version_rows)
from gpufleet.config.resolver import resolve
from testing.chromium import parse_report

pytestmark = pytest.mark.unit

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "report" / "sandbox-fleet.json"
DEV, CUDNN_BY_HAND, SICK, GHOST, HGX, HEALTHY = (
    "gf-htmlreport-1", "gf-htmlreport-2", "gf-htmlreport-5", "gf-htmlreport-ghost", "gf-htmlreport-3", "gf-htmlreport-4")


@pytest.fixture
def doc() -> dict:
    return json.loads(RECORDED.read_text())


def _rows(doc: dict) -> dict[str, dict]:
    return {r["host"]: r for r in doc["hosts"]}


def _page(doc: dict):
    return parse_report(html_page(doc))


def test_the_recorded_report_and_a_new_document_match_the_schema(doc):
    schema = json.loads(SCHEMA_PATH.read_text())
    validate(doc, schema)
    again = json.loads(json.dumps(document(doc["hosts"], doc["inventory"], 1.0)))
    validate(again, schema)
    # only fields were added: the old ones are all still there, with their old meaning
    assert {"hosts", "states"} <= set(again["summary"]) and again["summary"]["states"] == doc["summary"]["states"]


def test_a_skip_is_not_a_pass(doc):
    page = _page(doc)
    for row in page.rows:
        if row.host == GHOST:
            assert row.cells["firewall"] == "none"
            continue
        # "skip: this host cannot load rules" (no CAP_NET_ADMIN on test hosts)
        assert row.cells["firewall"] == "skip", row
        assert row.text["firewall"].split()[:2] == ["–", "skip"], row.text["firewall"]
        assert "cannot load rules" in row.text["firewall"]  # the reason, folded away
    assert 'class="c-firewall st-pass"' not in html_page(doc)


def test_a_cudnn_that_differs_from_the_resolved_release_fails_its_cell(doc):
    rows = _rows(doc)
    assert rows[CUDNN_BY_HAND]["versions"]["cudnn"] == "9.16.0.29"
    assert rows[CUDNN_BY_HAND]["resolved"]["cudnn"] == "9.17.0.29"
    by_hand = cells(rows[CUDNN_BY_HAND])["cudnn"]
    assert (by_hand.status, by_hand.text, by_hand.resolved, by_hand.differs) == ("fail", "9.16.0.29", "9.17.0.29", True)
    page = {r.host: r for r in _page(doc).rows}
    assert page[CUDNN_BY_HAND].cells["cudnn"] == "fail"
    assert "9.16.0.29" in page[CUDNN_BY_HAND].text["cudnn"] and "≠ resolved 9.17.0.29" in page[CUDNN_BY_HAND].text["cudnn"]
    assert page[CUDNN_BY_HAND].attention == "fail"
    assert page[HEALTHY].cells["cudnn"] == "pass" and "= resolved" in page[HEALTHY].text["cudnn"]


def test_the_difference_fails_the_cell_even_where_no_check_says_so():
    """The case the old report showed as 'Problems: -': a row whose checks all passed (or were
    not run) but whose cuDNN is not the resolved release."""
    row = copy.deepcopy(_rows(json.loads(RECORDED.read_text()))[CUDNN_BY_HAND])
    for check in row["validation"]["checks"]:
        check["status"] = "pass" if check["status"] == "fail" else check["status"]
    row["validation"]["failed"] = []
    assert cells(row)["cudnn"].status == "fail"
    assert attention(row) == "fail"
    # one line for the component, not one per package of the drift's pending list
    assert len(row["drift"]["pending"]) == 3
    assert upgrades(row) == ["cuDNN 9.16.0.29 -> 9.17.0.29"]
    row.pop("versions")  # an older row: the pending list, shortened
    assert upgrades(row) == ["libcudnn9-cuda-13 9.16.0.29", "libcudnn9-dev-cuda-13 9.16.0.29",
                             "libcudnn9-headers-cuda-13 9.16.0.29"]


def test_a_driver_mismatch_fails_the_driver_cell_and_a_reboot_is_pending(doc):
    page = {r.host: r for r in _page(doc).rows}
    dev = page[DEV]
    assert dev.state == "mismatch-pending" and dev.attention == "fail"
    assert dev.cells["driver"] == "fail"
    assert "535.309.01" in dev.text["driver"] and "≠ loaded 535.247.01" in dev.text["driver"]
    assert dev.cells["kernel"] == "pending" and "reboot pending" in dev.text["kernel"]
    # CUDA and cuDNN are none on the dev tier (they come with the containers): a skip, not a pass
    assert dev.cells["cuda"] == dev.cells["cudnn"] == "skip"


def test_a_driver_behind_the_inventory_warns_with_the_difference_marked(doc):
    """All.py leaves a driver upgrade to tools/rollout: the gate warns, so does the cell; the
    resolved version is still shown as different."""
    row = copy.deepcopy(_rows(doc)[HEALTHY])
    row["versions"]["driver"] = row["driver_installed"] = row["driver_loaded"] = "580.95.05"
    for check in row["validation"]["checks"]:
        if check["name"] == "the loaded driver = the installed driver = the resolved driver":
            check["status"] = "warn"
    driver = cells(row)["driver"]
    assert (driver.status, driver.differs, driver.resolved) == ("warn", True, "580.126.09")
    assert attention(row) == "warn"
    assert upgrades(row) == ["Driver 580.95.05 -> 580.126.09"]


def test_one_version_per_component_and_no_package_twice(doc):
    page = {r.host: r for r in _page(doc).rows}
    healthy = page[HEALTHY]
    # the old cell: every cuda-toolkit* package with its version, config-common ones included
    before = {k: v for k, v in _rows(doc)[HEALTHY].items() if k != "versions"}
    assert "cuda-toolkit-13-0-config-common 13.0.3-1" in cell(before, "cuda")
    main = healthy.text["cuda"].split("=")[0].split()
    assert main == ["✓", "pass", "13.0.2"], healthy.text["cuda"]
    for name in _rows(doc)[HEALTHY]["packages"]["cuda"]:
        assert healthy.text["cuda"].count(name + " ") == 1, (name, healthy.text["cuda"])
    assert cell(_rows(doc)[HEALTHY], "cuda") == "13.0.2"
    assert cell(_rows(doc)[CUDNN_BY_HAND], "cudnn") == "9.16.0.29 (resolved 9.17.0.29)"


def test_component_versions_from_installed_packages_and_a_real_resolution():
    settings = {"driver_source": "nvidia", "driver_branch": "580", "driver_version": "auto", "driver_flavour": "auto",
                "cuda_version": "13.0", "cuda_driver_compat": "toolkit", "cudnn_version": "9.17.0",
                "clock_policy": "default"}
    res = resolve(["0x20b0"] * 4, settings, "debian-12")  # 4 x A100, as the research tier
    pkgs = {"cuda-toolkit-13-0": "13.0.2-1", "cuda-toolkit-13-0-config-common": "13.0.3-1",
            "cuda-toolkit-13-config-common": "13.0.3-1", "cuda-toolkit-config-common": "13.0.96-1",
            "cuda-toolkit-12-8": "12.8.1-1",  # an older toolkit left behind: not the resolved one
            "libcudnn9-cuda-13": "9.16.0.29-1", "libcudnn9-dev-cuda-13": "9.16.0.29-1",
            "libcudnn9-headers-cuda-13": "9.16.0.29-1", "nvidia-container-toolkit": "1.18.0-1",
            "nvidia-open": "580.126.09-1", "cuda-drivers": None, "docker-ce": None}
    installed, resolved, packages = component_versions(pkgs, "580.126.09", res, "1.18.0-1")
    assert installed == {"driver": "580.126.09", "cuda": "13.0.2", "cudnn": "9.16.0.29", "container_toolkit": "1.18.0-1"}
    assert resolved == {"driver": res.driver_version, "cuda": "13.0.2", "cudnn": "9.17.0.29", "container_toolkit": "1.18.0-1"}
    assert list(packages["cuda"]) == sorted(n for n in pkgs if n.startswith("cuda-toolkit"))
    assert packages["driver"] == {"nvidia-open": "580.126.09-1"} and packages["docker"] == {}
    # nothing resolves (no GPU): the installed toolkits are still read, none is wanted
    installed, resolved, _ = component_versions(pkgs, None, None, "1.18.0-1")
    assert installed["cuda"] == "12.8.1 + 13.0.2" and set(resolved.values()) == {None}
    # the old text field never names a package twice
    assert _versions({"a-x": "1", "a-y": "2"}, ("a-",)) == "a-x 1, a-y 2"


def test_hosts_that_need_attention_come_first(doc):
    assert [r.host for r in _page(doc).rows] == [DEV, CUDNN_BY_HAND, SICK, GHOST, HGX, HEALTHY]
    # the JSON keeps inventory order
    assert [r["host"] for r in doc["hosts"]] == [DEV, CUDNN_BY_HAND, HEALTHY, SICK, HGX, GHOST]
    # fail > warn > pending > ok, inventory order within each
    base = _rows(doc)[HEALTHY]
    pending = copy.deepcopy(base) | {"host": "pending"}
    pending["drift"] = {**base["drift"], "changes": 2, "operations": ["Base system | Install", "Tuning | Write"]}
    warn = copy.deepcopy(_rows(doc)[HGX]) | {"host": "warn"}
    ok1, ok2 = base | {"host": "ok1"}, base | {"host": "ok2"}
    failing = copy.deepcopy(_rows(doc)[GHOST]) | {"host": "failing"}
    rows = [ok1, pending, warn, ok2, failing]
    assert [attention(r) for r in rows] == ["ok", "pending", "warn", "ok", "fail"]
    assert [r["host"] for r in ordered(rows)] == ["failing", "warn", "pending", "ok1", "ok2"]
    assert [r.host for r in _page(document(rows, "inv.py", 1.0)).rows] == ["failing", "warn", "pending", "ok1", "ok2"]


def test_fleet_summary_counts(doc):
    summary = fleet_summary(doc["hosts"])
    assert summary == {
        "attention": {"fail": 4, "warn": 1, "pending": 0, "ok": 1},
        "tiers": {"research": 4, "dev": 1, "hgx": 1},
        "versions": {"driver": {"580.126.09": 4, "535.309.01": 1, "unknown": 1},
                     "cuda": {"13.0.2": 4, "none": 1, "unknown": 1},
                     "cudnn": {"9.17.0.29": 3, "9.16.0.29": 1, "none": 1, "unknown": 1},
                     "container_toolkit": {"1.18.0-1": 5, "unknown": 1}},
        "upgrades_pending": [CUDNN_BY_HAND],
        "reboots_pending": [DEV],
        "health_action": [SICK],
    }
    page = _page(doc)
    assert page.counts == {"hosts": 6, "fail": 4, "warn": 1, "pending": 0, "ok": 1, "upgrades": 1, "reboots": 1,
                           "health": 1}
    assert page.versions == summary["versions"] and page.tiers == summary["tiers"]
    assert 'data-version="9.16.0.29" data-hosts="1" data-differ="1"' in html_page(doc)
    # per tier: the tiers resolve different versions
    assert version_rows(doc["hosts"], "cudnn") == [
        ("9.17.0.29", 3, 0, {"research": 2, "hgx": 1}), ("9.16.0.29", 1, 1, {"research": 1}),
        ("none", 1, 0, {"dev": 1}), ("unknown", 1, 0, {"research": 1})]
    assert version_rows(doc["hosts"], "driver")[1] == ("535.309.01", 1, 0, {"dev": 1})


def test_a_report_from_before_the_new_fields_still_renders(doc):
    old = copy.deepcopy(doc)
    old["summary"] = {k: old["summary"][k] for k in ("hosts", "states")}
    for row in old["hosts"]:
        for key in ("versions", "resolved", "packages", "resolved_error"):
            row.pop(key, None)
    page = _page(old)
    assert len(page.rows) == 6 and page.counts["hosts"] == 6
    by = {r.host: r for r in page.rows}
    assert by[CUDNN_BY_HAND].cells["cudnn"] == "info" and "9.16.0.29" in by[CUDNN_BY_HAND].text["cudnn"]
    assert by[DEV].cells["driver"] == "info" and by[DEV].attention == "fail"  # the mismatch flag is older
    assert page.versions["cudnn"] == {"unknown": 6}


def test_the_page_is_self_contained_and_escapes_host_text(doc):
    page = html_page(doc)
    assert "<style>" in page
    for external in ("<script", "src=", "<link", "url(", "@import"):
        assert external not in page, external
    # the one kind of link: each exporter's endpoint, to follow, never loaded by the page
    links = re.findall(r"<a [^>]*>", page)
    assert links and all(re.fullmatch(r'<a class="endpoint" href="http://[^"]+/metrics" title="[^"]*">', a) for a in links)
    evil = copy.deepcopy(doc)
    evil["hosts"][0]["validation"]["checks"][0].update(status="fail", message="<img src=x onerror=alert(1)>")
    evil["hosts"][0]["host"] = '"><script>alert(1)</script>'
    text = html_page(evil)
    assert "<script>alert" not in text and "<img src=x" not in text
    assert "&lt;img src=x onerror=alert(1)&gt;" in text


def test_a_gpu_to_act_on_fails_the_health_cell_and_counts_in_the_summary(doc):
    """The recorded host whose GPU 2 has a row remap pending (gpusimctl fault): a reset to do."""
    row = _rows(doc)[SICK]
    cell = cells(row)["health"]
    assert cell.status == "fail" and "GPU 2 (00000000:00:08.0): reset" in cell.note
    assert cells(_rows(doc)[HEALTHY])["health"].status == "pass"
    assert fleet_summary(doc["hosts"])["health_action"] == [SICK]
    assert attention(row) == "fail"
    page = {r.host: r for r in _page(doc).rows}
    assert page[SICK].cells["health"] == "fail" and "row remap is pending" in page[SICK].text["health"]
    assert _page(document([row], "inv.py", 1.0)).counts["health"] == 1


def test_the_pytorch_cell_names_the_build(doc):
    by = {h: cells(r)["pytorch"] for h, r in _rows(doc).items()}
    assert (by[HEALTHY].status, by[HEALTHY].text) == ("pass", "2.11.0+cu128")
    assert (by[HGX].status, by[HGX].text) == ("pass", "2.11.0+cu126")
    assert (by[CUDNN_BY_HAND].status, by[CUDNN_BY_HAND].text) == ("skip", "none")  # python3 imports no torch
    assert by[GHOST].status == "none"
    # the check's whole message stays, folded away
    assert any("runs on NVIDIA A100-SXM4-40GB (8.0)" in line for line in by[HEALTHY].details)
    # an older row without the check: its text field
    old = {"status": "ok", "pytorch": "fail: torch 2.13.0+cpu (/usr/lib/python3/torch) is a CPU-only build"}
    assert (cells(old)["pytorch"].status, cells(old)["pytorch"].text) == ("fail", "2.13.0+cpu")


def test_problem_lines_are_labelled_by_what_is_wrong_each_once(doc):
    rows = _rows(doc)
    # the CUDA/cuDNN check belongs to the driver area; the line says cuDNN
    by_hand = problems(rows[CUDNN_BY_HAND])
    assert [(p["status"], p["label"]) for p in by_hand] == [("fail", "cuDNN")]
    assert rows[CUDNN_BY_HAND]["validation"]["failed"][0].startswith("cuDNN: the CUDA toolkit and cuDNN are")
    # a loaded driver that is not the installed one fails two checks; one line says it
    dev_checks = [c["name"] for c in rows[DEV]["validation"]["checks"] if c["status"] == "fail"]
    assert dev_checks == [MISMATCH_CHECK, DRIVER_CHECK]
    assert [(p["label"], p["name"]) for p in problems(rows[DEV])] == [("driver", MISMATCH_CHECK)]
    assert [p["label"] for p in problems(rows[SICK])] == ["GPU health"]
    assert [(p["status"], p["label"]) for p in problems(rows[HGX])] == [("warn", "hardware")]
    # failures before warnings, and no check twice in the folded list
    row = copy.deepcopy(rows[HGX])
    stack = next(c for c in row["validation"]["checks"] if c["name"] == STACK_CHECK)
    stack.update(status="fail", message="m")
    assert [p["status"] for p in problems(row)] == ["fail", "warn"]
    cell = cells(row)["problems"]
    assert not any(STACK_CHECK in line or "the hardware matches" in line for line in cell.details)
    page = {r.host: r for r in _page(doc).rows}
    assert page[CUDNN_BY_HAND].text["problems"].count("the CUDA toolkit and cuDNN are the resolved releases") == 1
    assert "driver: the CUDA toolkit" not in page[CUDNN_BY_HAND].text["problems"]


def test_the_column_checks_are_the_gates_names():
    from gpufleet.checks import validation

    assert CHECK_OF["health"] == validation.HEALTH_CHECK and CHECK_OF["pytorch"] == validation.PYTORCH_CHECK
    names = {name for name in vars(validation).values() if isinstance(name, str)}
    source = "".join(path.read_text() for path in Path(validation.__file__).parent.glob("*.py"))  # the area modules
    for name in (*CHECK_OF.values(), STACK_CHECK, KERNEL_CHECK, DRIVER_CHECK, MISMATCH_CHECK):
        assert name in names or f'"{name}"' in source, name


def test_a_host_all_py_refuses_is_failed(doc):
    row = copy.deepcopy(_rows(doc)[HEALTHY])
    assert attention(row) == "ok"
    row["drift"]["error"] = REFUSED
    assert cells(row)["drift"].status == "fail" and attention(row) == "fail"


def test_a_pending_profiling_setting_shows_in_the_tuning_cell_and_warns_it(doc):
    """The gate's profiling check (tuning_profiling) in the report: its line in the tuning cell, its
    WARN the cell's status; the row's field matches the schema."""
    row = copy.deepcopy(_rows(doc)[HEALTHY])
    name = "GPU performance counters are for whom tuning_profiling says"
    message = ("PENDING: the loaded nvidia module gives them to admins only (RmProfilingAdminOnly 1); "
               "tuning_profiling: users takes effect at its next load")
    row["profiling"] = f"warn: {message}"
    row["validation"]["checks"].append({"area": "tuning", "name": name, "status": "warn", "message": message,
                                        "fix": "tools/rollout INVENTORY reboots it through the gate"})
    cell = cells(row)["tuning"]
    assert cell.status == "warn" and f"profiling warn: {message}" in cell.text
    validate(document([row], "inv.py", 1.0), json.loads(SCHEMA_PATH.read_text()))
