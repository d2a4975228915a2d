"""The GPU simulator (a test double, not NVIDIA software) learns MIG: `nvidia-smi -mig 0|1`,
`nvidia-smi mig -lgip/-lgipp/-lgi/-lci/-cgi/-cci/-dci/-dgi` and the MIG mode lines of `-q` and
`--query-gpu`; the mode survives a reboot, the instances do not (as on a real GPU)."""

from pathlib import Path

import pytest

from testing.gpusim.local import LocalSim

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]

HEALTH = Path(__file__).resolve().parents[1] / "fixtures/nvidia/h200-x1/health"


def recorded(name: str) -> str:
    """The output part of a recorded file: after the `$ command` line, before `[rc=N]`."""
    return (HEALTH / name).read_text().split("\n", 1)[1].rsplit("[rc=", 1)[0]


def modes(sim) -> list[str]:
    r = sim.smi("--query-gpu=index,mig.mode.current,mig.mode.pending", "--format=csv,noheader")
    assert r.returncode == 0, r.stdout
    return r.stdout.splitlines()


@pytest.fixture
def h200(tmp_path):
    return LocalSim(tmp_path, "h200")


@pytest.fixture
def h200x2(tmp_path):
    return LocalSim(tmp_path, "h200x2")


def test_profiles_and_placements_print_as_the_recorded_h200(h200):
    for args, name in ((("mig", "-lgip"), "mig-lgip.txt"), (("mig", "-lgipp"), "mig-lgipp.txt")):
        r = h200.smi(*args)
        assert (r.returncode, r.stdout) == (0, recorded(name))


def test_mode_instances_and_the_q_lines(h200x2):
    sim = h200x2
    assert modes(sim) == ["0, Disabled, Disabled", "1, Disabled, Disabled"]
    r = sim.smi("mig", "-lgi")
    assert (r.returncode, r.stdout) == (6, "No MIG-enabled devices found.\n")
    r = sim.smi("-i", "0", "-mig", "1")
    assert (r.returncode, r.stdout) == (0, "Enabled MIG Mode for GPU 00000000:00:06.0\nAll done.\n")
    assert modes(sim) == ["0, Enabled, Enabled", "1, Disabled, Disabled"]
    q = sim.smi("-q", "-i", "0").stdout
    assert "    MIG Mode\n        Current                                        : Enabled\n" \
           "        Pending                                        : Enabled\n" in q
    assert "<current_mig>Enabled</current_mig>" in sim.smi("-q", "-x", "-i", "0").stdout

    r = sim.smi("mig", "-i", "0", "-cgi", "3g.71gb,9", "-C")
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines() == [
        "Successfully created GPU instance ID  1 on GPU  0 using profile MIG 3g.71gb (ID  9)",
        "Successfully created compute instance ID  0 on GPU  0 GPU instance ID  1 using profile MIG 3g.71gb (ID  2)",
        "Successfully created GPU instance ID  2 on GPU  0 using profile MIG 3g.71gb (ID  9)",
        "Successfully created compute instance ID  0 on GPU  0 GPU instance ID  2 using profile MIG 3g.71gb (ID  2)",
    ]
    lgi = sim.smi("mig", "-lgi").stdout.splitlines()
    assert "|   0  MIG 3g.71gb          9        1          0:4     |" in lgi
    assert "|   0  MIG 3g.71gb          9        2          4:4     |" in lgi
    assert len({len(line) for line in lgi}) == 1
    lci = sim.smi("mig", "-lci").stdout.splitlines()
    assert "|   0      2       MIG 3g.71gb          2         0          0:3     |" in lci
    # full: a third instance does not fit, and -lgip says so (Free 0)
    r = sim.smi("mig", "-i", "0", "-cgi", "19")
    assert (r.returncode, r.stdout) == (23, "Unable to create a GPU instance on GPU  0 using profile 19: "
                                            "Insufficient Resources\n")
    assert "|   0  MIG 3g.71gb          9     0/2 " in sim.smi("mig", "-lgip", "-i", "0").stdout
    # clocks are not settable in MIG mode; the other GPU's are
    r = sim.smi("-i", "0", "-ac", "3201,1980")
    assert r.returncode == 3 and "in MIG mode" in r.stdout
    assert sim.smi("-i", "1", "-ac", "3201,1980").returncode == 0


def test_instances_are_lost_on_reboot_the_mode_is_kept(h200):
    h200.smi("-mig", "1")
    h200.smi("mig", "-cgi", "9,9", "-C")
    h200.reboot()
    assert modes(h200) == ["0, Enabled, Enabled"]
    r = h200.smi("mig", "-lgi")
    assert (r.returncode, r.stdout) == (6, "No GPU instances found: Not Found\n")


