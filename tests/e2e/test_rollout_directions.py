"""End-to-end: tools/rollout moves a host both ways (issue 26 item 2), on one research host
(simulated A100s) reached as the harness's deploy user, driver + Fabric Manager + CUDA + cuDNN
from the stand-in NVIDIA repository, pinned and held:

1. a package change that fails (a downgrade asked of apt without --allow-downgrades: exit 100,
   as the pin back failed before) leaves no hold on the pinning package it never installed and
   no failed unit; the holds of what is installed are back;
2. pin back: the inventory says `driver_version: <older>`, `tools/rollout INV` -> loaded =
   installed = older (dpkg and the simulator's nvidia-smi), the older pinning package in place of
   the newer, holds as before, no failed unit, no hold on a package that is not installed;
3. roll forward again (`--driver-version <newer>`), the same checks;
4. `tools/rollback HOST --reboot` undoes that last move: the manifest taken before it (the older
   driver) installed, held and loaded after a real reboot;
5. the same rollout again (its state file says done) brings the host back to the newer driver,
   and so does the first rollout after a pin back through another inventory (issue 50 item 10).

The host is provisioned by deploys/all.py first (the operator's shape: a sudo user, two allowed
users) and, after each move, once the inventory names what the host runs, all.py changes
nothing: the rollout and the bootstrap never pull a host two ways.
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
from testing.inventory import environment_data, write_inventory
from tests.e2e import rollout_fleet as rf
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
UNIT = du.UNIT
DRIVER_PACKAGES = ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager")
TIMINGS: dict[str, float] = {}
HELD: set[str] = set()   # what all.py holds once it provisioned the host: every move keeps exactly that


def prepare_new(host, aptrepo) -> None:  # noqa: F811
    """The newer driver + FM, pinned (nvidia-driver-pinning-<newer>) and held; all.py then adds
    the CUDA toolkit and cuDNN at the releases it resolves (an apt install of the toolkit's
    metapackage by hand takes its components' newest versions, which the gate fails as changed by
    hand): the host before the pin back."""
    b64 = base64.b64encode(aptrepo.keyring.read_bytes()).decode()
    line = aptrepo.sources_line("debian12", rf.KEYRING)
    q = shlex.quote
    rf.sh(host, f"echo {q(b64)} | base64 -d > {rf.KEYRING} && chmod 644 {rf.KEYRING} && "
                f"echo {q(line)} > /etc/apt/sources.list.d/cuda-debian12-x86_64.list && "
                f"{rf.APT} update -o Dir::Etc::SourceList=/dev/null >/dev/null && "
                f"{rf.APT} install -y {q('nvidia-driver-pinning-' + rf.NEW)} >/dev/null && "
                f"{rf.APT} install -y {q('nvidia-open=' + rf.NEW_DEB)} {q('nvidia-fabricmanager=' + rf.NEW_DEB)} "
                f">/dev/null && apt-mark hold {shlex.join(DRIVER_PACKAGES)} >/dev/null && "
                # DCGM with its host engine, as an operator runs it: the rollout's canary runs its diagnostic
                f"{rf.APT} install -y datacenter-gpu-manager-4-core >/dev/null && systemctl enable -q nvidia-dcgm.service")


def write(work: Path, host, aptrepo, driver: str) -> Path:  # noqa: F811
    """The research group's inventory as an operator keeps it: the tier, the harness's
    environment (stand-in repositories, a sudo user, two allowed users) and the driver pinned."""
    data = {**environment_data(host, "research", aptrepo), "tier_mismatch": "warn", "driver_version": driver}
    return write_inventory(work / "research.py", [host], data={host.name: data}, groups={"gpu_fleet": [host.name]})


def all_py_changes_nothing(inv: Path, what: str) -> None:
    t = time.monotonic()
    run = pyinfra(inv)
    TIMINGS[f"all_py_after_{what}_s"] = time.monotonic() - t
    assert run.returncode == 0, run.output
    assert changed_operations(run) == [], run.output
    assert "driver upgrade pending" not in run.output, run.output


@pytest.fixture(scope="module")
def research(hostpool, aptrepo, tmp_path_factory):  # noqa: F811
    host = hostpool.get("rollout-directions", 1, release="bookworm", gpu=f"a100x2@{rf.NEW}")[0]
    assert host.ssh_user != "root"     # the operator's shape: every run below goes through sudo
    t = time.monotonic()
    prepare_new(host, aptrepo)
    testhosts.reboot(host)
    TIMINGS["prepare_s"] = time.monotonic() - t
    assert rf.loaded(host) == rf.NEW
    work = tmp_path_factory.mktemp("directions")
    inv = write(work, host, aptrepo, rf.NEW)
    t = time.monotonic()
    first = pyinfra(inv)      # the rest of the host (hardening, Docker, tuning...) as all.py makes it
    TIMINGS["all_py_provision_s"] = time.monotonic() - t
    assert first.returncode == 0, first.output
    all_py_changes_nothing(inv, "provisioning")
    HELD.update(rf.holds(host))
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)
    return host, work


def rollout(work: Path, version: str, *args: str) -> subprocess.CompletedProcess:
    t = time.monotonic()
    proc = subprocess.run([str(REPO / "tools/rollout"), "research.py", "-y", *args],
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
    # all.py's holds, the pinning package of this version in place of the other's
    pinning = "nvidia-driver-pinning-"
    wanted = {p for p in HELD if not p.startswith(pinning)} | {pinning + version for p in HELD if p.startswith(pinning)}
    assert set(rf.HELD) <= rf.holds(host) == (wanted or rf.holds(host)), rf.holds(host) ^ wanted
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
    assert rf.holds(host) == HELD                                     # what is installed: held again
    assert not unit_failed(host)                                     # outcome read, unit reset


def test_pin_back_to_the_older_driver(research, aptrepo):  # noqa: F811
    host, work = research
    # the operator's pin back: the inventory names the older release, the rollout follows it
    inv = write(work, host, aptrepo, rf.OLD)
    r = rollout(work, rf.OLD)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_at(host, rf.OLD, rf.OLD_DEB, rf.NEW)
    # the one host is the canary: DCGM's medium diagnostic ran on it with the older driver loaded
    validated = next(line for line in r.stdout.splitlines() if f"[canary] {host.name}: validate ok" in line)
    assert validated.endswith("canary: DCGM diagnostic level 2 passed"), r.stdout
    log = rf.sh(host, "grep '=== .* package change: ' " + du.LOG + " | tail -n 1").stdout
    assert log.rstrip().endswith(" downgrade"), log        # apt was allowed to go older: it did
    all_py_changes_nothing(inv, "pin_back")
    assert_at(host, rf.OLD, rf.OLD_DEB, rf.NEW)


def test_roll_forward_again(research, aptrepo):  # noqa: F811
    host, work = research
    r = rollout(work, rf.NEW, "--driver-version", rf.NEW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)
    log = rf.sh(host, "grep '=== .* package change: ' " + du.LOG + " | tail -n 1").stdout
    assert " downgrade" not in log, log                    # upward: no --allow-downgrades
    assert f'host {host.name}: set driver_version: "{rf.NEW}"' in r.stdout, r.stdout  # the line to set
    inv = write(work, host, aptrepo, rf.NEW)                # set as told
    all_py_changes_nothing(inv, "roll_forward")
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)


def test_rollback_reboot_puts_the_manifests_driver_back(research, aptrepo):  # noqa: F811
    """The last move (forward) undone from the manifest taken right before it: the older driver
    installed, held, and loaded after the reboot the rollback asked for."""
    host, work = research
    boots = rf.sh(host, "cat /proc/sys/kernel/random/boot_id").stdout.strip()
    t = time.monotonic()
    r = subprocess.run([str(REPO / "tools/rollback"), "research.py", host.name, "--reboot", "-y"],
                       cwd=work, capture_output=True, text=True, timeout=900)
    TIMINGS["rollback_reboot_s"] = time.monotonic() - t
    print(r.stdout, r.stderr, TIMINGS)
    assert r.returncode == 0, r.stdout + r.stderr
    assert rf.sh(host, "cat /proc/sys/kernel/random/boot_id").stdout.strip() != boots   # a real reboot
    assert_at(host, rf.OLD, rf.OLD_DEB, rf.NEW)
    # the inventory set back to what the host runs again: all.py changes nothing
    all_py_changes_nothing(write(work, host, aptrepo, rf.OLD), "rollback")


def test_the_same_rollout_again_brings_back_a_host_moved_off_its_target(research, aptrepo):  # noqa: F811
    """The rollout to the newer driver finished (its state file says done), then the host was
    moved off it behind the rollout's back (tools/rollback above; a hand apt install or a re-imaged
    node looks the same): the same rollout run again trusts the host, not its record (issue 50
    item 10). The old code said "done already, not redone" and exited 0 with the host elsewhere."""
    host, work = research
    assert rf.loaded(host) == rf.OLD
    r = rollout(work, rf.NEW, "--driver-version", rf.NEW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done already, not redone" not in r.stdout
    assert f"{host.name}: recorded done at {rf.NEW}, but the host runs {rf.OLD}/{rf.OLD}" in r.stdout, r.stdout
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)


def test_forward_pin_back_through_another_inventory_forward_again(research, aptrepo):  # noqa: F811
    """Forward with the first (done just above), pinned back through another inventory, then the
    first rollout again: the host ends at the forward target, not left on the older driver."""
    host, work = research
    data = {**environment_data(host, "research", aptrepo), "tier_mismatch": "warn", "driver_version": rf.OLD}
    write_inventory(work / "pinned.py", [host], data={host.name: data})
    pin = subprocess.run([str(REPO / "tools/rollout"), "pinned.py", "-y"], cwd=work, capture_output=True, text=True,
                         timeout=900)
    print(pin.stdout, pin.stderr)
    assert pin.returncode == 0, pin.stdout + pin.stderr
    assert rf.loaded(host) == rf.OLD and rf.version(host, "nvidia-open") == f"ii {rf.OLD_DEB}"
    r = rollout(work, rf.NEW, "--driver-version", rf.NEW)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "done already, not redone" not in r.stdout
    assert_at(host, rf.NEW, rf.NEW_DEB, rf.OLD)
