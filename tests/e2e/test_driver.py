"""End-to-end for deploys/driver.py on real Debian test hosts whose GPUs are SIMULATED
(testing/gpusim, a test double; at boot its gpusim-load-module.service "loads" the installed
driver's module, so a driver change really needs a reboot to clear the mismatch).

- distro: Debian's own nvidia-driver from the real Debian archive (bookworm R535, trixie R550),
  held, unattended-upgrades blacklist, nouveau blacklisted, reboot (dev tier: allowed), second
  run changes nothing.
- nvidia: the signed stand-in CUDA repository on loopback (testing/aptrepo.py): install 580.95.05
  with Fabric Manager (simulated HGX H100 x8: NVSwitch present), the mismatch reported with
  driver_reboot: never; then a sanctioned in-place upgrade to 580.126.09 (driver_upgrade_in_place:
  true, the dev-box path; otherwise all.py leaves it to tools/rollout) with driver_reboot: allowed that
  unholds, upgrades, re-holds, really reboots, and leaves no mismatch.

Kernel headers: the test hosts run the machine's kernel, for which no linux-headers package
exists in the container, so these tests set `driver_kernel_headers: skip`; test_driver_refusals
proves the default (`require`) stops the host with a clear message.

These tests run only the steps the driver needs (validate, preflight, driver), not the whole of
deploys/all.py: hardening's firewall and docker are other issues' tests.
"""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gpufleet.catalog.compat import compat_data
from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

RUNNER = "tests/e2e/deploys/driver_only.py"  # validate, preflight, then only the driver deploy


@pytest.fixture(scope="module")
def runner() -> str:
    return RUNNER


def sh(host: testhosts.Host, cmd: str) -> str:
    r = testhosts.ssh(host, cmd, check=False, timeout=120)
    assert r.returncode == 0, f"{cmd}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def versions(host: testhosts.Host, *packages: str) -> dict[str, str]:
    out = testhosts.ssh(host, "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' "
                        + " ".join(packages) + " 2>/dev/null", check=False).stdout
    return {p: v for p, v, s in (line.split() for line in out.splitlines() if len(line.split()) == 3)
            if s[1] == "i"}


def upstream(version: str) -> str:
    return re.sub(r"^\d+:", "", version).rsplit("-", 1)[0]


def holds(host: testhosts.Host) -> set[str]:
    return set(sh(host, "apt-mark showhold").split())


def loaded_module(host: testhosts.Host) -> str:
    return sh(host, "cat /proc/driver/nvidia/version").split("\n")[0]


# --- distro: Debian's own packages ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["bookworm", "trixie"])
def distro_runs(request, hostpool, runner, tmp_path_factory):
    release = request.param
    # trixie's host is reached as root, bookworm's as the sudo user: both shapes install the driver
    (host,) = hostpool.get(f"driver-distro-{release}", 1, release=release, gpu="t4",
                           ssh_user="root" if release == "trixie" else testhosts.SSH_USER)
    # Start from what a minimal install has: the Debian archive with `main` only, in the
    # release's default format (bookworm: sources.list; trixie: deb822 debian.sources).
    if release == "bookworm":
        sh(host, "sed -i 's/ contrib non-free non-free-firmware$//' /etc/apt/sources.list")
    else:
        sh(host, "sed 's/^deb \\(\\S*\\) \\(\\S*\\) .*/Types: deb\\nURIs: \\1\\nSuites: \\2\\nComponents: main\\n"
                 "Signed-By: \\/usr\\/share\\/keyrings\\/debian-archive-keyring.gpg\\n/' /etc/apt/sources.list "
                 "> /etc/apt/sources.list.d/debian.sources && rm /etc/apt/sources.list")
    sh(host, "apt-get update -qq")
    assert "non-free" not in sh(host, "cat /etc/apt/sources.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true")
    data = {"tier": "dev", "validate_os_release": OS_RELEASE[release],
            # no headers package exists in the container for the machine's kernel (see module doc)
            "driver_kernel_headers": "skip"}
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host], data={host.name: data})
    t0 = time.monotonic()
    first = pyinfra(inv, runner)
    t1 = time.monotonic()
    second = pyinfra(inv, runner)
    t2 = time.monotonic()
    print(f"\n[timing] distro {release}: first run {t1 - t0:.1f} s (install + reboot), second run {t2 - t1:.1f} s")
    return host, release, first, second


def test_distro_driver_installed_at_the_resolved_version_and_held(distro_runs):
    host, release, first, _ = distro_runs
    assert first.returncode == 0, first.output
    offer = compat_data().distro_offers[OS_RELEASE[release]]
    # T4 on R535/R550: proprietary modules (open is the default only from R560)
    wanted = {p: offer.package_versions.get(p, offer.driver_version) for p in offer.driver_packages["proprietary"]}
    assert {"nvidia-driver", "nvidia-persistenced"} <= set(wanted)
    got = versions(host, *wanted)
    assert {p: upstream(v) for p, v in got.items()} == wanted
    assert set(wanted) <= holds(host)
    if release == "trixie":
        assert offer.driver_version.startswith("550.")


