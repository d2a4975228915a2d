"""operations/driver_upgrade.py: the package change as a transient unit, its arguments, and the
PackageChange fact (unit state + dpkg --audit) it is resumed from."""
import subprocess

import pytest

from gpufleet.facts.packages import PackageChange
from gpufleet.operations import driver_upgrade as du
from gpufleet.operations import driver, reboot
from gpufleet.operations.drain import BUSY_EXIT, BUSY_MARK, idle_check
from gpufleet.operations.reboot import IDLE_CHECK

pytestmark = pytest.mark.unit


def test_arguments_are_tagged_words_and_refuse_shell_syntax():
    args = du.change_arguments({"nvidia-open": "580.126.09-1"}, ["nvidia-driver-pinning-580.95.05"],
                               ["nvidia-open"], ["nvidia-open"], downgrade=True)
    assert args == ["unhold=nvidia-open", "install=nvidia-open=580.126.09-1",
                    "remove=nvidia-driver-pinning-580.95.05", "hold=nvidia-open", "downgrade"]
    for bad in ("1; reboot", "$(id)", "x y", "*"):
        with pytest.raises(ValueError):
            du.change_arguments({"nvidia-open": bad}, [], [], [], False)


def test_values_reach_the_host_as_arguments_of_fixed_text():
    cmd = du.package_change_command(["install=nvidia-open=580.126.09-1"]).get_raw_value()
    assert cmd.startswith("sh -c '") and cmd.endswith(
        "gpufleet-package-change /var/lib/gpufleet/libexec/package-change install=nvidia-open=580.126.09-1")
    assert "580" not in du._RUN and "580" not in du.PACKAGE_CHANGE_SCRIPT


