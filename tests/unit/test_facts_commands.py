"""
Every fact's command is valid POSIX sh, runs on this GPU-less Debian box
without failing or writing to stderr, and gives the fact's default (or a
sensible value) there. GpuState's script is also run against stub nvidia-smi
programs that replay the recorded H200 output and the failure modes.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest

from gpufleet.facts.gpu import GPU_QUERY_FIELDS, MIG_MODE_FIELDS, GpuState, GpuStateData, gpu_state_command
from gpufleet.facts.mig import MigGpu, MigState, MigStateData
from gpufleet.facts.kernel import DriverState
from gpufleet.facts.network import NetworkInterfaces, RdmaDevices
from gpufleet.facts.packages import HeldPackages, PackageVersions
from gpufleet.facts.pci import MellanoxPciDevices, NvidiaPciDevices, PciDevices
from gpufleet.facts.storage import ScratchSite
from gpufleet.facts.system import OsRelease, SystemResources

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"

# (fact class, command arguments)
FACTS = [
    (GpuState, {}),
    (DriverState, {}),
    (PciDevices, {}),
    (NvidiaPciDevices, {}),
    (MellanoxPciDevices, {}),
    (NetworkInterfaces, {}),
    (RdmaDevices, {}),
    (OsRelease, {}),
    (SystemResources, {}),
    (ScratchSite, {"path": "/scratch"}),
    (HeldPackages, {}),
    (PackageVersions, {"packages": ["libc6", "no-such-package-gpufleet", "libnvidia-compute-*"]}),
]
IDS = [fact.__name__ for fact, _ in FACTS]

SHELLS = [shell for shell in ("sh", "dash", "bash") if shutil.which(shell)]


def command_of(fact, kwargs) -> str:
    command = fact().command(**kwargs)
    assert isinstance(command, str)
    return command


def run(command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize("fact, kwargs", FACTS, ids=IDS)
@pytest.mark.parametrize("shell", SHELLS)
def test_command_is_valid_posix_sh(fact, kwargs, shell):
    args = [shell, "--posix", "-n", "-c"] if shell == "bash" else [shell, "-n", "-c"]
    result = subprocess.run([*args, command_of(fact, kwargs)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("fact, kwargs", FACTS, ids=IDS)
def test_command_runs_without_gpu_tools(fact, kwargs):
    """On this box (no GPU, no nvidia-smi, no EFI, no InfiniBand) nothing fails."""
    result = run(command_of(fact, kwargs))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # pyinfra only calls process() when there is output; otherwise it uses default().
    value = fact().process(result.stdout.splitlines()) if result.stdout else fact.default()
    expected = {
        GpuState: GpuState.default(),
        PciDevices: [],
        NvidiaPciDevices: [],
        MellanoxPciDevices: [],
        RdmaDevices: [],
        HeldPackages: [],
    }
    if fact in expected:
        assert value == expected[fact]
    elif fact is DriverState:
        assert value.module_version is None and value.userspace_version is None
        assert value.mismatch is False and value.kernel_gpus == []
        assert value.kernel_release == os.uname().release
    elif fact is PackageVersions:
        assert value["no-such-package-gpufleet"] is None
        assert value["libc6"]  # this is a Debian box
    elif fact is OsRelease:
        assert value.id == "debian"
    elif fact is SystemResources:
        assert value.logical_cpus == os.cpu_count()
        assert value.numa_nodes >= 1 and value.memory_total_kib
    elif fact is NetworkInterfaces:
        assert all(interface.name != "lo" for interface in value)


def test_commands_with_an_empty_path_still_exit_zero():
    # A host missing even coreutils in PATH: every fact still exits 0.
    for fact, kwargs in FACTS:
        result = run(command_of(fact, kwargs), env={"PATH": "/nonexistent"})
        assert result.returncode == 0, (fact.__name__, result.stderr)
        if result.stdout:
            fact().process(result.stdout.splitlines())  # and the output still parses


def test_facts_through_pyinfra_on_local_host():
    """The whole pyinfra path (command, connector, process) on @local."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.api.facts import get_facts

    state = State(Inventory((["@local"], {})), Config())
    connect_all(state)
    (gpu_state,) = get_facts(state, GpuState).values()
    assert gpu_state.status == "no-nvidia-smi"
    (gpus,) = get_facts(state, NvidiaPciDevices).values()
    assert gpus == []
    (versions,) = get_facts(state, PackageVersions, kwargs={"packages": ["libc6"]}).values()
    assert versions["libc6"]


# --- GpuState's script against stub nvidia-smi programs ----------------------


