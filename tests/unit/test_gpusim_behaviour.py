"""Exercises the GPU simulator (a test double, not NVIDIA software): GPU state that persists
between calls and is lost on reboot, the rejections and exit codes real nvidia-smi gives,
the non-recorded models (h100x8, a100x4, t4, v100), driver choice and simulated processes."""

import pytest

from testing.gpusim.local import LocalSim

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]

NO_PERMISSION = 4
INVALID_ARGUMENT = 2
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
DEPRECATED = 26


def query(sim, fields, *extra):
    r = sim.smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits", *extra)
    assert r.returncode == 0, r.stdout
    return [line.split(", ") for line in r.stdout.splitlines()]


@pytest.fixture
def h200(tmp_path):
    return LocalSim(tmp_path, "h200x2")


@pytest.fixture
def a100(tmp_path):
    return LocalSim(tmp_path, "a100x4@535.247.01")


# ---------------------------------------------------------------- state

def test_persistence_mode_persists_and_is_lost_on_reboot(h200):
    r = h200.smi("-pm", "0", "-i", "1")
    assert (r.returncode, r.stdout) == (0, "Disabled persistence mode for GPU 00000000:00:07.0.\nAll done.\n")
    assert query(h200, "index,persistence_mode") == [["0", "Enabled"], ["1", "Disabled"]]
    r = h200.smi("-pm", "1")
    assert r.stdout == ("Persistence mode is already Enabled for GPU 00000000:00:06.0.\n"
                        "Enabled persistence mode for GPU 00000000:00:07.0.\nAll done.\n")
    h200.smi("-pm", "0")
    h200.reboot()
    # The recorded hosts booted with persistence on; other models boot with it off.
    assert query(h200, "persistence_mode") == [["Enabled"], ["Enabled"]]


def test_application_clocks_change_query_and_q_output(a100):
    assert query(a100, "clocks.applications.graphics,clocks.applications.memory", "-i", "2") == [["1095", "1215"]]
    r = a100.smi("-i", "2", "-ac", "1215,1410")
    assert (r.returncode, r.stdout) == (0, 'Applications clocks set to "(MEM 1215, SM 1410)" for GPU 00000000:00:08.0\nAll done.\n')
    assert query(a100, "index,clocks.applications.graphics") == [["0", "1095"], ["1", "1095"], ["2", "1410"], ["3", "1095"]]
    clock = a100.smi("-q", "-d", "CLOCK", "-i", "2").stdout
    assert "    Applications Clocks\n        Graphics                                       : 1410 MHz\n" in clock
    assert "    Default Applications Clocks\n        Graphics                                       : 1095 MHz\n" in clock
    assert a100.smi("-rac").returncode == 0
    assert query(a100, "clocks.applications.graphics", "-i", "2") == [["1095"]]


def test_locked_clocks_show_in_current_clocks(h200):
    r = h200.smi("-lgc", "1980,1980", "-i", "0")
    assert r.stdout == 'GPU clocks set to "(gpuClkMin 1980, gpuClkMax 1980)" for GPU 00000000:00:06.0\nAll done.\n'
    r = h200.smi("-lmc", "2201")
    assert r.stdout.splitlines()[0] == 'Memory clocks set to "(memClkMin 2201, memClkMax 2201)" for GPU 00000000:00:06.0'
    assert query(h200, "clocks.gr,clocks.sm,clocks.mem") == [["1980", "1980", "2201"], ["390", "390", "2201"]]  # GPU 1 idled at 390 MHz when recorded
    assert "        Graphics                                       : 1980 MHz\n" in h200.smi("-q", "-d", "CLOCK", "-i", "0").stdout
    assert h200.smi("-rgc").stdout == "All done.\n"
    assert h200.smi("-rmc").stdout == "All done.\n"
    assert query(h200, "clocks.gr,clocks.mem", "-i", "0") == [["345", "3201"]]