def test_destroy_in_order_then_disable(h200):
    h200.smi("-mig", "1")
    h200.smi("mig", "-cgi", "9,9", "-C")
    r = h200.smi("-mig", "0")                       # instances left: refused
    assert r.returncode == 19 and "In use by another client" in r.stdout
    r = h200.smi("mig", "-dgi")                     # compute instances left: refused
    assert r.returncode == 19
    assert h200.smi("mig", "-dci").stdout.count("Successfully destroyed compute instance") == 2
    assert h200.smi("mig", "-dgi").stdout.count("Successfully destroyed GPU instance") == 2
    r = h200.smi("-mig", "0")
    assert (r.returncode, r.stdout) == (0, "Disabled MIG Mode for GPU 00000000:00:06.0\nAll done.\n")
    log = (h200.root / "run/gpusim/commands.log").read_text()
    assert "nvidia-smi -mig 1" in log and "nvidia-smi mig -cgi 9,9 -C" in log


def test_busy_gpu_leaves_the_mode_pending(h200):
    h200.ctl("add-process", "--gpu", "0", "--pid", "4242", "--name", "python3", "--used-mib", "1024")
    r = h200.smi("-mig", "1")
    assert r.returncode == 0 and "pending enable state" in r.stdout
    assert modes(h200) == ["0, Disabled, Enabled"]


def test_gpus_without_mig(tmp_path):
    t4 = LocalSim(tmp_path, "t4")
    r = t4.smi("-mig", "1")
    assert r.returncode == 3 and "Not Supported" in r.stdout
    assert t4.smi("mig", "-lgip").returncode == 6
    assert modes(t4) == ["0, N/A, N/A"]


def test_a100_profiles_from_the_mig_user_guide(tmp_path):
    a100 = LocalSim(tmp_path, "a100x4")
    a100.smi("-i", "2", "-mig", "1")
    r = a100.smi("mig", "-i", "2", "-cgi", "4g.20gb,2g.10gb,1g.5gb", "-C")
    assert r.returncode == 0, r.stdout
    lgi = a100.smi("mig", "-lgi").stdout
    assert "MIG 4g.20gb          5" in lgi and "MIG 2g.10gb         14" in lgi and "MIG 1g.5gb          19" in lgi
    r = a100.smi("mig", "-i", "2", "-cgi", "3g.40gb")
    assert r.returncode == 2 and "Invalid Argument" in r.stdout


def test_a_pending_mode_is_made_current_by_a_gpu_reset_or_a_boot(h200x2):
    """`-r -i N` (simulated; messages UNVERIFIED) makes a pending MIG mode current unless a process
    uses the GPU or the reset is refused (gpusimctl fault reset-refused); a boot (gpusim-load-module)
    makes it current too."""
    import os
    import subprocess
    import sys

    sim = h200x2
    sim.ctl("fault", "--gpu", "1", "mig-needs-reset")
    assert sim.smi("-i", "1", "-mig", "1").returncode == 0
    assert modes(sim) == ["0, Disabled, Disabled", "1, Disabled, Enabled"]
    assert sim.smi("-r").returncode == 2                       # which GPU: -i is needed
    assert sim.smi("-r", "-i", "1", uid=1000).returncode == 4  # root only
    sim.ctl("add-process", "--gpu", "1", "--pid", "7", "--name", "python3", "--used-mib", "1")
    r = sim.smi("-r", "-i", "1")
    assert r.returncode == 19 and "is currently in use by another process" in r.stdout
    sim.ctl("remove-process", "--pid", "7")
    sim.ctl("fault", "--gpu", "1", "reset-refused")
    assert sim.smi("-r", "-i", "1").returncode == 19
    sim.ctl("fault", "--clear", "--gpu", "1")
    sim.ctl("fault", "--gpu", "1", "mig-needs-reset")
    r = sim.smi("-r", "-i", "1")
    assert (r.returncode, r.stdout) == (0, "GPU 00000000:00:07.0 was successfully reset.\nAll done.\n")
    assert modes(sim) == ["0, Disabled, Disabled", "1, Enabled, Enabled"]
    # pending again (disable), then a boot
    assert sim.smi("-i", "1", "-mig", "0").returncode == 0
    assert modes(sim)[1] == "1, Enabled, Disabled"
    sim.reboot()
    subprocess.run([sys.executable, str(sim.root / "usr/lib/gpusim/gpusim-load-module")], check=True,
                   env=dict(os.environ, GPUSIM_ROOT=str(sim.root)), capture_output=True)
    assert modes(sim)[1] == "1, Disabled, Disabled"
