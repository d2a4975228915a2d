"""Headless Chromium for the tests of the HTML fleet report: a screenshot and the DOM the
browser built, from Debian's `chromium` package alone (no driver, no npm, no extra Python).

    shot, dom = chromium.render(page, tmp_path)    # PNG path, serialized DOM
    report = chromium.parse_report(dom)            # rows (host, attention, cell statuses), summary counts

A test calls `chromium.require()` first: it skips when chromium is missing on a developer's
machine, and fails in CI (CI=true) or wherever the whole suite must run (GPUFLEET_REQUIRE_E2E),
since tools/bootstrap installs it.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--hide-scrollbars", "--mute-audio")


def find() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require() -> str:
    """The browser's path; skips the test without one, except where it must run."""
    import pytest

    browser = find()
    if browser is None:
        reason = "chromium is not installed (apt-get install chromium; tools/bootstrap does)"
        if os.environ.get("CI", "").lower() in ("true", "1") or os.environ.get("GPUFLEET_REQUIRE_E2E"):
            pytest.fail(reason)
        pytest.skip(reason)
    return browser


def render(page: Path, out_dir: Path, width: int = 1400, height: int = 900,
           browser: str | None = None) -> tuple[Path, str]:
    """Screenshot `page` into out_dir/report.png and return it with the DOM chromium built.
    Each run gets its own profile directory, so nothing is shared with the user's browser."""
    browser = browser or require()
    url = page.resolve().as_uri()
    shot = out_dir / "report.png"
    common = [browser, *FLAGS, f"--window-size={width},{height}"]
    taken = subprocess.run([*common, f"--user-data-dir={out_dir / 'profile-shot'}", f"--screenshot={shot}", url],
                           capture_output=True, text=True, timeout=120)
    dom = subprocess.run([*common, f"--user-data-dir={out_dir / 'profile-dom'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    if not shot.exists() or dom.returncode != 0 or not dom.stdout:
        raise AssertionError(f"chromium failed: screenshot rc {taken.returncode}, dump-dom rc {dom.returncode}\n"
                             f"{taken.stderr[-2000:]}\n{dom.stderr[-2000:]}")
    return shot, dom.stdout


# A page that loads the report in a frame and writes, per cell status, the first cell's computed
# background colour and status symbol into its own DOM (read back with --dump-dom). The report
# itself carries no script; this one lives only in the test's tmp dir.
PROBE = """<!DOCTYPE html><html><body>
<iframe id="f" src="REPORT" style="width: 1400px; height: 900px"></iframe>
<script>
document.getElementById("f").addEventListener("load", () => {
  const d = document.getElementById("f").contentDocument, out = {};
  for (const td of d.querySelectorAll("#fleet td[data-status]:not(.c-host)")) {
    const s = td.dataset.status, mark = td.querySelector(".mark");
    if (!(s in out)) out[s] = {background: getComputedStyle(td).backgroundColor,
                               mark: mark ? mark.textContent : "", markColor: mark ? getComputedStyle(mark).color : ""};
  }
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script></body></html>
"""


def computed_styles(page: Path, out_dir: Path, browser: str | None = None) -> dict[str, dict[str, str]]:
    """status -> {background, mark, markColor} of the first table cell with that status, as
    chromium computed them (the page must sit in out_dir)."""
    import html
    import json
    import re

    browser = browser or require()
    probe = out_dir / "probe.html"
    probe.write_text(PROBE.replace("REPORT", page.name))
    dom = subprocess.run([browser, *FLAGS, "--allow-file-access-from-files", f"--user-data-dir={out_dir / 'profile-probe'}",
                          "--dump-dom", probe.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom.stdout, re.S)
    if not found:
        raise AssertionError(f"the probe page wrote nothing (rc {dom.returncode}): {dom.stderr[-2000:]}")
    return json.loads(html.unescape(found.group(1)))


# A page that loads the report in a frame of the screen's size and writes what chromium laid out
# into its own DOM (read back with --dump-dom): per host row, in document order, its attention,
# where it sits, and per cell its status, the text a reader sees (innerText: folded details left
# out), whether its first line is cut and how high its parts (.l1, .l2) are. The report itself carries no
# script; this one lives only in the test's tmp dir.
LAYOUT = """<!DOCTYPE html><html><body style="margin: 0">
<iframe id="f" src="REPORT" style="border: 0; display: block; width: WIDTHpx; height: HEIGHTpx"></iframe>
<script>
document.getElementById("f").addEventListener("load", () => {
  const w = document.getElementById("f").contentWindow, d = w.document;
  const head = d.querySelector("#fleet thead").getBoundingClientRect();
  const rows = [...d.querySelectorAll("#fleet tbody tr")].map(tr => {
    const box = tr.getBoundingClientRect(), cells = {};
    for (const td of tr.querySelectorAll("td")) {
      const key = [...td.classList].find(c => c.startsWith("c-")).slice(2), first = td.querySelector(".l1");
      const lines = [...td.querySelectorAll(".l1, .l2")].map(e => e.getBoundingClientRect().height);
      cells[key] = {status: td.dataset.status, text: td.innerText, width: td.getBoundingClientRect().width,
                    cut: first ? first.scrollWidth > first.clientWidth : false, tallest: Math.max(0, ...lines)};
    }
    return {host: tr.dataset.host, attention: tr.dataset.attention, top: box.top, height: box.height, cells};
  });
  const pre = document.createElement("pre");
  pre.id = "layout";
  pre.textContent = JSON.stringify({viewport: {width: w.innerWidth, height: w.innerHeight},
                                    head: {top: head.top, height: head.height},
                                    line: parseFloat(w.getComputedStyle(d.body).lineHeight), rows});
  document.body.appendChild(pre);
});
</script></body></html>
"""


def layout(page: Path, out_dir: Path, width: int = 1920, height: int = 1080,
           browser: str | None = None) -> dict:
    """What chromium laid out for the report `page` (in out_dir) on a width x height screen (the
    frame's viewport; the window is made larger so that the frame fits it whole):
    {viewport, head, line, rows: [{host, attention, top, height, cells: {key: {status, text,
    width, cut, tallest}}}]} (see LAYOUT; `tallest`: the highest of the cell's one-line parts)."""
    import html
    import json
    import re

    browser = browser or require()
    probe = out_dir / f"layout-{page.stem}.html"
    probe.write_text(LAYOUT.replace("REPORT", page.name).replace("WIDTH", str(width)).replace("HEIGHT", str(height)))
    dom = subprocess.run([browser, *FLAGS, "--allow-file-access-from-files", f"--window-size={width},{height + 200}",
                          f"--user-data-dir={out_dir / 'profile-layout'}", "--dump-dom", probe.resolve().as_uri()],
                         capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom.stdout, re.S)
    if not found:
        raise AssertionError(f"the layout page wrote nothing (rc {dom.returncode}): {dom.stderr[-2000:]}")
    return json.loads(html.unescape(found.group(1)))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise AssertionError(f"{path} is not a PNG")
    return struct.unpack(">II", data[16:24])


@dataclass
class Row:
    host: str
    state: str
    attention: str
    cells: dict[str, str] = field(default_factory=dict)  # column key -> data-status
    text: dict[str, str] = field(default_factory=dict)  # column key -> visible text (details included)


@dataclass
class Report:
    rows: list[Row]
    counts: dict[str, int]  # summary tiles: data-count -> number
    versions: dict[str, dict[str, int]]  # component -> version -> hosts (summary cards)
    tiers: dict[str, int]


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: list[Row] = []
        self.counts: dict[str, int] = {}
        self.versions: dict[str, dict[str, int]] = {}
        self.tiers: dict[str, int] = {}
        self._cell: str | None = None
        self._tile: str | None = None
        self._card: str | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        classes = (a.get("class") or "").split()
        if tag == "tr" and "data-host" in a:
            self.rows.append(Row(a["data-host"], a.get("data-state", ""), a.get("data-attention", "")))
        elif tag == "td" and self.rows and "data-status" in a:
            key = next((c[2:] for c in classes if c.startswith("c-")), "")
            self._cell = key
            self.rows[-1].cells[key] = a["data-status"]
            self.rows[-1].text[key] = ""
        elif tag == "div" and "data-count" in a:
            self._tile = a["data-count"]
        elif tag == "div" and self._tile and "n" in classes:
            self.counts[self._tile] = -1  # filled by the text
        elif tag == "div" and (a.get("id") or "").startswith("versions-"):
            self._card = a["id"][len("versions-"):]
            self.versions[self._card] = {}
        elif tag == "li" and "data-version" in a and self._card:
            self.versions[self._card][a["data-version"]] = int(a["data-hosts"])
        elif tag == "li" and "data-tier" in a:
            self.tiers[a["data-tier"]] = int(a["data-hosts"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._cell = None
        elif tag == "ul":
            self._card = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None and self.rows and data.strip():
            # the words as a reader sees them: one space between elements
            self.rows[-1].text[self._cell] = " ".join([*self.rows[-1].text[self._cell].split(), *data.split()])
        if self._tile and self.counts.get(self._tile) == -1 and data.strip():
            self.counts[self._tile] = int(data.strip())
            self._tile = None


def parse_report(dom: str) -> Report:
    parser = _Parser()
    parser.feed(dom)
    return Report(parser.rows, parser.counts, parser.versions, parser.tiers)
