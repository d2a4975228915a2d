"""The MIG script (templates/usr/local/sbin/gpufleet-gpu-mig.j2) and its gated command
(operations/gpu.py mig_command), run by sh against the GPU simulator (a test double) in a
scratch root: partitions made, left alone when already there, re-made when one lacks its
compute instance, MIG turned off; refused (busy, nothing changed) while a GPU process runs."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from gpufleet.operations.drain import BUSY_EXIT, BUSY_MARK
from gpufleet.operations.gpu import mig_command, read_mig_outcome
from gpufleet.rendering import render
from testing.gpusim.local import LocalSim

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]


@pytest.fixture
def sim(tmp_path):
    sim = LocalSim(tmp_path / "sim", "h200x2")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("nvidia-smi", "gpusimctl"):
        wrapper = bin_dir / tool
        wrapper.write_text(f"#!/bin/sh\nexec {sim.python} {sim.root}/usr/lib/gpusim/{tool} \"$@\"\n")
        wrapper.chmod(0o755)
    # systemctl stand-in: logs its arguments; `is-active` answers from the ACTIVE variable
    (bin_dir / "systemctl").write_text(
        '#!/bin/sh\necho "$*" >> "$SYSTEMCTL_LOG"\n'
        'if [ "$1" = is-active ]; then case " $ACTIVE " in *" $3 "*) exit 0;; esac; exit 3; fi\nexit 0\n')
    (bin_dir / "systemctl").chmod(0o755)
    sim.systemctl_log = tmp_path / "systemctl.log"
    sim.env = dict(os.environ, GPUSIM_ROOT=str(sim.root), PATH=f"{bin_dir}:/usr/bin:/bin", ACTIVE="",
                   SYSTEMCTL_LOG=str(sim.systemctl_log))
    return sim


def systemctl(sim) -> list[str]:
    return sim.systemctl_log.read_text().splitlines() if sim.systemctl_log.exists() else []


def script(cdi: str = "") -> str:
    return render("usr/local/sbin/gpufleet-gpu-mig.j2", tier="hgx", setting="test", plans=[], cdi=cdi)


def run(sim, *entries: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script(), "gpufleet-gpu-mig", *entries], env=sim.env, capture_output=True,
                          text=True, check=False)


def gated(sim, *entries: str) -> subprocess.CompletedProcess:
    """The gated command in a PID namespace of its own with its own /proc: the idle check's
    device-node side sees only the test's processes, not those of this machine (test hosts of
    other e2e runs hold their simulated /dev/nvidia0, and would count as GPU work here)."""
    alone = ["unshare", "--pid", "--fork", "--mount", "--mount-proc"] if os.geteuid() == 0 else []
    return subprocess.run([*alone, "sh", "-c", mig_command(script(), entries).get_raw_value()], env=sim.env,
                          capture_output=True, text=True, check=False)


def log(sim) -> list[str]:
    path = Path(sim.root) / "run/gpusim/commands.log"
    return [line.split(" nvidia-smi ", 1)[1] for line in path.read_text().splitlines()] if path.exists() else []


def layout(sim) -> list[str]:
    return [line for line in sim.smi("mig", "-lgi").stdout.splitlines() if " MIG " in line]


def test_makes_keeps_remakes_and_turns_off(sim):
    r = run(sim, "0=3g.71gb,3g.71gb", "1=4g.71gb,2g.35gb,1g.18gb")
    assert r.returncode == 0, r.stderr
    assert log(sim) == ["-i 0 -mig 1", "mig -i 0 -dci", "mig -i 0 -dgi", "mig -i 0 -cgi 3g.71gb,3g.71gb -C",
                        "-i 1 -mig 1", "mig -i 1 -dci", "mig -i 1 -dgi", "mig -i 1 -cgi 4g.71gb,2g.35gb,1g.18gb -C"]
    assert len(layout(sim)) == 5
    # already as asked: nothing is run that changes anything
    before = len(log(sim))
    assert run(sim, "0=3g.71gb,3g.71gb", "1=4g.71gb,2g.35gb,1g.18gb").returncode == 0
    assert log(sim)[before:] == []
    # a compute instance lost: that GPU's instances are made again
    sim.smi("mig", "-i", "1", "-gi", "2", "-dci")
    before = len(log(sim))
    assert run(sim, "0=3g.71gb,3g.71gb", "1=4g.71gb,2g.35gb,1g.18gb").returncode == 0
    assert [c for c in log(sim)[before:] if "-cgi" in c] == ["mig -i 1 -cgi 4g.71gb,2g.35gb,1g.18gb -C"]
    # none: instances destroyed, MIG off
    assert run(sim, "0=none", "1=none").returncode == 0
    modes = sim.smi("--query-gpu=mig.mode.current", "--format=csv,noheader").stdout.split()
    assert modes == ["Disabled", "Disabled"]


def test_refuses_what_is_not_a_gpu_index(sim):
    r = run(sim, "0;reboot=none")
    assert r.returncode == 2 and "not a GPU index" in r.stderr
    assert log(sim) == []


def test_gated_command_changes_nothing_while_a_gpu_process_runs(sim):
    sim.ctl("add-process", "--gpu", "1", "--pid", "4242", "--name", "python3", "--used-mib", "1024")
    r = gated(sim, "1=3g.71gb,3g.71gb")
    assert r.returncode == BUSY_EXIT
    assert f"{BUSY_MARK} GPU work is running on GPU 1, not changing its mig partitions: 4242, python3" in r.stderr
    assert log(sim) == [] and layout(sim) == []
    # (the device-node side, a process holding /dev/nvidia0, runs on a test host: tests/e2e/test_mig.py)


def test_gated_command_changes_the_idle_gpus_only(sim):
    """Work on GPU 1 holds up GPU 1's change, not GPU 0's; the busy GPU is named, the rest done."""
    sim.ctl("add-process", "--gpu", "1", "--pid", "4242", "--name", "python3", "--used-mib", "1024")
    r = gated(sim, "0=3g.71gb,3g.71gb", "1=3g.71gb,3g.71gb")
    assert r.returncode == 0, r.stderr
    outcome = read_mig_outcome(True, (r.stdout + r.stderr).splitlines())
    assert outcome.busy == ("GPU 1: 4242, python3",) and not outcome.only_busy and outcome.reboot == ()
    assert [c for c in log(sim) if "-i 1" in c] == []
    assert "mig -i 0 -cgi 3g.71gb,3g.71gb -C" in log(sim)
    modes = sim.smi("--query-gpu=mig.mode.current", "--format=csv,noheader").stdout.split()
    assert modes == ["Enabled", "Disabled"]
    # the other way round: work on GPU 0 does not hold up GPU 1
    sim.ctl("remove-process", "--pid", "4242")
    sim.ctl("add-process", "--gpu", "0", "--pid", "4343", "--name", "python3", "--used-mib", "1024")
    r = gated(sim, "1=7g.141gb")
    assert r.returncode == 0 and BUSY_MARK not in r.stderr, r.stderr
    assert sim.smi("--query-gpu=mig.mode.current", "--format=csv,noheader").stdout.split() == ["Enabled", "Enabled"]


def test_a_pending_mode_change_is_made_by_a_gpu_reset_when_idle_else_a_reboot_is_needed(sim):
    """A GPU whose mode change waits for a reset (simulated: gpusimctl fault mig-needs-reset): the
    gated command resets it (its idle check found no work on it) and makes the instances; the boot
    unit's run (no --reset) and a refused reset leave it pending and say a reboot is needed."""
    sim.ctl("fault", "--gpu", "0", "mig-needs-reset")
    r = run(sim, "0=3g.71gb,3g.71gb")   # as the boot unit runs it: no reset
    assert r.returncode == 0, r.stderr
    assert read_mig_outcome(True, r.stderr.splitlines()).reboot == ("GPU 0: MIG mode Enabled is pending until the GPU is reset",)
    assert "-r -i 0" not in log(sim) and layout(sim) == []
    sim.ctl("fault", "--gpu", "0", "reset-refused")
    r = gated(sim, "0=3g.71gb,3g.71gb")
    assert r.returncode == 0, r.stderr
    assert read_mig_outcome(True, r.stderr.splitlines()).reboot == (
        "GPU 0: MIG mode Enabled is pending until the GPU is reset, and the reset was refused",)
    assert layout(sim) == []
    sim.ctl("fault", "--clear", "--gpu", "0")
    sim.ctl("fault", "--gpu", "0", "mig-needs-reset")
    r = gated(sim, "0=3g.71gb,3g.71gb")
    assert r.returncode == 0 and "REBOOT" not in r.stderr, r.stderr
    assert log(sim)[-4:] == ["-r -i 0", "mig -i 0 -dci", "mig -i 0 -dgi", "mig -i 0 -cgi 3g.71gb,3g.71gb -C"], log(sim)
    assert len(layout(sim)) == 2


