"""The HTML fleet report in a real browser: headless Chromium (Debian's package) renders reports
of the recorded sandbox fleet (tests/fixtures/report/, recorded by testing/report_fixture.py
with the current report code: 3 of its hosts, and its 6 repeated to 20), takes screenshots and
reads back what it laid out (testing/chromium.layout: the live DOM, innerText, boxes). No test
host is needed; chromium is (skipped without it on a developer's machine, a failure in CI or
under tools/test: tools/bootstrap installs it).

The screenshots and pages are test artefacts: $GPUFLEET_ARTEFACTS/report/ when set, else
artefacts/report/ in pytest's base temporary folder (printed; pytest keeps the last three).
GPUFLEET_REPORT_SCREENSHOT=docs/report.png keeps the picture of the whole recording (the
README's)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpufleet.apps.report.render import html_page
from gpufleet.apps.report.view import ATTENTION, fleet_summary
from testing import chromium
from testing.report_fixture import recorded_document

pytestmark = pytest.mark.e2e

DEV, CUDNN_BY_HAND, SICK, GHOST, HGX, HEALTHY = (
    "gf-htmlreport-1", "gf-htmlreport-2", "gf-htmlreport-5", "gf-htmlreport-ghost", "gf-htmlreport-3", "gf-htmlreport-4")
# what the recording's changes make of each host (tests/fixtures/report/README.md), independent
# of the report code: a mismatch, a cuDNN by hand, a GPU to reset, no answer; too few GPUs; fine
EXPECTED = {DEV: "fail", CUDNN_BY_HAND: "fail", SICK: "fail", GHOST: "fail", HGX: "warn", HEALTHY: "ok"}
SCREEN = (1920, 1080)


def _recorded(name: str) -> str:
    """The recorded host a row of a repeated report stands for ('gf-htmlreport-2-b' -> -2)."""
    return next(h for h in sorted(EXPECTED, key=len, reverse=True) if name == h or name.startswith(h + "-"))


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory) -> Path:
    where = Path(os.environ.get("GPUFLEET_ARTEFACTS") or tmp_path_factory.getbasetemp() / "artefacts") / "report"
    where.mkdir(parents=True, exist_ok=True)
    return where


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, artefacts):
    """name -> {doc, page, shot, layout, report}: 3 recorded hosts (inventory order: fail, ok,
    warn), 20, and the whole recording (6)."""
    browser = chromium.require()
    out = tmp_path_factory.mktemp("report-browser")
    docs = {"3-hosts": recorded_document(names=(DEV, HEALTHY, HGX)), "20-hosts": recorded_document(20),
            "recorded": recorded_document()}
    got = {}
    for name, doc in docs.items():
        work = out / name
        work.mkdir()
        page = work / "fleet-report.html"
        page.write_text(html_page(doc))
        shot, dom = chromium.render(page, work, width=SCREEN[0], height=SCREEN[1], browser=browser)
        keep = artefacts / f"report-{name}.png"
        shutil.copy(shot, keep)
        shutil.copy(page, artefacts / f"report-{name}.html")
        print(f"screenshot: {keep}")
        got[name] = {"doc": doc, "page": page, "shot": keep, "out": work, "browser": browser,
                     "layout": chromium.layout(page, work, *SCREEN, browser=browser),
                     "report": chromium.parse_report(dom)}
    wanted = os.environ.get("GPUFLEET_REPORT_SCREENSHOT")
    if wanted:  # the whole recording, as high as its rows need
        doc = got["recorded"]
        bottom = max(r["top"] + r["height"] for r in doc["layout"]["rows"])
        shot, _ = chromium.render(doc["page"], doc["out"], width=SCREEN[0], height=int(bottom) + 16, browser=browser)
        shutil.copy(shot, wanted)
    return got


def test_the_screenshots_are_the_rendered_pages(rendered, artefacts):
    for name in ("3-hosts", "20-hosts"):
        shot = rendered[name]["shot"]
        assert shot.parent == artefacts and shot.exists()
        assert chromium.png_size(shot) == SCREEN
        assert shot.stat().st_size > 40_000, f"{shot}: {shot.stat().st_size} bytes, a blank page?"
    # 20 hosts paint more than 3
    assert rendered["20-hosts"]["shot"].stat().st_size > rendered["3-hosts"]["shot"].stat().st_size


@pytest.mark.parametrize("name", ["3-hosts", "20-hosts", "recorded"])
def test_the_worst_hosts_come_first(rendered, name):
    """In the laid-out table: failed (a mismatch, cuDNN by hand, a GPU to act on, unreachable)
    before warnings before ok, each host where its recorded state puts it, inventory order
    within each level."""
    rows = rendered[name]["layout"]["rows"]
    inventory = [r["host"] for r in rendered[name]["doc"]["hosts"]]
    assert sorted(r["host"] for r in rows) == sorted(inventory)
    assert [r["attention"] for r in rows] == [EXPECTED[_recorded(r["host"])] for r in rows]
    ranks = [ATTENTION.index(r["attention"]) for r in rows]
    assert ranks == sorted(ranks)
    tops = [r["top"] for r in rows]
    assert tops == sorted(tops)  # the document order is the order on screen
    for level in ATTENTION:
        shown = [r["host"] for r in rows if r["attention"] == level]
        assert shown == [h for h in inventory if h in shown]
    if name == "3-hosts":
        assert [r["host"] for r in rows] == [DEV, HGX, HEALTHY]


def test_health_and_pytorch_cells_as_the_browser_shows_them(rendered):
    by = {r["host"]: r["cells"] for r in rendered["recorded"]["layout"]["rows"]}
    # GPU 2 of gf-htmlreport-5 has a row remap pending: a reset to do
    assert by[SICK]["health"]["status"] == "fail"
    assert "fail" in by[SICK]["health"]["text"] and "GPU 2 (00000000:00:08.0): reset" in by[SICK]["health"]["text"]
    assert by[HEALTHY]["health"]["status"] == "pass" and "ok" in by[HEALTHY]["health"]["text"]
    # the PyTorch build each host's python3 imports (testing/torch_standin.py's recorded builds)
    assert by[HEALTHY]["pytorch"]["status"] == by[HGX]["pytorch"]["status"] == "pass"
    assert "2.11.0+cu128" in by[HEALTHY]["pytorch"]["text"] and "2.11.0+cu126" in by[HGX]["pytorch"]["text"]
    assert by[CUDNN_BY_HAND]["pytorch"]["status"] == "skip" and "none" in by[CUDNN_BY_HAND]["pytorch"]["text"]
    assert by[GHOST]["pytorch"]["status"] == by[GHOST]["health"]["status"] == "none"
    assert by[GHOST]["pytorch"]["text"].strip() == ""
    # the first lines of these cells are whole, not cut
    for host in (SICK, HEALTHY, HGX, CUDNN_BY_HAND):
        for key in ("pytorch", "health", "ssh_hardening", "firewall", "host"):
            assert not by[host][key]["cut"], (host, key, by[host][key])


def test_fifteen_and_more_hosts_fit_a_1920_by_1080_screen(rendered):
    layout = rendered["20-hosts"]["layout"]
    assert layout["viewport"] == {"width": 1920, "height": 1080}
    rows, screen = layout["rows"], layout["viewport"]["height"]
    on_first = [r for r in rows if r["top"] + r["height"] <= screen]
    assert len(on_first) >= 15, [(r["host"], r["top"], r["height"]) for r in rows]
    # scrolled, under the sticky heading: whatever a host says, a row is two lines high
    tallest = max(r["height"] for r in rows)
    assert tallest <= 2 * layout["line"] + 8, tallest
    assert (screen - layout["head"]["height"]) // tallest >= 15
    # one line per part of a cell: the SSH column's "ok" is on one line, not a letter a line
    for row in rows:
        for key, cell in row["cells"].items():
            assert cell["tallest"] <= layout["line"] + 1, (row["host"], key, cell)
        assert row["cells"]["ssh_hardening"]["width"] >= 50


def test_the_summary_counts_the_fleet(rendered):
    report, doc = rendered["recorded"]["report"], rendered["recorded"]["doc"]
    expected = fleet_summary(doc["hosts"])
    assert report.counts == {"hosts": 6, "fail": 4, "warn": 1, "pending": 0, "ok": 1, "upgrades": 1, "reboots": 1,
                             "health": 1}
    assert report.versions == expected["versions"]
    assert report.versions["cudnn"] == {"9.17.0.29": 3, "9.16.0.29": 1, "none": 1, "unknown": 1}
    assert report.tiers == {"research": 4, "dev": 1, "hgx": 1}
    by = {r.host: r for r in report.rows}
    # cuDNN 9.16.0.29 by hand where the tier resolves 9.17.0.29; the loaded driver is not the installed one
    assert by[CUDNN_BY_HAND].cells["cudnn"] == "fail"
    assert "9.16.0.29" in by[CUDNN_BY_HAND].text["cudnn"] and "≠ resolved 9.17.0.29" in by[CUDNN_BY_HAND].text["cudnn"]
    assert by[DEV].cells["driver"] == "fail" and "≠ loaded 535.247.01" in by[DEV].text["driver"]
    assert by[HEALTHY].cells["cudnn"] == by[HEALTHY].cells["driver"] == "pass"
    assert by[HEALTHY].cells["firewall"] == "skip"  # a skip, not a pass


def test_statuses_differ_by_colour_and_by_symbol(rendered):
    doc = rendered["recorded"]
    styles = chromium.computed_styles(doc["page"], doc["out"], browser=doc["browser"])
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
    import json

    from gpufleet.apps.report.render import document
    from tests.unit.test_report_clocks import BUS, FakeHost, _row, as_r595, column, recorded_580

    rows = [_row("app-at-plan", column(FakeHost(recorded_580()), "max")),
            _row("locked-off-plan", column(FakeHost(as_r595(recorded_580()), [f"{BUS[0]} 3201,1785"]), "max"))]
    page = tmp_path / "fleet-report.html"
    page.write_text(html_page(json.loads(json.dumps(document(rows, "inventory.py", 1.0)))))
    laid = {r["host"]: r for r in chromium.layout(page, tmp_path, browser=chromium.require())["rows"]}
    _, dom = chromium.render(page, tmp_path, browser=chromium.require())
    by = {r.host: r for r in chromium.parse_report(dom).rows}
    assert by["locked-off-plan"].host == chromium.parse_report(dom).rows[0].host  # the failing host first
    assert by["locked-off-plan"].cells["tuning"] == "fail"
    assert "locked clocks 3201,1785 / none ≠ planned 3201,1980" in by["locked-off-plan"].text["tuning"]
    assert by["app-at-plan"].cells["tuning"] == "info"
    assert "application clocks 3201,1980 = planned" in by["app-at-plan"].text["tuning"]
    # the cell's two lines (persistence, clocks) on one line, joined by the page's own separator
    assert "persistence on · application clocks 3201,1980" in laid["app-at-plan"]["cells"]["tuning"]["text"]