def test_distro_unattended_upgrades_and_nouveau(distro_runs):
    host, _, _, _ = distro_runs
    conf = sh(host, "cat /etc/apt/apt.conf.d/51gpufleet-unattended-upgrades")
    assert "Unattended-Upgrade::Package-Blacklist" in conf
    for pattern in ("^nvidia-", "^libnvidia-", "^cuda", "^libcudnn"):
        assert f'"{pattern}";' in conf
    assert "blacklist nouveau" in sh(host, "cat /etc/modprobe.d/gpufleet-blacklist-nouveau.conf")


def test_distro_components_enabled_on_the_debian_archive(distro_runs):
    host, release, first, _ = distro_runs
    assert "Enable contrib, non-free, non-free-firmware (Debian archive)" in "\n".join(changed_operations(first))
    if release == "bookworm":
        lines = [ln for ln in sh(host, "cat /etc/apt/sources.list").splitlines() if ln.startswith("deb ")]
        assert lines and all(ln.endswith(" main contrib non-free non-free-firmware") for ln in lines), lines
    else:
        comps = [ln for ln in sh(host, "cat /etc/apt/sources.list.d/debian.sources").splitlines()
                 if ln.startswith("Components:")]
        assert comps and all(ln == "Components: main contrib non-free non-free-firmware" for ln in comps), comps


def test_distro_host_was_rebooted_into_the_installed_driver(distro_runs):
    host, release, first, _ = distro_runs
    assert "Reboot to load the NVIDIA driver" in "\n".join(changed_operations(first))
    version = compat_data().distro_offers[OS_RELEASE[release]].driver_version
    assert f"Kernel Module  {version}  " in loaded_module(host)
    assert "Tesla T4" in sh(host, "nvidia-smi -L")  # no mismatch any more: NVML answers


def test_distro_second_run_changes_nothing(distro_runs):
    _, _, _, second = distro_runs
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output


# --- nvidia: the signed stand-in CUDA repository --------------------------------------------------

OLD, NEW = "580.95.05", "580.126.09"
FM = "nvidia-fabricmanager"
DRIVER_PKGS = ("nvidia-open", "nvidia-driver-cuda", "libnvidia-ml1", "nvidia-kernel-open-dkms", FM)


@pytest.fixture(scope="module")
def hgx(hostpool):
    (host,) = hostpool.get("driver-nvidia-h100", 1, release="bookworm", gpu="h100x8")
    return host


def _nvidia_data(host, aptrepo, **extra) -> dict:  # noqa: F811
    return {
        "tier": "hgx-cloud", "validate_os_release": "debian-12",
        "tier_mismatch": "warn",  # the simulated host has no 100G NIC
        "driver_repo_url": aptrepo.cuda_repos_url,            # the mirror: the stand-in repo
        "driver_repo_key_fingerprint": aptrepo.fingerprint,   # its throw-away signing key
        "driver_kernel_headers": "skip",                      # see the module docstring
        "driver_dcgm": True,
        **extra,
    }


@pytest.fixture(scope="module")
def nvidia_install(hgx, aptrepo, runner, tmp_path_factory):  # noqa: F811
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [hgx],
                          data={hgx.name: _nvidia_data(hgx, aptrepo, driver_version=OLD, driver_reboot="never")})
    t0 = time.monotonic()
    run = pyinfra(inv, runner)
    print(f"\n[timing] nvidia install {OLD}: {time.monotonic() - t0:.1f} s")
    return run


def test_nvidia_install_exact_versions_fabric_manager_equal_and_held(hgx, nvidia_install):
    assert nvidia_install.returncode == 0, nvidia_install.output
    got = versions(hgx, *DRIVER_PKGS, f"nvidia-driver-pinning-{OLD}", "cuda-toolkit-13-0", "libcudnn9-cuda-13",
                   "datacenter-gpu-manager-4-core", "datacenter-gpu-manager-4-cuda13")
    for pkg in DRIVER_PKGS:
        assert upstream(got[pkg]) == OLD, (pkg, got)
    assert got[FM] == got["nvidia-driver-cuda"]
    assert f"nvidia-driver-pinning-{OLD}" in got
    # exactly the resolved releases, although the stand-in repository offers newer ones
    assert (got["cuda-toolkit-13-0"], got["libcudnn9-cuda-13"]) == ("13.0.2-1", "9.17.0.29-1"), got
    assert "datacenter-gpu-manager-4-cuda13" in got
    assert {"nvidia-open", FM, f"nvidia-driver-pinning-{OLD}", "cuda-toolkit-13-0", "libcudnn9-cuda-13"} <= holds(hgx)
    source = sh(hgx, "cat /etc/apt/sources.list.d/gpufleet-cuda.list")
    assert "deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] http://127.0.0.1:" in source
    assert "debian12/x86_64/ /" in source


