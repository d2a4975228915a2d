"""Exercises the GPU simulator (a test double, not NVIDIA software): for the recorded hosts
h200x1 and h200x2, every recorded nvidia-smi command the simulator supports, and the fake
/proc and /sys views, must reproduce the recorded real output byte for byte, apart from
timestamp lines."""

import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

from testing.gpusim.local import LocalSim
from testing.gpusim.install import PROC_DRIVER_DIR, _load_module_script

pytestmark = [pytest.mark.unit, pytest.mark.gpusim]

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "nvidia"
HOSTS = {"h200x1": "h200-x1", "h200x2": "h200-x2"}
# Recorded files the simulator does not reproduce: nvml.json needs the real NVML library.
# health/: its one query line is compared field by field in test_gpusim_faults.py; its -q views,
# MIG profiles and NVML readings are not simulated
NOT_SIMULATED = {"nvml.json", "health"}
NON_SMI = {"proc-version.txt", "proc-gpus.txt", "sys-pci.txt", "proc-params.txt"}


def commands(folder):
    out = []
    for line in (FIXTURES / folder / "COMMANDS.txt").read_text().splitlines():
        name, _, cmd = line.partition(": ")
        if name not in NOT_SIMULATED:
            out.append((name, cmd))
    return out


CASES = [(spec, name, cmd) for spec, folder in HOSTS.items() for name, cmd in commands(folder)]


def mask_timestamps(text):
    """Drop what changes with the clock: the date atop plain nvidia-smi and -q Timestamp lines."""
    text = re.sub(r"^Timestamp( +): .*$", r"Timestamp\1: <masked>", text, flags=re.M)
    text = re.sub(r"^\t<timestamp>.*</timestamp>$", "\t<timestamp><masked></timestamp>", text, flags=re.M)
    return re.sub(r"\A\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}       \n", "<masked date>\n", text)


def proc_gpus_listing(proc):
    """What COMMANDS.txt's loop over /proc/driver/nvidia/gpus/*/information prints."""
    out = ""
    for info in sorted(proc.glob("gpus/*/information")):
        out += f"== /proc/driver/nvidia/gpus/{info.parent.name}/information\n" + info.read_text()
    return out


def sys_pci_listing(pci):
    """What COMMANDS.txt's loop over /sys/bus/pci/devices prints (vendor 0x10de only)."""
    out = ""
    for d in sorted(pci.iterdir()):
        if (d / "vendor").read_text().strip() != "0x10de":
            continue
        driver = pathlib.Path(str((d / "driver").readlink())).name if (d / "driver").is_symlink() else ""
        out += (f"{d.name} vendor=0x10de device={(d / 'device').read_text().strip()} "
                f"class={(d / 'class').read_text().strip()} subsys={(d / 'subsystem_device').read_text().strip()} "
                f"driver={driver}\n")
    return out


@pytest.mark.parametrize("spec,name,cmd", CASES, ids=[f"{s}-{n}" for s, n, _ in CASES])
def test_output_identical_to_recording(tmp_path_factory, spec, name, cmd, request):
    sim = _sim_for(spec, tmp_path_factory, request)
    recorded = (FIXTURES / HOSTS[spec] / name).read_text()
    if name == "proc-version.txt":
        actual = (sim.root / PROC_DRIVER_DIR / "nvidia" / "version").read_text()
    elif name == "proc-gpus.txt":
        actual = proc_gpus_listing(sim.root / PROC_DRIVER_DIR / "nvidia")
    elif name == "sys-pci.txt":
        actual = sys_pci_listing(sim.work / "gpusim-sys-bus-pci-devices")
    elif name == "proc-params.txt":
        # recorded in the shell's own words ("$ cat ...", "[rc=0]"); the recorded host ran with
        # profiling for users (RmProfilingAdminOnly: 0): the same option, read at the module's load
        conf = sim.root / "etc/modprobe.d/recorded-host.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("options nvidia NVreg_RestrictProfilingToAdminUsers=0\n")
        _load_module_script().write_params(proc=str(sim.root / PROC_DRIVER_DIR / "nvidia"), root=str(sim.root))
        conf.unlink()
        actual = f"$ {cmd}\n" + (sim.root / PROC_DRIVER_DIR / "nvidia" / "params").read_text() + "[rc=0]\n"
    else:
        argv = shlex.split(cmd)
        assert argv[0] == "nvidia-smi"
        result = sim.smi(*argv[1:])
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stderr == ""
        actual = result.stdout
    assert mask_timestamps(actual) == mask_timestamps(recorded)


_SIMS = {}


def _sim_for(spec, tmp_path_factory, request):
    # One simulated host per spec for the whole module: the commands only read state.
    if spec not in _SIMS:
        _SIMS[spec] = LocalSim(tmp_path_factory.mktemp(spec), spec)
    return _SIMS[spec]


def test_every_recorded_file_is_covered():
    for folder in HOSTS.values():
        on_disk = {p.name for p in (FIXTURES / folder).iterdir()} - {"COMMANDS.txt"}
        listed = {name for name, _ in commands(folder)} | (NOT_SIMULATED & on_disk)
        assert listed == on_disk


def _interpreter(name):
    """A working interpreter of that name on the controller, or None (pyenv shims may not work)."""
    candidates = [shutil.which(name)] + sorted(str(p) for p in pathlib.Path("/root/.pyenv/versions").glob(f"{name[6:]}*/bin/{name}"))
    for path in filter(None, candidates):
        if subprocess.run([path, "-c", "pass"], capture_output=True).returncode == 0:
            return path
    return None


@pytest.mark.parametrize("python", ["python3.11", "python3.13"])
def test_identity_under_host_pythons(tmp_path, python):
    """The hosts run bookworm (3.11) and trixie (3.13): the script must give the same bytes."""
    path = _interpreter(python)
    if not path:
        pytest.skip(f"{python} not available on this controller")
    sim = LocalSim(tmp_path, "h200x2", python=path)
    for args, name in ((["-q"], "q.txt"), (["-q", "-x"], "q-xml.txt"), ([], "nvidia-smi.txt"), (["topo", "-m"], "topo.txt")):
        result = sim.smi(*args)
        assert result.returncode == 0, result.stderr
        assert mask_timestamps(result.stdout) == mask_timestamps((FIXTURES / "h200-x2" / name).read_text())