# ---------------------------------------------------------------- rejections

def test_unsupported_clock_pair_is_rejected(a100):
    r = a100.smi("-ac", "1215,1000", "-i", "0")
    assert r.returncode == INVALID_ARGUMENT
    assert r.stdout.splitlines()[:2] == [
        'Specified clock combination "(MEM 1215, SM 1000)" is not supported for GPU 00000000:00:06.0. '
        "Run 'nvidia-smi -q -d SUPPORTED_CLOCKS' to see list of supported clock combinations",
        "Treating as warning and moving on."]
    assert query(a100, "clocks.applications.graphics", "-i", "0") == [["1095"]]


@pytest.mark.parametrize("args", [["-ac", "1215,1410"], ["-rac"], ["-lgc", "1410,1410"], ["-rgc"], ["-lmc", "1215,1215"], ["-rmc"]])
def test_clock_changes_need_root(a100, args):
    r = a100.smi(*args, uid=1000)
    assert r.returncode == NO_PERMISSION
    assert r.stdout == ("The current user does not have permission to change clocks for GPU 00000000:00:06.0.\n"
                        "Terminating early due to previous errors.\n")


def test_persistence_mode_needs_root(tmp_path):
    sim = LocalSim(tmp_path, "t4")
    r = sim.smi("-pm", "1", uid=1000)
    assert r.returncode == NO_PERMISSION
    assert r.stdout == ("Unable to set persistence mode for GPU 00000000:00:06.0: Insufficient Permissions\n"
                        "Terminating early due to previous errors.\n")
    assert query(sim, "persistence_mode") == [["Disabled"]]


def test_bad_gpu_index(h200):
    for args in (["-i", "2"], ["-i", "5", "-pm", "1"], ["-i", "2", "-q"]):
        r = h200.smi(*args)
        assert (r.returncode, r.stdout) == (NOT_FOUND, "No devices were found\n")


def test_unknown_option_and_bad_field(h200):
    r = h200.smi("--bogus")
    assert (r.returncode, r.stdout) == (INVALID_ARGUMENT, "ERROR: Option --bogus is not recognized. Please run 'nvidia-smi -h' for help.\n")
    r = h200.smi("--query-gpu=index,bogus", "--format=csv")
    assert (r.returncode, r.stdout) == (INVALID_ARGUMENT, 'Field "bogus" is not a valid field to query.\n')
    r = h200.smi("-ac", "3201")
    assert r.returncode == INVALID_ARGUMENT


def test_r595_deprecates_application_clocks_but_not_locks(tmp_path):
    sim = LocalSim(tmp_path, "t4@595.45.04")
    r = sim.smi("-ac", "5001,1590")
    assert (r.returncode, r.stdout) == (DEPRECATED, "The requested functionality has been deprecated.\n")
    q = sim.smi("-q").stdout
    assert ("    Applications Clocks\n"
            "        Graphics                                       : Requested functionality has been deprecated\n") in q
    assert "Default Applications Clocks\n        Graphics                                       : Requested functionality" in q
    assert query(sim, "clocks.applications.graphics") == [["[Requested functionality has been deprecated]"]]
    assert sim.smi("-lgc", "1590,1590").returncode == 0
    assert query(sim, "clocks.gr") == [["1590"]]
    # R595 prints the legacy wording for persistence mode.
    assert sim.smi("-pm", "1").stdout.startswith("Enabled Legacy persistence mode for GPU 00000000:00:06.0.")
    assert "CUDA Version: 13.2" in sim.smi().stdout


def test_memory_clock_locks_need_ampere(tmp_path):
    sim = LocalSim(tmp_path, "v100")
    r = sim.smi("-lmc", "877,877")
    assert (r.returncode, r.stdout) == (0, "Setting locked Memory clocks is not supported for GPU 00000000:00:06.0.\n"
                                           "Treating as warning and moving on.\nAll done.\n")