def test_nvidia_cuda_profile(hgx, nvidia_install):
    assert nvidia_install.returncode == 0, nvidia_install.output
    profile = sh(hgx, "cat /etc/profile.d/gpufleet-cuda.sh")
    assert profile.startswith("# Managed by gpufleet")
    out = sh(hgx, "bash -lc 'command -v nvcc; nvcc --version; echo LD=$LD_LIBRARY_PATH'")
    assert "/usr/local/cuda-13.0/bin/nvcc" in out and "release 13.0" in out
    assert "LD=/usr/local/cuda-13.0/lib64" in out


def test_nvidia_mismatch_is_reported_as_needing_a_reboot(hgx, nvidia_install):
    assert nvidia_install.returncode == 0, nvidia_install.output
    out = nvidia_install.output
    # loud, at the very end of the run
    tail = out[out.index("--> Results:"):]
    assert "NEED A REBOOT" in tail and hgx.name in tail and "driver_reboot: never" in tail
    assert f"differs from the installed driver {OLD}" in tail
    smi = testhosts.ssh(hgx, "nvidia-smi -L", check=False)
    assert smi.returncode == 18
    assert smi.stdout.startswith("Failed to initialize NVML: Driver/library version mismatch")
    assert "580.159.04" in loaded_module(hgx)  # the simulator's module from before the install
    # Fabric Manager would refuse the other module: enabled for the next boot, not started now
    assert sh(hgx, "systemctl is-enabled nvidia-fabricmanager.service").strip() == "enabled"
    assert testhosts.ssh(hgx, "systemctl is-active nvidia-fabricmanager.service", check=False).stdout.strip() != "active"


@pytest.fixture(scope="module")
def nvidia_upgrade(hgx, aptrepo, runner, nvidia_install, tmp_path_factory):  # noqa: F811
    assert nvidia_install.returncode == 0, nvidia_install.output
    boots = int((hgx.dir / "boots").read_text()) if (hgx.dir / "boots").exists() else 0
    inv = write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [hgx],
                          data={hgx.name: _nvidia_data(hgx, aptrepo, driver_version=NEW, driver_reboot="allowed",
                                                       driver_upgrade_in_place=True)})  # a dev box's path
    t0 = time.monotonic()
    run = pyinfra(inv, runner)
    t1 = time.monotonic()
    again = pyinfra(inv, runner)
    print(f"\n[timing] nvidia upgrade {OLD} -> {NEW} incl. reboot: {t1 - t0:.1f} s; next run {time.monotonic() - t1:.1f} s")
    return run, again, boots


def test_nvidia_sanctioned_upgrade_unholds_upgrades_and_reholds(hgx, nvidia_upgrade):
    run, _, _ = nvidia_upgrade
    assert run.returncode == 0, run.output
    got = versions(hgx, *DRIVER_PKGS, f"nvidia-driver-pinning-{NEW}", f"nvidia-driver-pinning-{OLD}")
    for pkg in DRIVER_PKGS:
        assert upstream(got[pkg]) == NEW, (pkg, got)
    assert got[FM] == got["nvidia-driver-cuda"]
    assert f"nvidia-driver-pinning-{OLD}" not in got  # replaced by the new version lock
    held = holds(hgx)
    assert {"nvidia-open", FM, f"nvidia-driver-pinning-{NEW}", "cuda-toolkit-13-0", "libcudnn9-cuda-13"} <= held
    # the name fits 60 characters (the exact releases, Fabric Manager's among them, are its explanation)
    assert any(f"Install driver {NEW}" in op or f"Install the driver {NEW} stack" in op
               for op in changed_operations(run)), changed_operations(run)
    # driver_upgrade_in_place still goes through the gate: the manifest of the old state first,
    # and the GPUs checked idle right before the package change
    import json
    manifests = [json.loads(sh(hgx, f"cat {path}")) for path in sh(hgx, "ls /var/lib/gpufleet/manifests/*.json").split()]
    assert any(m["packages"].get("nvidia-open") == f"{OLD}-1" and set(m["holds"]) >= {"nvidia-open", FM}
               for m in manifests), manifests
    assert "(in place, if idle)" in "\n".join(changed_operations(run))


