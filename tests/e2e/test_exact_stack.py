"""End-to-end: the CUDA toolkit and cuDNN end at exactly the resolved releases (issue 17, item 1).

One real Debian test host (simulated GPUs: testing/gpusim) against the signed stand-in CUDA
repository (testing/aptrepo.py), which offers older and newer releases around the resolved ones
(cuda-toolkit-13-0 13.0.1 / 13.0.2 / 13.0.3, libcudnn9-cuda-13 9.16.0.29 / 9.17.0.29 / 9.17.1.4,
libcudnn9-cuda-12 9.10.2.21 / 9.16.0.29 / 9.17.0.29), so a test that passes proves the pin, not
apt's choice. Versions are read with dpkg-query on the host, never from gpufleet's output.

In order, on the same host (each run applied twice where it converges):
1. `cuda_version: "13.0"`, `cudnn_version: "9.17"` -> cuda-toolkit-13-0 13.0.2, cuDNN runtime,
   -dev and -headers 9.17.0.29, all held, and gpufleet's record of them (0600 in a 0700 folder);
   the second run changes nothing; the gate passes it.
2. cuDNN changed by hand (downgraded to 9.16.0.29): the driver deploy leaves it (no package
   change) and, as the record says gpufleet installed 9.17.0.29, the validation gate FAILs the
   host with the fix (drift, not a pending upgrade); `tools/rollout`, the fix, puts it back.
3. CUDA 12.8 with `cudnn_version: "9.10"` -> 12.8.1 and 9.10.2.21; then the inventory says
   `cudnn_version: "9.17.0"`: a pending upgrade, no package changes, the gate WARNs naming
   FROM -> TO and tools/rollout. `tools/rollout` then moves cuDNN to exactly 9.17.0.29 through
   the gate (manifest first), held; a second rollout and a second run change nothing.
4. `tools/rollback` puts 9.10.2.21 back from the rollout's manifest, and the record with it: the
   gate calls the inventory's 9.17.0 pending again, not a hand change.
5. `driver_upgrade_in_place: true` (dev boxes): all.py moves cuDNN to 9.17.0.29 itself, manifest
   first and GPUs idle right before; the gate passes.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import TEST_DRIVER, environment_data, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

RUNNER = "tests/e2e/deploys/driver_only.py"  # validate, preflight, then only the driver deploy
CUDNN13 = ("libcudnn9-cuda-13", "libcudnn9-dev-cuda-13", "libcudnn9-headers-cuda-13")
CUDNN12 = ("libcudnn9-cuda-12", "libcudnn9-dev-cuda-12", "libcudnn9-headers-cuda-12")
# the toolkit's components at the versions its release names (the meta packages ask with >= only)
COMPONENTS13 = {"cuda-compiler-13-0": "13.0.2-1", "cuda-nvcc-13-0": "13.0.88-1"}
# the toolkit reaches Nsight through its tools (testing/aptrepo.py, compat.yaml S40): components
# too, at 13.0.2's builds (not the later 2025.3.2.999 / 2025.3.1.9 the repository offers)
TOOLS13 = {"cuda-tools-13-0": "13.0.2-1", "cuda-visual-tools-13-0": "13.0.2-1",
           "cuda-nsight-systems-13-0": "13.0.2-1", "nsight-systems-2025.3.2": "2025.3.2.474-1",
           "cuda-nsight-compute-13-0": "13.0.2-1", "nsight-compute-2025.3.1": "2025.3.1.4-1"}
COMPONENTS12 = {"cuda-compiler-12-8": "12.8.1-1", "cuda-nvcc-12-8": "12.8.93-1"}
CHECK = "driver: the CUDA toolkit and cuDNN are the resolved releases"
REPO = Path(__file__).resolve().parents[2]
RECORD = "/var/lib/gpufleet/installed/stack"


def sh(host, cmd: str) -> str:
    from testing import testhosts

    r = testhosts.ssh(host, cmd, check=False, timeout=300)
    assert r.returncode == 0, f"{cmd}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def installed(host, *packages: str) -> dict[str, str]:
    """package -> Debian version, for installed packages only (dpkg-query on the host)."""
    out = sh(host, "dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\\n' "
                   + " ".join(packages) + " 2>/dev/null || true")
    return {p: v for p, v, s in (line.split() for line in out.splitlines() if len(line.split()) == 3) if s[1] == "i"}


def holds(host) -> set[str]:
    return set(sh(host, "apt-mark showhold").split())


def gate(inv, monkeypatch):
    """The real validation gate (deploys/validate.py) on the driver-only host: other areas fail
    there (no docker, no hardening); the tests read the CUDA/cuDNN check's own line."""
    monkeypatch.setenv("GPUFLEET_VALIDATE_PROBE", "0")
    return pyinfra(inv, "deploys/validate.py")