def test_no_driver(tmp_path):
    sim = LocalSim(tmp_path, "t4:nodriver")
    for args in ([], ["-L"], ["-pm", "1"], ["--query-gpu=name", "--format=csv"]):
        r = sim.smi(*args)
        assert r.returncode == DRIVER_NOT_LOADED
        assert r.stdout == ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                            "Make sure that the latest NVIDIA driver is installed and running.\n")


def test_driver_without_support_for_the_gpu_finds_no_devices(tmp_path):
    sim = LocalSim(tmp_path, "v100@595.45.04")  # Volta ended with R580
    r = sim.smi("-L")
    assert (r.returncode, r.stdout) == (NOT_FOUND, "No devices were found\n")


# ---------------------------------------------------------------- models

def test_h100x8_nvswitch_topology(tmp_path):
    sim = LocalSim(tmp_path, "h100x8")
    topo = sim.smi("topo", "-m").stdout.splitlines()
    assert topo[0].startswith("\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity")
    rows = [line.split("\t") for line in topo[1:9]]
    assert [r[0] for r in rows] == [f"GPU{i}" for i in range(8)]
    assert all(r[1 + j] == (" X " if i == j else "NV18") for i, r in enumerate(rows) for j in range(8))
    assert len(sim.smi("-L").stdout.splitlines()) == 8
    assert query(sim, "name,pci.device_id,compute_cap,clocks.max.memory,fabric.state", "-i", "7") == [
        ["NVIDIA H100 80GB HBM3", "0x233010DE", "9.0", "2619", "Completed"]]
    switches = [d for d in (sim.work / "gpusim-sys-bus-pci-devices").iterdir()
                if (d / "class").read_text() == "0x068000\n"]
    assert len(switches) == 4
    assert {(d / "device").read_text() for d in switches} == {"0x22a3\n"}
    assert sim.smi("nvlink", "-s").stdout.count("Link 17: 26.562 GB/s") == 8


@pytest.mark.parametrize("spec,name,cc,device", [
    ("t4", "Tesla T4", "7.5", "0x1EB810DE"),
    ("v100", "Tesla V100-SXM2-16GB", "7.0", "0x1DB110DE"),
    ("a100x4", "NVIDIA A100-SXM4-40GB", "8.0", "0x20B010DE"),
])
def test_model_identity(tmp_path, spec, name, cc, device):
    sim = LocalSim(tmp_path, spec)
    rows = query(sim, "name,compute_cap,pci.device_id")
    assert rows == [[name, cc, device]] * len(rows)
    assert sim.smi("-q").returncode == 0 and sim.smi("-q", "-x").returncode == 0


def test_supported_clocks_follow_the_model(tmp_path):
    sim = LocalSim(tmp_path, "v100")
    text = sim.smi("-q", "-d", "SUPPORTED_CLOCKS").stdout
    assert "        Memory                                         : 877 MHz\n" in text
    assert "            Graphics                                   : 1312 MHz\n" in text  # the default pair
    assert sim.smi("-ac", "877,1530").returncode == 0


# ---------------------------------------------------------------- processes

def test_simulated_processes_are_listed(h200):
    assert h200.ctl("add-process", "--gpu", "1", "--pid", "4242", "--name", "python3", "--used-mib", "1024").returncode == 0
    r = h200.smi("--query-compute-apps=pid,process_name,used_memory", "--format=csv")
    assert r.stdout == "pid, process_name, used_gpu_memory [MiB]\n4242, python3, 1024 MiB\n"
    table = h200.smi().stdout
    assert "4242" in table and "python3" in table and "1024MiB / 143771MiB" in table
    assert "Process ID                                     : 4242" in h200.smi("-q", "-i", "1").stdout
    assert query(h200, "memory.used") == [["0"], ["1024"]]
    assert h200.ctl("remove-process", "--pid", "4242").returncode == 0
    assert "No running processes found" in h200.smi().stdout