def test_script_refuses_unexpected_words_itself(tmp_path):
    script = tmp_path / "pc"
    script.write_text(du.PACKAGE_CHANGE_SCRIPT.replace("/var/log/gpufleet", str(tmp_path)))
    r = subprocess.run(["sh", str(script), "install=a=1;id"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "refused argument" in (tmp_path / "package-change.log").read_text()


@pytest.mark.parametrize("shell", [du._RUN, du._RUN_IF_IDLE, du.PACKAGE_CHANGE_SCRIPT, IDLE_CHECK,
                                   reboot._REBOOT, reboot._REBOOT_IF_IDLE, driver._REPO_KEY_SCRIPT])
def test_shell_text_parses(shell):
    assert subprocess.run(["sh", "-n", "-c", shell]).returncode == 0


def test_fact_running_unit_and_audit():
    out = ["LoadState=loaded", "SubState=running", "Result=success", "ExecMainStatus=0",
           "audit: The following packages are only half configured, probably due to problems",
           "audit:  nvidia-kernel-open-dkms NVIDIA open kernel module DKMS source"]
    data = PackageChange().process(out)
    assert data.running and data.result == "success" and len(data.audit) == 2


def test_fact_failed_unit_clean_dpkg():
    data = PackageChange().process(["LoadState=loaded", "SubState=failed", "Result=exit-code", "ExecMainStatus=100"])
    assert not data.running and data.result == "exit-code" and data.status == 100 and data.audit == ()


def test_fact_never_run():
    data = PackageChange().process(["LoadState=not-found", "SubState=dead", "Result=success", "ExecMainStatus=0"])
    assert not data.running and data.result is None and data.status is None


# --- idle right before: the check is part of the command that acts ------------------------------

# stand-ins on PATH that record their argv; nvidia-smi lists $GPU_APPS as compute processes
STUBS = {
    "nvidia-smi": 'printf "%s\\n" "nvidia-smi $*" >> "$LOG"; [ -z "$GPU_APPS" ] || echo "$GPU_APPS"',
    "systemctl": 'printf "%s\\n" "systemctl $*" >> "$LOG"; case "$*" in *SubState*) echo exited;; '
                 '*Result*) echo success;; *ExecMainStatus*) echo 0;; esac',
    "systemd-run": 'printf "%s\\n" "systemd-run $*" >> "$LOG"',
    "logger": 'printf "%s\\n" "logger $*" >> "$LOG"',
    "sleep": 'exit 0',
}


@pytest.fixture
def stubs(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body + "\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    log.write_text("")
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log)}, log


def sh(text: str, args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", text, "test", *args], env=env, capture_output=True, text=True, timeout=30)


def test_gate_refuses_the_package_change_when_a_job_started_no_unit_started(stubs):
    env, log = stubs
    r = sh(du._RUN_IF_IDLE, [du.SCRIPT, "install=nvidia-open=580.126.09-1"], {**env, "GPU_APPS": "4242, python3"})
    assert r.returncode == BUSY_EXIT, r.stderr
    assert r.stderr.startswith(BUSY_MARK + " GPU work is running, not changing the driver packages: 4242, python3")
    assert "systemd-run" not in log.read_text()          # refused before the unit, nothing changed


def test_gate_lets_an_idle_host_start_the_unit_with_its_script_and_arguments(stubs):
    env, log = stubs
    r = sh(du._RUN_IF_IDLE, [du.SCRIPT, "install=nvidia-open=580.126.09-1", "hold=nvidia-open"], {**env, "GPU_APPS": ""})
    assert r.returncode == 0, r.stderr
    assert "finished: exit status 0" in r.stdout
    [run] = [line for line in log.read_text().splitlines() if line.startswith("systemd-run")]
    assert run.endswith(f"-p Type=exec {du.SCRIPT} install=nvidia-open=580.126.09-1 hold=nvidia-open")
    # the check ran first: nvidia-smi asked before the unit
    lines = log.read_text().splitlines()
    assert lines.index(next(x for x in lines if x.startswith("nvidia-smi"))) < lines.index(run)


def test_reboot_refused_in_its_own_command_when_busy(stubs, tmp_path):
    """The marker is written first, by its own command; the idle check and the reboot are one."""
    env, log = stubs
    marker = tmp_path / "marker"
    assert sh(reboot._MARK.replace(reboot.MARKER, str(marker)), ["nonce"], env).returncode == 0
    assert marker.read_text() == "nonce\n"
    r = sh(reboot._REBOOT_IF_IDLE, ["reboot: test"], {**env, "GPU_APPS": "77, train.py"})
    assert r.returncode == BUSY_EXIT and r.stderr.startswith(BUSY_MARK + " GPU work is running, not rebooting: 77")
    assert "systemctl" not in log.read_text() and "logger" not in log.read_text()
    r = sh(reboot._REBOOT_IF_IDLE, ["reboot: test"], {**env, "GPU_APPS": ""})
    assert r.returncode == 0
    assert "logger -t gpufleet -- reboot: test" in log.read_text()


def test_idle_check_takes_only_fixed_phrases():
    with pytest.raises(ValueError):
        idle_check("not rebooting; reboot")


def test_gpu_work_matches_device_node_links_whole(tmp_path):
    """GPU_WORK's holders: a process whose fd link is the node; not one holding a file a user named
    "... -> /dev/nvidia0" (which `ls -l` text would show ending in " /dev/nvidia0"). Run with the
    node's folder swapped for a scratch one: /dev is not this test's to write."""
    import subprocess
    from pathlib import Path

    from gpufleet.facts._common import GPU_WORK

    node = tmp_path / "nvidia0"
    node.touch()
    # a folder named "x " holding the node's path again: its link text ends in " <tmp>/nvidia0"
    spoof = Path(f"{tmp_path}/x {tmp_path}")
    spoof.mkdir(parents=True)
    (spoof / "nvidia0").touch()
    text = GPU_WORK.replace("/dev/nvidia", f"{tmp_path}/nvidia") + '\necho "pids=$pids"'
    holder = subprocess.Popen(["sleep", "30"], stdin=open(node))
    user = subprocess.Popen(["sleep", "30"], stdin=open(spoof / "nvidia0"))
    try:
        out = subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True).stdout
    finally:
        holder.kill()
        user.kill()
        holder.wait()
        user.wait()
    assert out.strip() == f"pids={holder.pid}"


def test_gpu_device_users_match_links_whole(tmp_path):
    """GpuDeviceUsers (deploys/driver.py's and tools/rollback's holders of a GPU): the same whole-link
    test. A user's file named "x -> <node>" or "x<newline><node>" is no holder (the old `ls -l | grep`
    took both for one), the node's own holder is."""
    import subprocess
    from pathlib import Path

    from gpufleet.facts.driver import GpuDeviceUsers

    node = tmp_path / "nvidia0"
    node.touch()
    # folders named so that a held file's link text ends in " <node>", or in a line "<node>"
    spoofs = [Path(f"{tmp_path}/x -> {tmp_path}/nvidia0"), Path(f"{tmp_path}/y\n{tmp_path}/nvidia0")]
    for spoof in spoofs:
        spoof.parent.mkdir(parents=True)
        spoof.touch()
    fact = GpuDeviceUsers()
    text = fact.command().replace("/dev/nvidia", f"{tmp_path}/nvidia")
    holders = [subprocess.Popen(["sleep", "30"], stdin=open(path)) for path in (node, *spoofs)]
    try:
        out = subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True).stdout
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert fact.process(out.splitlines()) == [holders[0].pid]