def recorded(host) -> dict[str, str]:
    """gpufleet's record on the host (package -> release), read as root."""
    out = sh(host, f"cat {RECORD}")
    return dict(line.split() for line in out.splitlines() if line and not line.startswith("#"))


def rollout(inv: Path) -> subprocess.CompletedProcess:
    """tools/rollout INVENTORY as an operator runs it (state and manifests next to the inventory)."""
    proc = subprocess.run([str(REPO / "tools" / "rollout"), inv.name, "-y"], cwd=inv.parent, capture_output=True,
                          text=True, timeout=900)
    print(proc.stdout, proc.stderr)
    return proc


def report_row(inv: Path, name: str) -> dict:
    """The host's row of tools/fleet-report's JSON (facts, the validation checks, all.py's plan)."""
    import json

    out = inv.parent / f"report-{name}"
    proc = subprocess.run([str(REPO / "tools" / "fleet-report"), str(inv), "--out", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=600)
    assert (out / "fleet-report.json").exists(), proc.stdout + proc.stderr
    (row,) = json.loads((out / "fleet-report.json").read_text())["hosts"]
    return row


def report_check(row: dict) -> dict:
    (found,) = [c for c in row["validation"]["checks"] if c["name"] == CHECK.split(": ", 1)[1]]
    return found


def check_line(run) -> str:
    lines = [line for line in run.output.splitlines() if CHECK in line]
    assert len(lines) == 1, run.output
    return lines[0]


@pytest.fixture(scope="module")
def host(hostpool):
    (h,) = hostpool.get("exact-stack", 1, release="bookworm", gpu=f"h100x8@{TEST_DRIVER}")  # module loaded: no reboot noise
    return h


@pytest.fixture(scope="module")
def runner() -> str:
    return RUNNER


def _inventory(host, aptrepo, tmp_path_factory, **wishes):  # noqa: F811
    data = {**environment_data(host, "hgx-cloud", aptrepo), "tier_mismatch": "warn",
            "driver_reboot": "never",
            # the tier also allows B200s, for which cuDNN 9.17.0 on CUDA 12 has no verified build
            "validate_gpu_models": ["NVIDIA H100 80GB HBM3"], **wishes}
    return write_inventory(tmp_path_factory.mktemp("inv") / "inventory.py", [host], data={host.name: data})


@pytest.fixture(scope="module")
def cuda13(host, aptrepo, runner, tmp_path_factory):  # noqa: F811
    inv = _inventory(host, aptrepo, tmp_path_factory, cuda_version="13.0", cudnn_version="9.17")
    return inv, pyinfra(inv, runner), pyinfra(inv, runner)


def test_the_repository_offers_older_and_newer_releases(host, cuda13):
    # the premise: apt alone would pick another release than the resolved one
    offered = sh(host, "apt-cache madison cuda-toolkit-13-0 libcudnn9-cuda-13")
    for version in ("13.0.1-1", "13.0.2-1", "13.0.3-1", "9.16.0.29-1", "9.17.0.29-1", "9.17.1.4-1"):
        assert version in offered, offered
    # and a newer nvcc than the one 13.0.2 ships, which its meta packages' >= would let apt take
    assert "13.0.96-1" in sh(host, "apt-cache madison cuda-nvcc-13-0")


def test_exact_cuda_and_cudnn_releases_installed_and_held(host, cuda13):
    _, first, _ = cuda13
    assert first.returncode == 0, first.output
    got = installed(host, "cuda-toolkit-13-0", *CUDNN13)
    assert got == {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.17.0.29-1" for p in CUDNN13}}, got
    assert {"cuda-toolkit-13-0", *CUDNN13} <= holds(host)
    # its components too: exactly what 13.0.2 names (not the newer 13.0.96 nvcc), held with it
    assert installed(host, *COMPONENTS13) == COMPONENTS13
    assert set(COMPONENTS13) <= holds(host)
    # Nsight as the toolkit's components, with tuning_profiling admins (the tier's default): exact, held
    assert installed(host, *TOOLS13) == TOOLS13
    assert set(TOOLS13) <= holds(host)
    # what gpufleet installed, recorded on the host: root's, 0600 in a 0700 folder
    assert recorded(host) == {"cuda-toolkit-13-0": "13.0.2", **{p: "9.17.0.29" for p in CUDNN13}}
    assert sh(host, f"stat -c '%a %U' {RECORD} $(dirname {RECORD})").split() == ["600", "root", "700", "root"]


def test_second_run_changes_nothing(cuda13):
    _, _, second = cuda13
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output


def test_gate_passes_the_exact_releases(cuda13, monkeypatch):
    inv, _, _ = cuda13
    line = check_line(gate(inv, monkeypatch))
    assert "[PASS]" in line and "CUDA 13.0.2, cuDNN 9.17.0.29" in line, line


NSIGHT13 = {"cuda-nsight-systems-13-0": "13.0.2-1", "nsight-systems-2025.3.2": "2025.3.2.474-1",
            "cuda-nsight-compute-13-0": "13.0.2-1", "nsight-compute-2025.3.1": "2025.3.1.4-1"}
PROFILING_CHECK = "tuning: GPU performance counters are for whom tuning_profiling says"
OPTION_FILE = "/etc/modprobe.d/gpufleet-nvidia-profiling.conf"


def admin_only(host) -> str:
    """RmProfilingAdminOnly of the loaded (simulated: testing/gpusim) nvidia module, from /proc."""
    (line,) = [x for x in sh(host, "cat /proc/driver/nvidia/params").splitlines() if x.startswith("RmProfilingAdminOnly:")]
    return line.split(": ", 1)[1]


def gate_line(run, check: str) -> str:
    lines = [line for line in run.output.splitlines() if check in line]
    assert len(lines) == 1, run.output
    return lines[0]


def test_profiling_for_users_pending_until_the_gates_reboot_then_admins_again(host, aptrepo, runner, cuda13,  # noqa: F811
                                                                               tmp_path_factory, monkeypatch):
    """tuning_profiling (issue 33, item 3), on this host at CUDA 13.0.2: users -> the option file
    and Nsight Systems / Compute of 13.0.2, exact and held, in the driver deploy's one package
    change; PENDING (plan view, run summary, gate) while the loaded module restricts; tools/rollout
    reboots the host through the gate (drained, GPUs idle right before): the module reads the
    option at its load and /proc/driver/nvidia/params says RmProfilingAdminOnly: 0; a second run
    changes nothing. Then admins: the file goes, pending again until a reboot (by hand here), 1 again."""
    import time

    t0 = time.monotonic()
    wishes = dict(cuda_version="13.0", cudnn_version="9.17", driver_reboot="if-idle")
    inv = _inventory(host, aptrepo, tmp_path_factory, tuning_profiling="users", **wishes)
    assert admin_only(host) == "1"   # the driver's default, as the simulated module was loaded
    first = pyinfra(inv, runner)
    assert first.returncode == 0, first.output
    assert installed(host, *NSIGHT13) == NSIGHT13        # exact, not the later 13.0.3 builds the repo offers
    assert set(NSIGHT13) <= holds(host)
    assert "options nvidia NVreg_RestrictProfilingToAdminUsers=0" in sh(host, f"cat {OPTION_FILE}").splitlines()
    assert sh(host, f"stat -c '%a %U' {OPTION_FILE}").split() == ["644", "root"]
    assert admin_only(host) == "1"   # written, not loaded: all.py does not reboot for it
    assert "PROFILING PENDING: tuning_profiling: users takes effect at the next load" in first.output, first.output
    assert "GPU profiling PENDING" in first.output[first.output.index("--> Results:"):], first.output
    again = pyinfra(inv, runner)
    assert again.returncode == 0 and changed_operations(again) == [], again.output   # pending is said, not redone
    plan = pyinfra(inv, "deploys/plan.py")
    assert ("profiling: tuning_profiling: users: GPU performance counters for every user from the next module load; "
            "loaded module: admins only (RmProfilingAdminOnly 1); PENDING until a reboot (tools/rollout)") in plan.output, \
        plan.output
    line = gate_line(gate(inv, monkeypatch), PROFILING_CHECK)
    assert f"[WARN] {PROFILING_CHECK}: PENDING: the loaded nvidia module gives them to admins only" in line, line
    t1 = time.monotonic()

    # the gate's reboot: tools/rollout takes the host though its driver is at the target
    rolled = rollout(inv)
    assert rolled.returncode == 0, rolled.stdout + rolled.stderr
    assert "yes (tuning_profiling)" in rolled.stdout, rolled.stdout
    assert "tuning_profiling: the loaded nvidia module lacks it: a reboot, no package change" in rolled.stdout
    assert "packages:" not in rolled.stdout, rolled.stdout
    assert "reboot ok" in rolled.stdout, rolled.stdout
    assert admin_only(host) == "0"   # read back from the module loaded at boot, as on the recorded H200
    t2 = time.monotonic()
    settled = pyinfra(inv, runner)
    assert settled.returncode == 0 and changed_operations(settled) == [], settled.output
    assert "PENDING" not in settled.output, settled.output
    line = gate_line(gate(inv, monkeypatch), PROFILING_CHECK)
    assert (f"[PASS] {PROFILING_CHECK}: every user (RmProfilingAdminOnly 0); cuda-nsight-systems-13-0 13.0.2, "
            "nsight-systems-2025.3.2 2025.3.2.474, cuda-nsight-compute-13-0 13.0.2, nsight-compute-2025.3.1 2025.3.1.4 "
            "held") in line, line
    t3 = time.monotonic()

    # back to admins (what the rest of this file's runs say): the file goes; the module still
    # lets users in until it is loaded again; the Nsight packages stay, held
    inv = _inventory(host, aptrepo, tmp_path_factory, **wishes)
    back = pyinfra(inv, runner)
    assert back.returncode == 0, back.output
    assert sh(host, f"ls {OPTION_FILE} 2>/dev/null; true") == ""
    assert "PROFILING PENDING: tuning_profiling: admins" in back.output, back.output
    assert admin_only(host) == "0"
    from testing import testhosts

    testhosts.reboot(host)   # the operator's own reboot this time
    assert admin_only(host) == "1"
    assert installed(host, *NSIGHT13) == NSIGHT13 and set(NSIGHT13) <= holds(host)
    settled = pyinfra(inv, runner)
    assert settled.returncode == 0 and changed_operations(settled) == [], settled.output
    t4 = time.monotonic()
    print(f"\n[timing] users + pending + plan + gate {t1 - t0:.1f} s; rollout reboot {t2 - t1:.1f} s; "
          f"no-op + gate {t3 - t2:.1f} s; admins + reboot + no-op {t4 - t3:.1f} s; total {t4 - t0:.1f} s")


def test_apt_upgrade_moves_no_toolkit_component(host, cuda13):
    """What unattended-upgrades or an operator's `apt upgrade` does: the held toolkit, its held
    components and cuDNN stay where the release put them. apt reads only the CUDA repository's
    index here (where every newer CUDA package comes from), so that Debian's own updates do not
    make the test slow."""
    exact = {"cuda-toolkit-13-0": "13.0.2-1", **COMPONENTS13, **TOOLS13, **{p: "9.17.0.29-1" for p in CUDNN13}}
    apt = ("d=$(mktemp -d) && cp /etc/apt/sources.list.d/gpufleet-cuda.list \"$d\" && DEBIAN_FRONTEND=noninteractive "
           "apt-get -o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts=\"$d\" ")
    # the premise: apt's candidate for the component is the newer point release
    assert "Candidate: 13.0.96-1" in sh(host, "apt-cache policy cuda-nvcc-13-0")
    simulated = sh(host, apt + "-s upgrade")
    assert not [line for line in simulated.splitlines() if line.startswith("Inst ") and line.split()[1] in exact], simulated
    sh(host, apt + "upgrade -y -q >/dev/null")
    assert installed(host, *exact) == exact
    assert set(exact) <= holds(host)


@pytest.fixture
def nvcc_by_hand(host, cuda13):
    """cuda-nvcc-13-0 moved by hand to the newer point release (past its hold); put back after."""
    apt = "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades --allow-change-held-packages "
    sh(host, apt + "cuda-nvcc-13-0=13.0.96-1 >/dev/null")
    yield cuda13[0]
    sh(host, apt + "cuda-nvcc-13-0=13.0.88-1 >/dev/null && apt-mark hold cuda-nvcc-13-0")


def test_gate_fails_a_toolkit_component_changed_by_hand(host, nvcc_by_hand, monkeypatch):
    assert installed(host, "cuda-nvcc-13-0") == {"cuda-nvcc-13-0": "13.0.96-1"}   # the premise
    run = gate(nvcc_by_hand, monkeypatch)
    assert run.returncode != 0
    line = check_line(run)
    assert "[FAIL]" in line and "cuda-nvcc-13-0 13.0.96 (the CUDA toolkit release ships 13.0.88) was changed by hand" \
        in line, line
    assert "-> fix: put each back at the version its CUDA toolkit release ships" in line, line


@pytest.fixture(scope="module")
def by_hand(host, runner, cuda13):
    inv, first, _ = cuda13
    assert first.returncode == 0, first.output
    sh(host, "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --allow-downgrades --allow-change-held-packages "
             + " ".join(f"{p}=9.16.0.29-1" for p in CUDNN13) + " >/dev/null")
    return inv, pyinfra(inv, runner)


def test_cudnn_changed_by_hand_is_left_and_reported(host, by_hand):
    _, run = by_hand
    assert run.returncode == 0, run.output
    assert installed(host, *CUDNN13) == {p: "9.16.0.29-1" for p in CUDNN13}
    assert ("libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was changed by hand: gpufleet installed 9.17.0.29"
            in run.output), run.output
    assert "CHANGED BY HAND" in run.output and "upgrade pending" not in run.output
    assert recorded(host)["libcudnn9-cuda-13"] == "9.17.0.29"   # the record keeps what gpufleet installed
    # nothing installed; apt's --allow-change-held-packages dropped the holds, which come back
    changed = changed_operations(run)
    assert all(op.endswith("Hold the driver stack packages")
               for op in changed), run.output
    assert set(CUDNN13) <= holds(host)
    assert "left as it is (tools/rollout puts it back)" in run.output


def test_gate_fails_a_cudnn_changed_by_hand(by_hand, monkeypatch):
    inv, _ = by_hand
    run = gate(inv, monkeypatch)
    assert run.returncode != 0
    line = check_line(run)
    assert "[FAIL]" in line and "libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was changed by hand" in line, line
    assert "-> fix: tools/rollout INVENTORY puts it back" in line, line
    # the fleet report tells it apart the same way: a failed check, listed as a hand change
    row = report_row(inv, "by-hand")
    check = report_check(row)
    assert check["status"] == "fail" and "was changed by hand" in check["message"], check
    assert any("libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was changed by hand" in p
               for p in row["drift"]["pending"]), row["drift"]


@pytest.fixture(scope="module")
def put_back(host, by_hand):
    inv, _ = by_hand
    return inv, rollout(inv)


def test_rollout_puts_a_hand_change_back_at_the_resolved_release(host, put_back, monkeypatch):
    inv, run = put_back
    assert run.returncode == 0, run.stdout + run.stderr
    assert "libcudnn9-cuda-13 9.16.0.29 -> 9.17.0.29" in run.stdout, run.stdout
    assert installed(host, *CUDNN13) == {p: "9.17.0.29-1" for p in CUDNN13}
    assert set(CUDNN13) <= holds(host)
    line = check_line(gate(inv, monkeypatch))
    assert "[PASS]" in line and "CUDA 13.0.2, cuDNN 9.17.0.29" in line, line


@pytest.fixture(scope="module")
def inventory_change(host, aptrepo, runner, put_back, tmp_path_factory):  # noqa: F811
    # CUDA 13.0 -> 12.8: new package names (cuda-toolkit-12-8, libcudnn9-*-cuda-12), pending
    inv = _inventory(host, aptrepo, tmp_path_factory, cuda_version="12.8", cudnn_version="9.10")
    first = pyinfra(inv, runner)
    pending = installed(host, "cuda-toolkit-13-0", "cuda-toolkit-12-8", *CUDNN13, *CUDNN12)
    replaced = rollout(inv)
    second = pyinfra(inv, runner)
    before = installed(host, "cuda-toolkit-13-0", "cuda-toolkit-12-8", *CUDNN13, *CUDNN12)
    moved = _inventory(host, aptrepo, tmp_path_factory, cuda_version="12.8", cudnn_version="9.17.0")
    return first, second, before, moved, pyinfra(moved, runner), pending, replaced


def test_a_changed_package_name_is_pending_then_replaced_by_the_rollout(host, inventory_change):
    first, second, before, _, _, pending, replaced = inventory_change
    assert first.returncode == 0, first.output
    assert ("CUDA toolkit upgrade pending: cuda-toolkit-13-0 13.0.2 -> cuda-toolkit-12-8 12.8.1, run tools/rollout"
            in first.output), first.output
    assert "cuDNN upgrade pending: libcudnn9-cuda-13 9.17.0.29 -> libcudnn9-cuda-12 9.10.2.21" in first.output
    # not installed alongside: the host still has only the CUDA 13 packages
    assert pending == {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.17.0.29-1" for p in CUDNN13}}, pending
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    assert "libcudnn9-cuda-13 9.17.0.29 -> libcudnn9-cuda-12 9.10.2.21 (replaces " in replaced.stdout, replaced.stdout
    assert before == {"cuda-toolkit-12-8": "12.8.1-1", **{p: "9.10.2.21-1" for p in CUDNN12}}, before
    assert {"cuda-toolkit-12-8", *CUDNN12} <= holds(host) and not set(CUDNN13) & holds(host)
    # the rollout to the next toolkit release moved its components with it, exact and held
    assert installed(host, *COMPONENTS12) == COMPONENTS12
    assert set(COMPONENTS12) <= holds(host)
    assert second.returncode == 0 and changed_operations(second) == [], second.output


def test_changed_cudnn_version_is_pending_not_a_silent_drift(host, inventory_change, monkeypatch):
    _, _, before, moved, run, _, _ = inventory_change
    before = {p: v for p, v in before.items() if p in ("cuda-toolkit-12-8", *CUDNN12)}
    assert run.returncode == 0, run.output
    assert "cuDNN upgrade pending: 9.10.2.21 -> 9.17.0.29, run tools/rollout" in run.output
    assert "CUDA/cuDNN UPGRADE PENDING" in run.output and "tools/rollout INVENTORY" in run.output
    assert not any("Install" in op for op in changed_operations(run)), run.output
    assert installed(host, "cuda-toolkit-12-8", *CUDNN12) == before  # no package changed
    assert set(CUDNN12) <= holds(host)
    line = check_line(gate(moved, monkeypatch))
    assert "[WARN]" in line and "cuDNN upgrade pending: 9.10.2.21 -> 9.17.0.29, run tools/rollout" in line, line
    assert "-> fix: tools/rollout INVENTORY" in line, line
    row = report_row(moved, "pending")
    check = report_check(row)
    assert check["status"] == "warn" and "cuDNN upgrade pending: 9.10.2.21 -> 9.17.0.29" in check["message"], check
    assert "cuDNN upgrade pending: 9.10.2.21 -> 9.17.0.29, run tools/rollout" in row["drift"]["pending"], row["drift"]


@pytest.fixture(scope="module")
def rolled_out(host, runner, inventory_change):
    moved = inventory_change[3]
    first = rollout(moved)
    after = installed(host, "cuda-toolkit-12-8", *CUDNN12)
    return moved, first, after, rollout(moved), pyinfra(moved, runner)


def test_rollout_moves_cudnn_to_exactly_the_new_release_and_holds_it(host, rolled_out, monkeypatch):
    moved, first, after, _, _ = rolled_out
    assert first.returncode == 0, first.stdout + first.stderr
    assert after == {"cuda-toolkit-12-8": "12.8.1-1", **{p: "9.17.0.29-1" for p in CUDNN12}}, after
    assert set(CUDNN12) <= holds(host)
    assert "CUDA/cuDNN: " in first.stdout and "libcudnn9-cuda-12 9.10.2.21 -> 9.17.0.29" in first.stdout
    # through the gate: the manifest (before the change) records the old release
    manifests = sorted((moved.parent / ".gpufleet/manifests" / host.name).glob("*.json"))
    assert manifests, first.stdout
    import json

    doc = json.loads(manifests[-1].read_text())
    assert doc["packages"]["libcudnn9-cuda-12"] == "9.10.2.21-1" and "libcudnn9-cuda-12 9.10.2.21 -> 9.17.0.29" in doc["reason"]
    assert recorded(host)["libcudnn9-cuda-12"] == "9.17.0.29"
    line = check_line(gate(moved, monkeypatch))
    assert "[PASS]" in line and "CUDA 12.8.1, cuDNN 9.17.0.29" in line, line


def test_second_rollout_and_second_run_change_nothing(host, rolled_out):
    _, _, after, again, run = rolled_out
    assert again.returncode == 0, again.stdout + again.stderr
    # the state file says done (or, once that rollout is forgotten, the survey finds nothing to do)
    assert "done already, not redone" in again.stdout and "starting" not in again.stdout, again.stdout
    assert run.returncode == 0 and changed_operations(run) == [], run.output
    assert installed(host, "cuda-toolkit-12-8", *CUDNN12) == after


@pytest.fixture(scope="module")
def rolled_back(host, rolled_out):
    moved = rolled_out[0]
    proc = subprocess.run([str(REPO / "tools" / "rollback"), moved.name, host.name, "-y"], cwd=moved.parent,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout, proc.stderr)
    return moved, proc


def test_rollback_puts_the_old_release_back_and_the_record_with_it(host, rolled_back, monkeypatch):
    moved, proc = rolled_back
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert installed(host, *CUDNN12) == {p: "9.10.2.21-1" for p in CUDNN12}
    assert recorded(host)["libcudnn9-cuda-12"] == "9.10.2.21"
    # gpufleet put it there: the inventory's 9.17.0 is pending again, not a hand change
    line = check_line(gate(moved, monkeypatch))
    assert "[WARN]" in line and "cuDNN upgrade pending: 9.10.2.21 -> 9.17.0.29, run tools/rollout" in line, line


@pytest.fixture(scope="module")
def moved_in_place(host, aptrepo, runner, rolled_back, tmp_path_factory):  # noqa: F811
    # the dev-box path: driver_upgrade_in_place lets all.py move it, through the same gate
    inv = _inventory(host, aptrepo, tmp_path_factory, cuda_version="12.8", cudnn_version="9.17.0",
                     driver_upgrade_in_place=True)
    return inv, pyinfra(inv, runner), pyinfra(inv, runner)


def test_in_place_moves_cudnn_to_the_exact_release_through_the_gate(host, moved_in_place, monkeypatch):
    inv, run, again = moved_in_place
    assert run.returncode == 0, run.output
    assert installed(host, "cuda-toolkit-12-8", *CUDNN12) == {"cuda-toolkit-12-8": "12.8.1-1",
                                                               **{p: "9.17.0.29-1" for p in CUDNN12}}
    assert set(CUDNN12) <= holds(host)
    assert "moved in place: cuDNN 9.10.2.21 -> 9.17.0.29 (driver_upgrade_in_place;" in run.output, run.output
    assert again.returncode == 0 and changed_operations(again) == [], again.output
    assert recorded(host)["libcudnn9-cuda-12"] == "9.17.0.29"
    line = check_line(gate(inv, monkeypatch))
    assert "[PASS]" in line and "CUDA 12.8.1, cuDNN 9.17.0.29" in line, line
