"""operations/driver_upgrade.py: the package change as a transient unit, its arguments, and the
PackageChange fact (unit state + dpkg --audit) it is resumed from."""
import subprocess

import pytest

from gpufleet.facts.rollout import PackageChange
from gpufleet.operations import driver_upgrade as du
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
    assert cmd.startswith("sh -c '") and cmd.endswith("gpufleet-package-change install=nvidia-open=580.126.09-1")
    assert "580" not in du._RUN and "580" not in du.PACKAGE_CHANGE_SCRIPT


def test_script_refuses_unexpected_words_itself(tmp_path):
    script = tmp_path / "pc"
    script.write_text(du.PACKAGE_CHANGE_SCRIPT.replace("/var/log/gpufleet", str(tmp_path)))
    r = subprocess.run(["sh", str(script), "install=a=1;id"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "refused argument" in (tmp_path / "package-change.log").read_text()


@pytest.mark.parametrize("shell", [du._RUN, du.PACKAGE_CHANGE_SCRIPT, IDLE_CHECK])
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