def test_the_outcome_is_read_from_fixed_text_not_from_what_users_name_their_processes(sim):
    """A process name with a newline and the busy mark does not make a line of its own: the idle
    check flattens its line; the GPU is named by the check's fixed text."""
    sim.ctl("add-process", "--gpu", "0", "--pid", "4242", "--name", f"x\n{BUSY_MARK} GPU work is running on GPU 1,"
            " not changing its mig partitions: y", "--used-mib", "1")
    r = gated(sim, "0=3g.71gb,3g.71gb", "1=3g.71gb,3g.71gb")
    outcome = read_mig_outcome(r.returncode == 0, (r.stdout + r.stderr).splitlines())
    assert [b.split(":")[0] for b in outcome.busy] == ["GPU 0"], outcome
    assert sim.smi("--query-gpu=mig.mode.current", "--format=csv,noheader").stdout.split() == ["Disabled", "Enabled"]


def test_dcgm_is_stopped_for_a_mode_change_and_started_again(sim):
    sim.env["ACTIVE"] = "nvidia-dcgm.service nvidia-dcgm-exporter.service"
    assert run(sim, "0=7g.141gb").returncode == 0
    calls = [c for c in systemctl(sim) if not c.startswith("is-active")]
    assert calls == ["stop nvidia-dcgm-exporter.service", "stop nvidia-dcgm.service",
                     "start nvidia-dcgm.service", "start nvidia-dcgm-exporter.service"]
    # instances only (no mode change): the running exporter is restarted to see them
    sim.systemctl_log.unlink()
    assert run(sim, "0=3g.71gb,3g.71gb").returncode == 0
    assert [c for c in systemctl(sim) if not c.startswith("is-active")] == ["try-restart nvidia-dcgm-exporter.service"]
    # nothing to change: systemd is not asked anything
    sim.systemctl_log.unlink()
    assert run(sim, "0=3g.71gb,3g.71gb").returncode == 0
    assert systemctl(sim) == []


def test_a_gpu_the_check_cannot_read_counts_as_busy(sim):
    """No answer for a GPU index (here: one the host does not have) is not "idle"."""
    r = gated(sim, "5=3g.71gb")
    assert r.returncode == BUSY_EXIT
    assert f"{BUSY_MARK} GPU work is running on GPU 5, not changing its mig partitions: nvidia-smi does not name GPU 5" \
        in r.stderr
    assert log(sim) == []