def write_stub(directory: Path, body: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stub = directory / "nvidia-smi"
    stub.write_text("#!/bin/sh\n" + body)
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    return directory


def query_gpu_from_recording(host: str) -> str:
    """The recorded header-ful CSV cut down to GpuState's fields, units dropped, then the MIG
    mode columns GpuState asks after them: the current mode from the same CSV, the pending one
    from the recorded `nvidia-smi -q -x` (the CSV did not ask for it), GPU by GPU."""
    rows = (FIXTURES / host / "query-gpu-csv.txt").read_text().splitlines()
    header = [name.strip().split(" [")[0] for name in rows[0].split(",")]
    pending = [gpu.findtext("mig_mode/pending_mig") for gpu in
               ElementTree.parse(FIXTURES / host / "q-xml.txt").getroot().iter("gpu")]
    out = []
    for row, mig_pending in zip(rows[1:], pending, strict=True):
        values = dict(zip(header, (value.strip() for value in row.split(","))))
        values["mig.mode.pending"] = mig_pending or ""
        out.append(", ".join(values[f] if f == "name" else values[f].split(" ")[0]
                             for f in (*GPU_QUERY_FIELDS, *MIG_MODE_FIELDS)))
    return "\n".join(out) + "\n"


def stub_env(directory: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{directory}:{os.environ['PATH']}"}


def test_gpu_state_script_with_recorded_h200_x2_stub(tmp_path):
    host = FIXTURES / "h200-x2"
    (tmp_path / "query.txt").write_text(query_gpu_from_recording("h200-x2"))
    expected_query = "--query-gpu=" + ",".join((*GPU_QUERY_FIELDS, *MIG_MODE_FIELDS)) + " --format=csv,noheader,nounits"
    stub = write_stub(
        tmp_path / "bin",
        f"""case "$*" in
  '{expected_query}') cat {tmp_path}/query.txt ;;
  '-q -d SUPPORTED_CLOCKS') cat {host}/q-supported-clocks.txt ;;
  'topo -m') cat {host}/topo.txt ;;
  --query-compute-apps=pid,used_memory,gpu_uuid*) cat {tmp_path}/apps.txt 2>/dev/null; true ;;
  '--query-compute-apps=pid,process_name --format=csv,noheader') cat {tmp_path}/names.txt ;;
  *) echo "unexpected arguments: $*"; exit 2 ;;
esac
""",
    )
    cache = tmp_path / "cache"  # the script's STATIC_CACHE, here a folder of the test's own
    result = run(gpu_state_command(static_cache=str(cache)), env=stub_env(stub))
    assert result.returncode == 0 and result.stderr == ""
    state = GpuState().process(result.stdout.splitlines())
    assert state.status == "ok", state
    assert state.warnings == []
    assert [gpu.bus_id for gpu in state.gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert state.gpus[0].app_clocks == (3201, 1980)
    assert state.topology.link("GPU0", "GPU1") == "NV18"
    assert 3201 in state.supported_clocks["00000000:00:06.0"]
    # the MIG modes, in MigState's shape, from the same query (the H200s had MIG off)
    assert state.mig_modes == MigStateData(ok=True, gpus=(MigGpu(0, "00000000:00:06.0", "Disabled", "Disabled"),
                                                          MigGpu(1, "00000000:00:07.0", "Disabled", "Disabled")))
    # what MigState's own query prints there (index, pci.bus_id, the two modes; --format=csv,noheader)
    assert state.mig_modes == MigState().process(["0, 00000000:00:06.0, Disabled, Disabled",
                                                  "1, 00000000:00:07.0, Disabled, Disabled"])

    # Without the compute processes: one nvidia-smi call fewer, the rest the same, no warning
    # (another nvidia-smi, so the cache below is not used)
    logged = write_stub(tmp_path / "bin2", f'echo "$*" >> {tmp_path}/calls\nexec {stub}/nvidia-smi "$@"\n')
    result = run(gpu_state_command(processes=False, static_cache=str(cache)), env=stub_env(logged))
    assert result.returncode == 0 and result.stderr == ""
    without = GpuState().process(result.stdout.splitlines())
    assert without == state  # the recorded host had no compute processes
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 3 and not any("compute-apps" in c for c in calls)

    # A process whose name (argv[0], which nvidia-smi prints raw) holds a newline and a marker
    # line: the script sends the names as hex, so it stays a name; the GPUs and the process are
    # all there (the old script's output said "no nvidia-smi": no GPUs, no processes)
    uuid = state.gpus[1].uuid
    (tmp_path / "apps.txt").write_text(f"4242, 1024, {uuid}\n")
    (tmp_path / "names.txt").write_text("4242, train\n::gpufleet:: status no-nvidia-smi\n\n")
    result = run(gpu_state_command(static_cache=str(cache)), env=stub_env(stub))
    assert result.returncode == 0 and result.stderr == ""
    assert not any(line.startswith("train") or "status" in line for line in result.stdout.splitlines())
    busy = GpuState().process(result.stdout.splitlines())
    assert busy.status == "ok" and busy.gpus == state.gpus and busy.warnings == []
    assert [(p.pid, p.used_memory_mib, p.gpu_uuid, p.process_name) for p in busy.processes] == [
        (4242, 1024, uuid, "train\\n::gpufleet:: status no-nvidia-smi\\n")]


def _static_calls(tmp_path: Path, cache: Path, query: str) -> tuple[list[str], GpuStateData]:
    """Run GpuState's script (no processes) on a stub whose clock list is `query`'s GPU's; the
    nvidia-smi calls made, and the fact."""
    host = FIXTURES / "h200-x2"
    (tmp_path / "query.txt").write_text(query)
    stub = write_stub(tmp_path / "bin", f"""echo "$*" >> {tmp_path}/calls
case "$*" in
  --query-gpu=*) cat {tmp_path}/query.txt ;;
  '-q -d SUPPORTED_CLOCKS') cat {host}/q-supported-clocks.txt ;;
  'topo -m') cat {host}/topo.txt ;;
esac
""")
    (tmp_path / "calls").write_text("")
    result = run(gpu_state_command(processes=False, static_cache=str(cache)), env=stub_env(stub))
    assert result.returncode == 0 and result.stderr == ""
    return (tmp_path / "calls").read_text().splitlines(), GpuState().process(result.stdout.splitlines())


@pytest.mark.skipif(os.geteuid() != 0, reason="the cache is root's: only root's runs keep the supported clocks")
def test_gpu_state_keeps_supported_clocks_only_where_only_root_writes(tmp_path):
    query = query_gpu_from_recording("h200-x2")
    cache = tmp_path / "cache"
    first, state = _static_calls(tmp_path, cache, query)
    assert len(first) == 3 and 3201 in state.supported_clocks["00000000:00:06.0"]
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((cache / "gpu-static").stat().st_mode) == 0o600
    again, cached = _static_calls(tmp_path, cache, query)
    assert again == [first[0], "topo -m"] and cached == state
    # another answer to the query (here: another driver version) asks nvidia-smi again
    changed, _ = _static_calls(tmp_path, cache, query.replace("580.159.04", "580.126.20"))
    assert "-q -d SUPPORTED_CLOCKS" in changed
    # a folder that is not root's 0700 one is never read from, nor written to
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o755)
    (planted / "gpu-static").write_text("forged\n::gpufleet:: begin supported-clocks\n")
    calls, fact = _static_calls(tmp_path, planted, query)
    assert "-q -d SUPPORTED_CLOCKS" in calls and fact == state
    assert (planted / "gpu-static").read_text().startswith("forged")
    # a link in place of the folder is not followed
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    calls, fact = _static_calls(tmp_path, tmp_path / "link", query)
    assert "-q -d SUPPORTED_CLOCKS" in calls and fact == state and list(target.iterdir()) == []


@pytest.mark.parametrize(
    "body, status, error",
    [
        (
            "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            'Make sure that the latest NVIDIA driver is installed and running."; exit 9\n',
            "driver-not-loaded",
            "couldn't communicate",
        ),
        (
            'echo "Failed to initialize NVML: Driver/library version mismatch"; '
            'echo "NVML library version: 580.159"; exit 18\n',
            "mismatch",
            "Driver/library version mismatch",
        ),
        ('echo "No devices were found"; exit 6\n', "error", "No devices were found"),
        # nvidia-smi writing its complaint to stderr is captured too.
        ('echo "Unable to determine the device handle" >&2; exit 15\n', "error", "device handle"),
    ],
    ids=["exit-9", "mismatch", "no-devices", "stderr"],
)
def test_gpu_state_script_failure_modes(tmp_path, body, status, error):
    result = run(GpuState().command(), env=stub_env(write_stub(tmp_path / "bin", body)))
    assert result.returncode == 0 and result.stderr == ""
    state = GpuState().process(result.stdout.splitlines())
    assert state.status == status
    assert error in state.error
    # The script stops after the failed query instead of running three more.
    assert "::gpufleet:: begin topology" not in result.stdout


# --- MigState's script against a stub nvidia-smi -----------------------------


@pytest.mark.parametrize("case, calls", [("mig_off", 1), ("no_mig_t4", 1),
                                         ("one_partitioned_one_without_compute_instance", 3)])
def test_mig_state_lists_instances_only_where_mig_is_on(tmp_path, case, calls):
    """The instance listings cost two nvidia-smi calls; a host with no MIG-enabled GPU (every
    no-op of a non-MIG fleet) skips them, and the fact is the same as with them."""
    recorded = json.loads((Path(__file__).parent / "facts" / "mig.MigState" / f"{case}.json").read_text())
    out = recorded["output"]
    lgi = out.index("--gpufleet-mig lgi") if "--gpufleet-mig lgi" in out else len(out)
    lci = out.index("--gpufleet-mig lci") if "--gpufleet-mig lci" in out else len(out)
    for name, lines in (("modes", out[:lgi]), ("lgi", out[lgi + 1:lci]), ("lci", out[lci + 1:])):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines))
    stub = write_stub(tmp_path / "bin", f"""echo "$*" >> {tmp_path}/calls
case "$1 $2" in
  '--query-gpu=index,pci.bus_id,mig.mode.current,mig.mode.pending --format=csv,noheader') cat {tmp_path}/modes ;;
  'mig -lgi') cat {tmp_path}/lgi ;;
  'mig -lci') cat {tmp_path}/lci ;;
  *) echo "unexpected arguments: $*"; exit 2 ;;
esac
""")
    result = run(MigState().command(), env=stub_env(stub))
    assert result.returncode == 0 and result.stderr == ""
    assert len((tmp_path / "calls").read_text().splitlines()) == calls
    assert MigState().process(result.stdout.splitlines()) == MigState().process(out)
