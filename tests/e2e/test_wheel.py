"""End-to-end: gpufleet as a package. The wheel is built from this checkout and installed
(not editable) into a fresh virtualenv; from a folder outside the checkout, with nothing of the
checkout on the path, its commands run and a deploy applies its area, templates included, to a
real test host (twice: the second run changes nothing)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
COMMANDS = ("gpufleet-deploy", "gpufleet-rollout", "gpufleet-rollback", "gpufleet-report", "gpufleet-compat",
            "gpufleet-health")
NCCL = "/etc/nccl.conf"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, bin folder, a work folder outside the checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    # from a copy without build/ or *.egg-info: setuptools would package what an earlier build left
    src = tmp / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".gpufleet", ".pytest_cache", "reports"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                   check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = (tmp / "dist").glob("gpufleet-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(tmp / "venv")], check=True, timeout=300)
    pip = subprocess.run([str(tmp / "venv" / "bin" / "pip"), "install", "-q", str(wheel)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    work = tmp / "work"
    work.mkdir()
    return wheel, tmp / "venv" / "bin", work


def run(installed, *argv: str, timeout: int = 900) -> subprocess.CompletedProcess:
    _, bin_dir, work = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", COLUMNS="200", PYTHONUNBUFFERED="1")
    return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_wheel_installs_one_import_name_with_its_templates_and_data(installed):
    wheel, _, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"gpufleet"}, tops  # no top-level deploys, facts, operations or testing
    for path in ("gpufleet/deploys/all.py", "gpufleet/operations/holds.py", "gpufleet/facts/gpu.py",
                 "gpufleet/templates/etc/nccl.conf.j2", "gpufleet/templates/report/report.html.j2",
                 "gpufleet/data/tiers.yaml", "gpufleet/data/compat.yaml", "gpufleet/apps/report/report.schema.json",
                 "gpufleet/perf_probe.py"):
        assert path in names, path
    assert not [n for n in names if n.startswith("gpufleet/testing") or "/gpusim" in n]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_prints_its_help(installed, command):
    proc = run(installed, command, "--help")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"usage: {command} "), proc.stdout  # its own name, not tools/...


def test_compat_answers_from_the_installed_data(installed):
    proc = run(installed, "gpufleet-compat", "--gpu", "NVIDIA H200", "--os", "debian-12", "--cuda", "13.0",
               "--pytorch", "2.11", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["refused"] is None
    assert answer["driver"] and answer["cuda"] and answer["pytorch"]["cuda_variant"].startswith("cu")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_prints_gpufleets_version(installed, command):
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    proc = run(installed, command, "--version")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"{command} (gpufleet) {version};"), proc.stdout  # not pyinfra's version


def test_the_wheel_ships_the_license_the_changelog_and_the_settings_reference(installed):
    wheel, _, _ = installed
    archive = zipfile.ZipFile(wheel)
    (info,) = {n.split("/")[0] for n in archive.namelist() if n.split("/")[0].endswith(".dist-info")}
    assert "Apache License" in archive.read(f"{info}/licenses/LICENSE").decode()
    assert "END OF TERMS AND CONDITIONS" in archive.read(f"{info}/licenses/LICENSE").decode()
    assert "\n# Changelog\n" in archive.read(f"{info}/METADATA").decode()
    settings = (REPO / "docs" / "settings.md").read_text()
    assert archive.read("gpufleet/docs/settings.md").decode() == settings
    shown = run(installed, "gpufleet-deploy", "--settings")
    assert shown.returncode == 0 and shown.stdout == settings, shown.stderr


def test_deploy_help_lists_every_area_and_a_missing_inventory_stops_first(installed):
    helped = run(installed, "gpufleet-deploy", "--help")
    assert helped.returncode == 0 and "monitoring" in helped.stdout, helped.stdout
    missing = run(installed, "gpufleet-deploy", "/nonexistent/inventory.py", "all", "-y", timeout=120)
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "no such inventory file: /nonexistent/inventory.py" in missing.stderr
    assert "Loading" not in missing.stdout + missing.stderr  # pyinfra never started


def test_compat_names_the_key_that_fixes_a_refusal_with_allowed_as_a_list(installed):
    proc = run(installed, "gpufleet-compat", "--gpu", "NVIDIA B200", "--pytorch", "2.6", "--os", "ubuntu-24.04",
               "--json")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["refused_key"] == "pytorch_version"
    assert isinstance(answer["allowed"], list) and "2.7" in answer["allowed"] and "2.6" not in answer["allowed"]


@pytest.fixture(scope="module")
def deployed(installed, hostpool, tmp_path_factory):
    (host,) = hostpool.get("wheel", 1, release="bookworm")
    data = {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn"}
    inv = write_inventory(tmp_path_factory.mktemp("wheel-inv") / "inventory.py", [host], data={host.name: data})
    first = run(installed, "gpufleet-deploy", str(inv), "tuning", "-y")
    nccl = testhosts.ssh(host, f"cat {NCCL}", check=False)
    again = run(installed, "gpufleet-deploy", str(inv), "tuning", "-y")
    report = run(installed, "gpufleet-report", str(inv), "--out", "reports", "--quiet")
    return host, first, nccl, again, report, installed[2] / "reports"


def changes(proc: subprocess.CompletedProcess) -> int:
    m = re.search(r"^\s*Grand total\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", proc.stdout + proc.stderr, re.M)
    assert m, (proc.stdout + proc.stderr)[-3000:]
    return 0 if m[2] == "-" else int(m[2])


def test_an_installed_deploy_applies_its_area_with_its_templates_then_changes_nothing(deployed):
    host, first, nccl, again, _, _ = deployed
    assert first.returncode == 0 and changes(first) > 0, (first.stdout + first.stderr)[-5000:]
    # rendered from the installed templates/etc/nccl.conf.j2 (the tier's NCCL settings)
    assert nccl.returncode == 0 and "NCCL_" in nccl.stdout, nccl.stdout + nccl.stderr
    assert again.returncode == 0 and changes(again) == 0, (again.stdout + again.stderr)[-5000:]


def test_the_installed_report_reaches_the_host_and_renders_its_html(deployed):
    host, _, _, _, report, out = deployed
    assert report.returncode in (0, 1), report.stdout + report.stderr  # 1: the host is not fully provisioned
    html = (out / "fleet-report.html").read_text()
    assert host.name in html and "<html" in html.lower()
    doc = json.loads((out / "fleet-report.json").read_text())
    assert [h["host"] for h in doc["hosts"]] == [host.name], doc