def test_nvidia_fabric_manager_moved_with_the_driver_in_one_transaction(hgx, nvidia_upgrade):
    run, _, _ = nvidia_upgrade
    assert run.returncode == 0, run.output
    history = sh(hgx, "cat /var/log/apt/history.log")
    blocks = [b for b in history.split("\n\n") if f"nvidia-fabricmanager:amd64 ({OLD}-1, {NEW}-1)" in b]
    assert len(blocks) == 1, history
    assert f"nvidia-driver-cuda:amd64 ({OLD}-1, {NEW}-1)" in blocks[0]  # same apt transaction
    # the install never had Fabric Manager without its driver at the same version
    first = [b for b in history.split("\n\n") if f"nvidia-fabricmanager:amd64 ({OLD}-1)" in b]
    assert len(first) == 1 and f"nvidia-driver-cuda:amd64 ({OLD}-1" in first[0]


def test_nvidia_upgrade_really_rebooted_and_the_mismatch_is_gone(hgx, nvidia_upgrade):
    run, again, boots = nvidia_upgrade
    assert run.returncode == 0, run.output
    assert int((hgx.dir / "boots").read_text()) > boots
    assert f"Open Kernel Module for x86_64  {NEW}  " in loaded_module(hgx)
    assert "NVIDIA H100 80GB HBM3" in sh(hgx, "nvidia-smi -L")
    assert sh(hgx, "systemctl is-active nvidia-fabricmanager.service").strip() == "active"
    assert "NEED A REBOOT" not in run.output
    assert again.returncode == 0, again.output
    assert changed_operations(again) == [], again.output


def test_nvidia_key_with_another_fingerprint_is_not_trusted(hostpool, aptrepo, runner, tmp_path):  # noqa: F811
    (host,) = hostpool.get("driver-nvidia-badkey", 1, release="bookworm", gpu="h100x8")
    data = _nvidia_data(host, aptrepo, driver_version=OLD, driver_reboot="never",
                        driver_repo_key_fingerprint="EB693B3035CD5710E231E123A4B469963BF863CC")  # NVIDIA's
    inv = write_inventory(tmp_path / "inv.py", [host], data={host.name: data})
    run = pyinfra(inv, runner)
    assert run.returncode != 0
    assert "not the pinned EB693B3035CD5710E231E123A4B469963BF863CC" in run.output
    assert not Path(host.root / "usr/share/keyrings/cuda-archive-keyring.gpg").exists()
    assert versions(host, *DRIVER_PKGS) == {}


def test_busy_host_is_not_rebooted_unless_forced(hostpool, aptrepo, runner, tmp_path):  # noqa: F811
    (host,) = hostpool.get("driver-nvidia-busy", 1, release="bookworm", gpu="h100x8")
    # A "training job": a process holding a GPU device node open (visible even when NVML fails)
    # that the simulator's nvidia-smi also lists as a compute process.
    pid = sh(host, "touch /dev/nvidia0 && (nohup sh -c 'exec sleep 3600 3</dev/nvidia0' >/dev/null 2>&1 & echo $!)").strip()
    sh(host, f"gpusimctl add-process --gpu 0 --pid {pid} --name python3 --used-mib 1024")
    boots = int((host.dir / "boots").read_text()) if (host.dir / "boots").exists() else 0

    idle_only = write_inventory(tmp_path / "a.py", [host], data={host.name: _nvidia_data(
        host, aptrepo, driver_version=OLD, driver_reboot="if-idle")})
    run = pyinfra(idle_only, runner)
    assert run.returncode == 0, run.output
    tail = run.output[run.output.index("--> Results:"):]
    assert "NEED A REBOOT" in tail and f"driver_reboot: if-idle, 1 GPU process(es) running ({pid} python3)" in tail
    assert (int((host.dir / "boots").read_text()) if (host.dir / "boots").exists() else 0) == boots
    assert upstream(versions(host, "nvidia-open")["nvidia-open"]) == OLD

    # NVML now fails (mismatch): the open device node still shows the job
    allowed = write_inventory(tmp_path / "b.py", [host], data={host.name: _nvidia_data(
        host, aptrepo, driver_version=OLD, driver_reboot="allowed")})
    run = pyinfra(allowed, runner)
    assert run.returncode == 0, run.output
    assert f"driver_reboot: allowed, 1 GPU process(es) running ({pid} (holds /dev/nvidia*)), driver_reboot_force: false" in run.output
    assert int((host.dir / "boots").read_text() if (host.dir / "boots").exists() else 0) == boots

    forced = write_inventory(tmp_path / "c.py", [host], data={host.name: _nvidia_data(
        host, aptrepo, driver_version=OLD, driver_reboot="allowed", driver_reboot_force=True)})
    run = pyinfra(forced, runner)
    assert run.returncode == 0, run.output
    assert int((host.dir / "boots").read_text()) > boots
    assert f"Open Kernel Module for x86_64  {OLD}  " in loaded_module(host)
