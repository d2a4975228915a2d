"""The HTML fleet report in a real browser: headless Chromium (Debian's package) renders the
report of the recorded sandbox fleet (tests/fixtures/report/), takes a screenshot and dumps the
DOM it built. No test host is needed; chromium is (skipped without it on a developer's
machine, a failure in CI or under tools/test: tools/bootstrap installs it).

GPUFLEET_REPORT_SCREENSHOT=docs/report.png keeps the screenshot (the README's picture)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gpufleet.apps.report.render import html_page
from gpufleet.apps.report.view import fleet_summary
from testing import chromium

pytestmark = pytest.mark.e2e

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "report" / "sandbox-fleet.json"
DEV, CUDNN_BY_HAND, GHOST, HGX, HEALTHY = (
    "gf-htmlreport-1", "gf-htmlreport-2", "gf-htmlreport-ghost", "gf-htmlreport-3", "gf-htmlreport-4")


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    browser = chromium.require()
    out = tmp_path_factory.mktemp("report-browser")
    doc = json.loads(RECORDED.read_text())
    page = out / "fleet-report.html"
    page.write_text(html_page(doc))
    shot, dom = chromium.render(page, out, width=1400, height=1000, browser=browser)
    keep = os.environ.get("GPUFLEET_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    print(f"screenshot: {shot}")
    return {"doc": doc, "shot": shot, "report": chromium.parse_report(dom), "page": page, "out": out,
            "browser": browser}


def test_the_screenshot_is_the_rendered_page(rendered):
    assert chromium.png_size(rendered["shot"]) == (1400, 1000)
    size = rendered["shot"].stat().st_size
    assert size > 40_000, f"screenshot suspiciously small ({size} bytes): a blank page?"


def test_the_mismatched_hosts_are_failed_and_listed_first(rendered):
    rows = rendered["report"].rows
    assert [r.host for r in rows] == [DEV, CUDNN_BY_HAND, GHOST, HGX, HEALTHY]
    by = {r.host: r for r in rows}
    # cuDNN 9.16.0.29 by hand where the tier resolves 9.17.0.29
    assert by[CUDNN_BY_HAND].cells["cudnn"] == "fail"
    assert "9.16.0.29" in by[CUDNN_BY_HAND].text["cudnn"] and "≠ resolved 9.17.0.29" in by[CUDNN_BY_HAND].text["cudnn"]
    # the loaded driver module is not the installed one
    assert by[DEV].cells["driver"] == "fail" and "≠ loaded 535.247.01" in by[DEV].text["driver"]
    failing = [i for i, r in enumerate(rows) if r.attention == "fail"]
    assert failing == list(range(len(failing))) and {rows[i].host for i in failing} == {DEV, CUDNN_BY_HAND, GHOST}
    # the same cells on the healthy host pass; its firewall check is a skip, not a pass
    assert by[HEALTHY].cells["cudnn"] == by[HEALTHY].cells["driver"] == "pass"
    assert by[HEALTHY].cells["firewall"] == "skip"


def test_the_summary_counts_the_fleet(rendered):
    report, doc = rendered["report"], rendered["doc"]
    expected = fleet_summary(doc["hosts"])
    assert report.counts == {"hosts": 5, "fail": 3, "warn": 1, "pending": 0, "ok": 1, "upgrades": 1, "reboots": 1,
                             "health": 0}
    assert report.versions == expected["versions"]
    assert report.versions["cudnn"] == {"9.17.0.29": 2, "9.16.0.29": 1, "none": 1, "unknown": 1}
    assert report.tiers == {"research": 3, "dev": 1, "hgx": 1}


def test_statuses_differ_by_colour_and_by_symbol(rendered):
    styles = chromium.computed_styles(rendered["page"], rendered["out"], browser=rendered["browser"])
    shown = {s: styles[s] for s in ("pass", "warn", "fail", "skip", "pending")}
    backgrounds = {s: v["background"] for s, v in shown.items()}
    colours = {s: v["markColor"] for s, v in shown.items()}
    symbols = {s: v["mark"] for s, v in shown.items()}
    assert len(set(backgrounds.values())) == 5, backgrounds
    assert len(set(colours.values())) == 5, colours
    assert len(set(symbols.values())) == 5 and "" not in symbols.values(), symbols


def test_the_clocks_cell_shows_applied_beside_planned(tmp_path):
    """The clocks column of rows built from the recorded H200 output (tests/unit/test_report_clocks.py):
    application clocks at their plan, locked clocks off it, as the browser shows them."""
    from gpufleet.apps.report.render import document
    from tests.unit.test_report_clocks import BUS, FakeHost, _row, as_r595, column, recorded_580

    rows = [_row("app-at-plan", column(FakeHost(recorded_580()), "max")),
            _row("locked-off-plan", column(FakeHost(as_r595(recorded_580()), [f"{BUS[0]} 3201,1785"]), "max"))]
    page = tmp_path / "fleet-report.html"
    page.write_text(html_page(json.loads(json.dumps(document(rows, "inventory.py", 1.0)))))
    _, dom = chromium.render(page, tmp_path, browser=chromium.require())
    by = {r.host: r for r in chromium.parse_report(dom).rows}
    assert by["locked-off-plan"].host == chromium.parse_report(dom).rows[0].host  # the failing host first
    assert by["locked-off-plan"].cells["tuning"] == "fail"
    assert "locked clocks 3201,1785 / none ≠ planned 3201,1980" in by["locked-off-plan"].text["tuning"]
    assert by["app-at-plan"].cells["tuning"] == "info"
    assert "application clocks 3201,1980 = planned" in by["app-at-plan"].text["tuning"]
