"""End-to-end: tools/rollout moves a host both ways (issue 26 item 2), on one research host
(simulated A100s) reached as the harness's deploy user, driver + Fabric Manager + CUDA + cuDNN
from the stand-in NVIDIA repository, pinned and held:

1. a package change that fails (a downgrade asked of apt without --allow-downgrades: exit 100,
   as the pin back failed before) leaves no hold on the pinning package it never installed and
   no failed unit; the holds of what is installed are back;
2. pin back: the inventory says `driver_version: <older>`, `tools/rollout INV` -> loaded =
   installed = older (dpkg and the simulator's nvidia-smi), the older pinning package in place of
   the newer, holds as before, no failed unit, no hold on a package that is not installed;
3. roll forward again (`--driver-version <newer>`), the same checks.
"""
from __future__ import annotations

import base64
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.operations import driver_upgrade as du
from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from tests.e2e import rollout_fleet as rf

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
UNIT = du.UNIT
DRIVER_PACKAGES = ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager")
TIMINGS: dict[str, float] = {}


def prepare_new(host, aptrepo) -> None:  # noqa: F811
    """The newer driver + CUDA + cuDNN + FM, pinned (nvidia-driver-pinning-<newer>) and held:
    the host before the pin back."""
    b64 = base64.b64encode(aptrepo.keyring.read_bytes()).decode()
    line = aptrepo.sources_line("debian12", rf.KEYRING)
    q = shlex.quote
    rf.sh(host, f"echo {q(b64)} | base64 -d > {rf.KEYRING} && chmod 644 {rf.KEYRING} && "
                f"echo {q(line)} > /etc/apt/sources.list.d/cuda-debian12-x86_64.list && "
                f"{rf.APT} update -o Dir::Etc::SourceList=/dev/null >/dev/null && "
                f"{rf.APT} install -y {q('nvidia-driver-pinning-' + rf.NEW)} >/dev/null && "
                f"{rf.APT} install -y {q('nvidia-open=' + rf.NEW_DEB)} {q('nvidia-fabricmanager=' + rf.NEW_DEB)} "
                f"{shlex.join(rf.STACK)} >/dev/null && apt-mark hold {shlex.join(rf.HELD)} >/dev/null")


@pytest.fixture(scope="module")
def research(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    host = hostpool.get("rollout-directions", 1, release="bookworm", gpu=f"a100x2@{rf.NEW}")[0]
    t = time.monotonic()
    prepare_new(host, aptrepo)
    testhosts.reboot(host)
    TIMINGS["prepare_s"] = time.monotonic() - t
    assert rf.loaded(host) == rf.NEW
    work = tmp_path_factory.mktemp("directions")
    rf.inventory(work / "research.py", [host], aptrepo)
    return host, work


def rollout(work: Path, version: str, *args: str) -> subprocess.CompletedProcess:
    t = time.monotonic()
    proc = subprocess.run([str(REPO / "tools/rollout"), "research.py", *args],
                          cwd=work, capture_output=True, text=True, timeout=900)
    TIMINGS[f"rollout_to_{version}_s"] = time.monotonic() - t
    print(proc.stdout, proc.stderr, TIMINGS)
    return proc


def loose_holds(host) -> list[str]:
    """Packages on hold that are not installed (a selection dpkg keeps for nothing)."""
    out = rf.sh(host, "dpkg-query -W -f='${Status} ${Package}\\n' 2>/dev/null || true").stdout
    return sorted(line.split()[-1] for line in out.splitlines()
                  if line.startswith("hold ") and (" not-installed " in line or " config-files " in line))


def unit_failed(host) -> bool:
    out = rf.sh(host, shlex.join(["systemctl", "is-failed", UNIT]), check=False).stdout.strip()
    listed = rf.sh(host, "systemctl list-units --failed --no-legend --plain").stdout
    return out == "failed" or UNIT in listed


def smi_driver(host) -> set[str]:
    out = rf.sh(host, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def assert_at(host, version: str, deb: str, other: str) -> None:
    for pkg in DRIVER_PACKAGES:
        assert rf.version(host, pkg) == f"ii {deb}", (pkg, rf.version(host, pkg))
    assert rf.version(host, f"nvidia-driver-pinning-{version}") == f"ii {deb}"
    assert not rf.version(host, f"nvidia-driver-pinning-{other}").startswith("ii")
    assert rf.loaded(host) == version                       # the loaded module
    assert smi_driver(host) == {version}                    # what nvidia-smi (the simulator) reports
    assert rf.version(host, "libcudnn9-cuda-13") == "ii 9.17.0.29-1"
    assert rf.version(host, "cuda-toolkit-13-0") == "ii 13.0.2-1"
    assert rf.holds(host) == set(rf.HELD), rf.holds(host)
    assert loose_holds(host) == []
    assert not unit_failed(host)


def test_failed_change_leaves_no_hold_on_what_it_never_installed_and_no_failed_unit(research):
    host, _ = research
    # the package change the pin back ran before: older versions, no "downgrade" -> apt exit 100
    rf.sh(host, "install -d -m 700 " + du.SCRIPT_DIR + " && echo "
          + shlex.quote(base64.b64encode(du.PACKAGE_CHANGE_SCRIPT.encode()).decode())
          + " | base64 -d > " + du.SCRIPT + " && chmod 700 " + du.SCRIPT)
    old_pin, new_pin = f"nvidia-driver-pinning-{rf.OLD}", f"nvidia-driver-pinning-{rf.NEW}"
    # every package at the newer driver's version (as the rollout moves them), to the older one
    out = rf.sh(host, "dpkg-query -W -f='${Package} ${Version}\\n'").stdout
    moving = sorted(name for name, _, ver in (line.partition(" ") for line in out.splitlines())
                    if ver == rf.NEW_DEB and name != new_pin)
    held = sorted(set(rf.HELD) & set(moving))
    args = du.change_arguments({**{name: rf.OLD_DEB for name in moving}, old_pin: rf.OLD_DEB},
                               [new_pin], held, [*held, old_pin], downgrade=False)
    r = rf.sh(host, du.package_change_command(args).get_raw_value(), check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "without --allow-downgrades" in r.stderr and "exit status 100" in r.stderr, r.stderr
    assert rf.version(host, "nvidia-open") == f"ii {rf.NEW_DEB}"     # apt changed nothing
    assert old_pin not in rf.holds(host) and loose_holds(host) == []  # never installed: never held
    assert rf.holds(host) == set(rf.HELD)                             # what is installed: held again
    assert not unit_failed(host)                                     # outcome read, unit reset


def test_pin_back_to_the_older_driver(research, aptrepo):  # noqa: F811
    host, work = research
    # the operator's pin back: the inventory names the older release, the rollout follows it
    rf.inventory(work / "research.py", [host], aptrepo, extra={host.name: {"driver_version": rf.OLD}})
    r = rollout(work, rf.OLD)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_at(host, rf.OLD, rf.OLD_DEB, rf.NEW)
    log = rf.sh(host, "grep '=== .* package change: ' " + du.LOG + " | tail -n 1").stdout
    assert log.rstrip().endswith(" downgrade"), log        # apt was allowed to go older: it did


def test_roll_forward_again(research):
    host, work = research
    r = rollout(work, rf.NEW, "--driver-version", rf.NEW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)
    log = rf.sh(host, "grep '=== .* package change: ' " + du.LOG + " | tail -n 1").stdout
    assert " downgrade" not in log, log                    # upward: no --allow-downgrades
