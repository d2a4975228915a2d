"""End-to-end: the fleet report and the validation gate on 10 real test hosts in mixed states
(GPUs SIMULATED by testing/gpusim, a test double), plus an inventory entry nobody answers at.

    fresh        3 hosts gpufleet never touched (bookworm, trixie, bookworm + T4)
    provisioned  3 hosts all.py's steps were applied to (bookworm x2, trixie; GPU-less, so without
                 the driver and docker steps: tests/e2e/provision_without_gpu.py)
    changed      2 provisioned hosts changed by hand: marker edited / a tier package removed
    mismatch     1 T4 host whose loaded module (simulated /proc) differs from the installed NVML
    unreachable  1 host whose sshd was stopped + 1 inventory entry on an unused address
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from jsonschema import validate as validate_schema

from gpufleet.apps.report.render import SCHEMA_PATH
from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import REPO, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
LOADED, INSTALLED = "580.95.05", "580.126.09"


def _data(host) -> dict:
    return {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn"}


def _simulate_mismatch(host) -> None:
    """Installed user space 580.126.09 (its NVML library file), loaded module still 580.95.05."""
    proc = host.root / "usr/lib/gpusim/kernel/proc-driver/nvidia/version"
    text = proc.read_text()
    proc.write_text(re.sub(r"\b\d{3}\.\d+\.\d+\b", LOADED, text, count=1))
    lib = host.root / "usr/lib/x86_64-linux-gnu" / f"libnvidia-ml.so.{INSTALLED}"
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"")


@pytest.fixture(scope="module")
def fleet(hostpool, tmp_path_factory):
    plain = hostpool.get("report-bookworm", 6, release="bookworm")
    trixie = hostpool.get("report-trixie", 2, release="trixie")
    t4 = hostpool.get("report-t4", 2, gpu="t4")
    roles = {
        "provisioned": [plain[0], plain[1], trixie[0]],
        "changed-marker": [plain[2]],
        "changed-package": [plain[3]],
        "fresh": [plain[4], trixie[1], t4[0]],
        "mismatch": [t4[1]],
        "down": [plain[5]],
    }
    tmp = tmp_path_factory.mktemp("report")
    apply = roles["provisioned"] + roles["changed-marker"] + roles["changed-package"]
    inv = write_inventory(tmp / "provision.py", apply, data={h.name: _data(h) for h in apply})
    provision = pyinfra(inv, "tests/e2e/provision_without_gpu.py")
    assert provision.returncode == 0, provision.output[-6000:]

    testhosts.ssh(roles["changed-marker"][0], "sed -i 's/^tier: dev$/tier: research/' /etc/gpufleet/managed")
    testhosts.ssh(roles["changed-package"][0], "DEBIAN_FRONTEND=noninteractive apt-get remove -y -q tmux")
    _simulate_mismatch(roles["mismatch"][0])
    testhosts.ssh(roles["down"][0], "systemctl stop ssh.socket ssh.service", check=False)

    hosts = [h for group in roles.values() for h in group]
    inv_all = write_inventory(tmp / "fleet.py", hosts, data={h.name: _data(h) for h in hosts})
    # one more entry: an address in the pool's /24 that no host uses
    net = hosts[0].address.rsplit(".", 1)[0]
    ghost = {**hosts[0].pyinfra_data(), "ssh_hostname": f"{net}.250", **_data(hosts[0])}
    inv_all.write_text(inv_all.read_text() + f"\nghosts = [('gf-report-ghost', {ghost!r})]\n")
    roles["ghost"] = [testhosts.Host("gf-report-ghost", f"{net}.250", "bookworm", None, hosts[0].pool, hosts[0].ssh_key)]

    out = tmp / "out"
    start = time.monotonic()
    proc = subprocess.run([str(REPO / "tools/fleet-report"), str(inv_all), "--out", str(out), "--workers", "11"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - start
    doc = json.loads((out / "fleet-report.json").read_text())
    print(f"fleet-report: {len(doc['hosts'])} hosts in {seconds:.1f} s (report says {doc['seconds']} s)")
    return {"roles": roles, "proc": proc, "doc": doc, "out": out, "seconds": seconds, "tmp": tmp,
            "rows": {r["host"]: r for r in doc["hosts"]}}


EXPECTED_STATE = {"provisioned": "provisioned", "changed-marker": "changed", "changed-package": "changed",
                  "fresh": "fresh", "mismatch": "mismatch-pending", "down": "unreachable", "ghost": "unreachable"}


def test_report_marks_every_host_correctly(fleet):
    rows = fleet["rows"]
    assert len(rows) == 11, fleet["proc"].stdout + fleet["proc"].stderr
    for role, hosts in fleet["roles"].items():
        for host in hosts:
            assert rows[host.name]["state"] == EXPECTED_STATE[role], (role, rows[host.name])
    # progress on stderr, one line per host; the table on stdout; non-zero exit (not all healthy)
    assert fleet["proc"].stderr.count("[") >= 11 and "[11/11]" in fleet["proc"].stderr
    assert fleet["proc"].returncode == 1
    for name in rows:
        assert name in fleet["proc"].stdout


def test_report_columns_say_what_is_wrong(fleet):
    rows, roles = fleet["rows"], fleet["roles"]
    mismatch = rows[roles["mismatch"][0].name]
    assert (mismatch["driver_loaded"], mismatch["driver_installed"]) == (LOADED, INSTALLED)
    assert mismatch["mismatch"] and mismatch["reboot_pending"]
    assert mismatch["gpus"] == [{"model": "Tesla T4", "count": 1}]
    assert any("driver loaded 580.95.05 != installed 580.126.09" in f for f in mismatch["validation"]["failed"])
    marker = rows[roles["changed-marker"][0].name]
    assert any("says tier research" in f for f in marker["validation"]["failed"])
    package = rows[roles["changed-package"][0].name]
    assert any("not installed: tmux" in f for f in package["validation"]["failed"])
    for host in roles["down"] + roles["ghost"]:
        assert rows[host.name]["status"] == "unreachable"
        assert "Could not connect" in rows[host.name]["error"] or "Unable to connect" in rows[host.name]["error"]
    for host in roles["provisioned"]:
        row = rows[host.name]
        assert row["validation"]["failed"] == [] and row["kernel"]
        # all.py itself refuses GPU-less hosts (driver step): then the planning error is the drift
        assert row["drift"]["changes"] == 0 or row["drift"]["error"], row["drift"]
    for host in roles["fresh"]:
        drift = rows[host.name]["drift"]
        assert (drift["changes"] or 0) > 0, drift  # a planning error here says which
    drift = rows[roles["changed-package"][0].name]["drift"]
    assert (drift["changes"] or 0) >= 1, drift  # all.py would reinstall tmux


def test_report_json_format_is_documented_and_valid(fleet):
    validate_schema(fleet["doc"], json.loads(SCHEMA_PATH.read_text()))
    md = (fleet["out"] / "fleet-report.md").read_text()
    for name in fleet["rows"]:
        assert f"| {name} |" in md


def _validate_run(fleet, role_names: list[str]):
    hosts = [h for r in role_names for h in fleet["roles"][r]]
    inv = write_inventory(fleet["tmp"] / f"validate-{'-'.join(role_names)}.py", hosts,
                          data={h.name: _data(h) for h in hosts})
    return hosts, pyinfra(inv, "deploys/validate.py")


def test_validate_fails_a_changed_host_and_names_what_changed(fleet):
    hosts, run = _validate_run(fleet, ["provisioned", "changed-marker", "changed-package"])
    assert run.returncode != 0, run.output
    # pyinfra pads '[name]' to the longest host name: one space, so that a host's lines are
    # found (and a 'not in' below cannot pass just because of the padding)
    output = re.sub(r"^(\[[^\]\n]+\]) +", r"\1 ", run.output, flags=re.M)
    marker, package = fleet["roles"]["changed-marker"][0], fleet["roles"]["changed-package"][0]
    assert f"[{marker.name}] [FAIL] base: the gpufleet marker matches the tier: /etc/gpufleet/managed says " \
           "tier research, the inventory says dev" in output
    assert f"[{package.name}] [FAIL] base: the tier's diagnostics packages are installed: not installed: tmux" \
           in output
    stop = [line for line in run.output.splitlines() if f"[{marker.name}] failed (validation): " in line]
    assert len(stop) == 1 and "the gpufleet marker matches the tier: /etc/gpufleet/managed says tier research" \
        in stop[0] and ". Fix: " in stop[0], stop
    for host in fleet["roles"]["provisioned"]:
        assert f"[{host.name}] [FAIL]" not in output
        assert f"[{host.name}] failed (validation)" not in output
    # read-only: nothing changed on any host; the probe found no PyTorch in the tier's runtime and said so
    assert run.changed == 0, run.output
    assert "no PyTorch to run it with: /usr/bin/python3: it imports no torch (runtime python /usr/bin/python3 " \
           "(pytorch_python))" in run.output


def test_validate_fails_a_mismatch_pending_with_its_fix(fleet):
    _, run = _validate_run(fleet, ["mismatch"])
    assert run.returncode != 0
    line = next((ln for ln in run.output.splitlines() if "no driver mismatch is pending" in ln), "")
    assert "[FAIL] driver: no driver mismatch is pending: driver loaded 580.95.05 != installed 580.126.09" \
           " -> fix: run deploys/all.py (driver_reboot: allowed, so it reboots the host) or reboot the host" in line, \
        run.output[-4000:]


def test_html_report_in_headless_chromium(fleet, tmp_path):
    from gpufleet.apps.report.view import fleet_summary
    from testing import chromium

    browser = chromium.require()
    shot, dom = chromium.render(fleet["out"] / "fleet-report.html", tmp_path, browser=browser)
    # the screenshot: a real PNG of the window size, not a blank page
    assert chromium.png_size(shot) == (1400, 900)
    assert shot.stat().st_size > 20_000, f"screenshot suspiciously small ({shot.stat().st_size} bytes)"
    keep = os.environ.get("GPUFLEET_REPORT_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)
    # the DOM chromium built: one table row per host, with its state
    for name, row in fleet["rows"].items():
        assert f'data-host="{name}" data-state="{row["state"]}"' in dom, name
    assert dom.count("<tr class=\"state-") == len(fleet["rows"])
    # the mismatched host's driver cell is failed and the failing hosts come first
    report = chromium.parse_report(dom)
    by = {r.host: r for r in report.rows}
    mismatch = by[fleet["roles"]["mismatch"][0].name]
    assert mismatch.cells["driver"] == "fail" and f"≠ loaded {LOADED}" in mismatch.text["driver"], mismatch
    levels = [r.attention for r in report.rows]
    assert levels == sorted(levels, key=["fail", "warn", "pending", "ok"].index), levels
    assert mismatch.attention == "fail"
    for host in fleet["roles"]["down"] + fleet["roles"]["ghost"]:
        assert by[host.name].attention == "fail" and by[host.name].cells["problems"] == "fail"
    # the summary counts what the JSON says
    summary = fleet_summary(fleet["doc"]["hosts"])
    assert {k: report.counts[k] for k in ("fail", "warn", "pending", "ok")} == summary["attention"]
    assert report.counts["hosts"] == len(fleet["rows"]) == 11
    assert report.versions == summary["versions"] and report.tiers == {"dev": 11}
    assert report.versions["driver"][INSTALLED] >= 1 and report.versions["driver"]["unknown"] == 2


def _report(hosts, path: Path) -> dict:
    inv = write_inventory(path.with_suffix(".py"), hosts, data={h.name: _data(h) for h in hosts})
    proc = subprocess.run([str(REPO / "tools/fleet-report"), str(inv), "--out", str(path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert (path / "fleet-report.json").exists(), proc.stdout + proc.stderr
    return {r["host"]: r for r in json.loads((path / "fleet-report.json").read_text())["hosts"]}


def test_drift_is_the_hosts_own_whatever_the_others_and_the_fact_plans(hostpool, tmp_path):
    """Every host refused (GPU-less: all.py's driver step refuses them) and one of them handed
    the fact plan of another host of its name (a provisioned one, as when a re-run of the suite
    gives a name to a host in another state): each host's drift is its own refusal, the same
    for both, never the error pyinfra raises in whichever host happens to be refused last."""
    other, stale, clean = hostpool.get("report-plans", 3)
    provision = pyinfra(write_inventory(tmp_path / "provision.py", [other], data={other.name: _data(other)}),
                        "tests/e2e/provision_without_gpu.py")
    assert provision.returncode == 0, provision.output[-4000:]
    _report([other], tmp_path / "other")  # writes the provisioned host's fact plan
    plans = REPO / ".gpufleet" / "factplans"
    shutil.copy(plans / f"{other.name}.json", plans / f"{stale.name}.json")
    (plans / f"{clean.name}.json").unlink(missing_ok=True)

    rows = _report([stale, clean], tmp_path / "fresh")
    drifts = [rows[h.name]["drift"] for h in (stale, clean)]
    for drift in drifts:
        assert drift["error"] == "all.py refuses this host at planning time", drifts
        assert drift["changes"] > 0 and "Base system | Install the tier's diagnostics packages" in drift["operations"]
    assert drifts[0] == drifts[1]
