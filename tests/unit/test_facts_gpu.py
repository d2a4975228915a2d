"""Unit tests for facts.gpu on real recorded H200 output and hand-written samples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyinfra.api.exceptions import FactProcessError

from gpufleet.facts.gpu import (
    GPU_QUERY_FIELDS,
    ClockPair,
    GpuState,
    parse_compute_apps,
    parse_gpu_state,
    parse_process_names,
    parse_query_gpu,
    parse_supported_clocks,
    parse_topology,
)

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "facts"
H200_X1_UUID = "GPU-fe9201e0-3cd1-adde-0e21-6fe16b45d6f5"
H200_X2_UUIDS = ["GPU-517ec679-1ea9-e774-b37b-eb2d336fd163", "GPU-01a2546d-e3a6-eb7c-7d1e-f99be35fe827"]
# The field list behind the recorded query-gpu-noheader.txt (see its COMMANDS.txt).
RECORDED_NOHEADER_FIELDS = (
    "index,uuid,name,pci.bus_id,driver_version,memory.total,persistence_mode,"
    "clocks.applications.graphics,clocks.applications.memory,clocks.max.graphics,"
    "clocks.max.memory,compute_cap"
).split(",")


def lines(*parts: str) -> list[str]:
    return (FIXTURES.joinpath(*parts)).read_text().splitlines()


def recorded_gpu_state(host: str) -> list[str]:
    """
    What GpuState's command would print on a recorded host, assembled from the
    recorded files: the query-gpu part takes GPU_QUERY_FIELDS' columns out of the
    header-ful query-gpu-csv.txt (which asked for all of them, and more), units
    dropped as --format=...,nounits does.
    """
    csv = lines(host, "query-gpu-csv.txt")
    header = [name.strip().split(" [")[0] for name in csv[0].split(",")]
    rename = {"clocks_event_reasons.active": "clocks_throttle_reasons.active"}
    header = [rename.get(name, name) for name in header]
    query = []
    for row in csv[1:]:
        values = dict(zip(header, (value.strip() for value in row.split(","))))
        picked = [values[name].split(" ")[0] if name != "name" else values[name] for name in GPU_QUERY_FIELDS]
        query.append(", ".join(picked))
    out = ["::gpufleet:: begin query-gpu", *query, "::gpufleet:: rc query-gpu 0"]
    out += ["::gpufleet:: begin supported-clocks", *lines(host, "q-supported-clocks.txt")]
    out += ["::gpufleet:: rc supported-clocks 0", "::gpufleet:: begin topology"]
    out += [*lines(host, "topo.txt"), "::gpufleet:: rc topology 0"]
    # query-apps.txt was recorded with a header and no processes running; the
    # fact's noheader form prints nothing in that case.
    out += ["::gpufleet:: begin compute-apps", "::gpufleet:: rc compute-apps 0"]
    return out


# --- query-gpu -------------------------------------------------------------


def test_query_gpu_noheader_h200_x2():
    gpus = parse_query_gpu(lines("h200-x2", "query-gpu-noheader.txt"), RECORDED_NOHEADER_FIELDS)
    assert [gpu.index for gpu in gpus] == [0, 1]
    assert [gpu.uuid for gpu in gpus] == H200_X2_UUIDS
    assert [gpu.bus_id for gpu in gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert [gpu.pci_slot for gpu in gpus] == ["0000:00:06.0", "0000:00:07.0"]
    for gpu in gpus:
        assert gpu.name == "NVIDIA H200"
        assert gpu.driver_version == "580.159.04"
        assert gpu.memory_mib == 143771
        assert gpu.persistence is True
        assert gpu.app_clocks == (3201, 1980)
        assert gpu.app_clocks == ClockPair(mem=3201, gfx=1980)
        assert gpu.max_clocks == (3201, 1980)
        assert gpu.default_app_clocks is None  # not asked for in that recording
        assert gpu.device_id is None
        assert gpu.compute_cap == "9.0"
        assert gpu.extra == {}


def test_query_gpu_noheader_h200_x1():
    (gpu,) = parse_query_gpu(lines("h200-x1", "query-gpu-noheader.txt"), RECORDED_NOHEADER_FIELDS)
    assert gpu.uuid == H200_X1_UUID
    assert gpu.bus_id == "00000000:00:06.0"
    assert gpu.app_clocks == (3201, 1980)


@pytest.mark.parametrize("host, count", [("h200-x1", 1), ("h200-x2", 2)])
def test_query_gpu_with_header_and_units(host, count):
    gpus = parse_query_gpu(lines(host, "query-gpu-csv.txt"))
    assert len(gpus) == count
    gpu = gpus[0]
    assert gpu.device_id == "0x2335"  # from 0x233510DE
    assert gpu.memory_mib == 143771  # from "143771 MiB"
    assert gpu.persistence is True
    assert gpu.app_clocks == (3201, 1980)
    assert gpu.default_app_clocks == (3201, 1980)
    assert gpu.max_clocks == (3201, 1980)
    assert gpu.compute_cap == "9.0"
    assert gpu.extra["vbios_version"] == "96.00.A5.00.1A"
    assert gpu.extra["power.limit"] == "700.00 W"
    # Asked for as clocks_throttle_reasons.active, printed as the newer name.
    assert gpu.extra["clocks_event_reasons.active"] == "0x0000000000000001"


def test_query_gpu_accepts_throttle_alias_in_field_list():
    fields = ["index", "uuid", "name", "pci.bus_id", "clocks_throttle_reasons.active"]
    (gpu,) = parse_query_gpu(["0, GPU-x, NVIDIA H200, 00000000:00:06.0, 0x01"], fields)
    assert gpu.extra == {"clocks_event_reasons.active": "0x01"}


def test_query_gpu_default_field_list_matches_command_order():
    line = (
        "3, GPU-abc, NVIDIA H100 80GB HBM3, 00000000:9A:00.0, 0x233010DE, 550.163.01, 81559, "
        "Disabled, 1755, 2619, 1755, 2619, 1980, 2619, 9.0"
    )
    (gpu,) = parse_query_gpu([line])
    assert (gpu.index, gpu.device_id, gpu.persistence) == (3, "0x2330", False)
    assert gpu.app_clocks == (2619, 1755)
    assert gpu.max_clocks == (2619, 1980)
    assert gpu.pci_slot == "0000:9a:00.0"


def test_query_gpu_unavailable_values_are_none():
    line = (
        "0, GPU-x, NVIDIA B200, 00000000:1B:00.0, [N/A], 580.95.05, [N/A], [N/A], "
        "[Requested functionality has been deprecated], Requested functionality has been deprecated, "
        "[Not Supported], N/A, [N/A], [N/A], [N/A]"
    )
    (gpu,) = parse_query_gpu([line])
    assert gpu.device_id is None
    assert gpu.memory_mib is None
    assert gpu.persistence is None
    assert gpu.app_clocks is None
    assert gpu.default_app_clocks is None
    assert gpu.max_clocks is None
    assert gpu.compute_cap is None


@pytest.mark.parametrize(
    "line, message",
    [
        ("0, GPU-x, NVIDIA H200", "expected 15 comma-separated values"),
        (
            "0, GPU-x, NVIDIA H200, 00000000:00:06.0, 0x233510DE, 580, lots, Enabled, 1, 2, 3, 4, 5, 6, 9.0",
            "expected a number for memory.total",
        ),
        (
            "0, GPU-x, NVIDIA H200, 00000000:00:06.0, 0x233510DE, 580, 1, Maybe, 1, 2, 3, 4, 5, 6, 9.0",
            "persistence_mode",
        ),
        (
            "0, GPU-x, NVIDIA H200, not-a-bus-id, 0x233510DE, 580, 1, Enabled, 1, 2, 3, 4, 5, 6, 9.0",
            "PCI bus id",
        ),
    ],
)
def test_query_gpu_malformed_raises_naming_the_problem(line, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_query_gpu([line])
    # A FactProcessError is what makes pyinfra fail only this host.
    assert isinstance(error.value, FactProcessError)


# --- supported clocks ------------------------------------------------------


def test_supported_clocks_h200_x2():
    clocks = parse_supported_clocks(lines("h200-x2", "q-supported-clocks.txt"))
    assert list(clocks) == ["00000000:00:06.0", "00000000:00:07.0"]
    for per_memory in clocks.values():
        assert list(per_memory) == [3201, 2201]
        assert 3201 in per_memory
        assert max(per_memory[3201]) == 1980
        assert per_memory[3201][0] == 1980
        assert per_memory[3201][-1] == 345
        assert len(per_memory[3201]) == 110
        assert len(per_memory[2201]) == 110
        assert 1005 in per_memory[3201]


def test_supported_clocks_h200_x1():
    clocks = parse_supported_clocks(lines("h200-x1", "q-supported-clocks.txt"))
    assert list(clocks) == ["00000000:00:06.0"]
    assert max(clocks["00000000:00:06.0"][3201]) == 1980


def test_supported_clocks_not_available():
    out = ["GPU 00000000:1B:00.0", "    Supported Clocks                   : N/A"]
    assert parse_supported_clocks(out) == {"00000000:1B:00.0": {}}


def test_supported_clocks_graphics_before_memory_is_an_error():
    out = ["GPU 00000000:00:06.0", "    Supported Clocks", "            Graphics  : 1980 MHz"]
    with pytest.raises(ValueError, match="graphics clock before any memory clock"):
        parse_supported_clocks(out)


# --- topology --------------------------------------------------------------


def test_topology_h200_x2():
    topology = parse_topology(lines("h200-x2", "topo.txt"))
    assert topology.devices == ["GPU0", "GPU1"]
    assert topology.link("GPU0", "GPU1") == "NV18"
    assert topology.link("GPU1", "GPU0") == "NV18"
    assert topology.link("GPU0", "GPU0") == "X"
    assert topology.nvlinks("GPU0", "GPU1") == 18
    assert topology.cpu_affinity == {"GPU0": "0-31", "GPU1": "0-31"}
    assert topology.numa_affinity == {"GPU0": "0", "GPU1": "0"}
    assert topology.gpu_numa_id == {"GPU0": None, "GPU1": None}
    assert topology.nics == {}


def test_topology_h200_x1():
    topology = parse_topology(lines("h200-x1", "topo.txt"))
    assert topology.devices == ["GPU0"]
    assert topology.links == {"GPU0": {"GPU0": "X"}}
    assert topology.cpu_affinity == {"GPU0": "0-15"}
    assert topology.numa_affinity == {"GPU0": "0"}
    assert topology.nvlinks("GPU0", "GPU1") == 0


def test_topology_with_nics_and_nic_legend():
    topology = parse_topology(lines("samples", "topo-hgx-nics.txt"))
    assert topology.devices == ["GPU0", "GPU1", "NIC0", "NIC1"]
    assert topology.link("GPU0", "NIC0") == "PXB"
    assert topology.link("GPU1", "NIC0") == "SYS"
    assert topology.link("NIC1", "GPU1") == "PXB"
    assert topology.cpu_affinity["GPU1"] == "56-111,168-223"
    assert topology.numa_affinity["GPU1"] == "1"
    assert topology.cpu_affinity["NIC0"] is None
    assert topology.nics == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}


def test_topology_malformed():
    with pytest.raises(ValueError, match="header does not start with device columns"):
        parse_topology(["\tCPU Affinity\tGPU0", "GPU0\t0-3\tX"])
    with pytest.raises(ValueError, match="fewer than 2 link cells"):
        parse_topology(["\tGPU0\tGPU1\tCPU Affinity", "GPU0\t X "])


# --- compute apps ----------------------------------------------------------


def test_compute_apps_recorded_header_only():
    assert parse_compute_apps(lines("h200-x1", "query-apps.txt")) == []
    assert parse_compute_apps(lines("h200-x2", "query-apps.txt")) == []


def test_compute_apps_noheader_and_header_forms():
    (process,) = parse_compute_apps(["1234, /usr/bin/python3, 70000, GPU-abc"],
                                    ("pid", "process_name", "used_memory", "gpu_uuid"))
    assert (process.pid, process.process_name, process.used_memory_mib, process.gpu_uuid) == (
        1234,
        "/usr/bin/python3",
        70000,
        "GPU-abc",
    )
    # GpuState's own fields: none a user can write, the name comes apart (process-names)
    (process,) = parse_compute_apps(["1234, 70000, GPU-abc"])
    assert (process.pid, process.process_name, process.used_memory_mib, process.gpu_uuid) == (
        1234, None, 70000, "GPU-abc")
    header_form = ["pid, process_name, used_gpu_memory [MiB]", "99, [Not Found], 512 MiB"]
    (process,) = parse_compute_apps(header_form)
    assert (process.pid, process.process_name, process.used_memory_mib, process.gpu_uuid) == (
        99,
        None,
        512,
        None,
    )


def test_compute_apps_malformed():
    with pytest.raises(ValueError, match="expected a number for pid"):
        parse_compute_apps(["abc, 1, GPU-x"])
    # a name's text where only numbers and a GPU are asked: not GpuState's output
    with pytest.raises(ValueError, match="expected 3 comma-separated values"):
        parse_compute_apps(["4242, python, 1, GPU-x"])


HOSTILE = "train\n::gpufleet:: status no-nvidia-smi\n"


def _hex(text: str) -> str:
    return text.encode().hex()


def test_process_names_hold_newlines_and_markers_as_text():
    names = parse_process_names([_hex(f"4242, {HOSTILE}\n4343, /opt/my app, v2/run\n")], [4242, 4343])
    assert names == {4242: "train\\n::gpufleet:: status no-nvidia-smi\\n", 4343: "/opt/my app, v2/run"}
    # a name shaped as another record can only mislabel a listed process: 99 is not listed
    assert parse_process_names([_hex("4242, x\n99, y\n")], [4242]) == {4242: "x\\n99, y"}
    assert parse_process_names([_hex("4242, [Not Found]\n")], [4242]) == {4242: None}
    assert parse_process_names(["4242, python3"], [4242]) is None   # not hex: not the script's


def test_gpu_state_a_hostile_name_forges_nothing():
    """nvidia-smi prints argv[0] raw: as the old script passed it on, the name's own line was a
    status marker and the GPUs and processes vanished. Hex-encoded, it is a name."""
    base = recorded_gpu_state("h200-x2")
    at = base.index("::gpufleet:: begin compute-apps")
    uuid = GpuState().process(base).gpus[1].uuid
    out = [*base[:at + 1], f"4242, 1024, {uuid}", "::gpufleet:: rc compute-apps 0",
           "::gpufleet:: begin process-names", _hex(f"4242, {HOSTILE}\n")]
    state = GpuState().process(out)
    assert state.status == "ok" and len(state.gpus) == 2
    assert [(p.pid, p.gpu_uuid, p.process_name) for p in state.processes] == [
        (4242, uuid, "train\\n::gpufleet:: status no-nvidia-smi\\n")]
    # the same name raw, as the old script printed it: a marker among other output fails loudly
    raw = [*base[:at + 1], "4242, train", "::gpufleet:: status no-nvidia-smi", f", 1024, {uuid}",
           "::gpufleet:: rc compute-apps 0"]
    with pytest.raises(FactProcessError, match="no-nvidia-smi status among other output"):
        GpuState().process(raw)
    with pytest.raises(FactProcessError, match="repeated"):
        GpuState().process([*base, "::gpufleet:: rc query-gpu 0"])


# --- the whole GpuState output --------------------------------------------


def test_gpu_state_recorded_h200_x2():
    state = GpuState().process(recorded_gpu_state("h200-x2"))
    assert state.status == "ok" and state.ok
    assert state.error is None and state.warnings == []
    assert len(state.gpus) == 2
    assert [gpu.bus_id for gpu in state.gpus] == ["00000000:00:06.0", "00000000:00:07.0"]
    assert all(gpu.persistence is True for gpu in state.gpus)
    assert all(gpu.app_clocks == (3201, 1980) for gpu in state.gpus)
    assert all(gpu.default_app_clocks == (3201, 1980) for gpu in state.gpus)
    assert all(gpu.device_id == "0x2335" for gpu in state.gpus)
    assert state.driver_version == "580.159.04"
    assert state.topology.link("GPU0", "GPU1") == "NV18"
    assert max(state.supported_clocks["00000000:00:07.0"][3201]) == 1980
    assert state.processes == []
    assert state.gpu("00000000:00:07.0").index == 1


def test_gpu_state_recorded_h200_x1():
    state = parse_gpu_state(recorded_gpu_state("h200-x1"))
    assert state.status == "ok"
    assert [gpu.uuid for gpu in state.gpus] == [H200_X1_UUID]
    assert state.topology.devices == ["GPU0"]


def test_gpu_state_is_json_serialisable_for_the_pyinfra_cli():
    state = parse_gpu_state(recorded_gpu_state("h200-x2"))
    data = json.loads(json.dumps(state.to_json()))
    assert data["gpus"][0]["app_clocks"] == [3201, 1980]
    assert data["topology"]["links"]["GPU0"]["GPU1"] == "NV18"


def test_gpu_state_no_nvidia_smi_is_the_default():
    state = GpuState().process(lines("samples", "gpu-state-no-nvidia-smi.txt"))
    assert state == GpuState.default()
    assert state.status == "no-nvidia-smi" and state.gpus == []


def test_gpu_state_driver_not_loaded():
    state = parse_gpu_state(lines("samples", "gpu-state-driver-not-loaded.txt"))
    assert state.status == "driver-not-loaded"
    assert "couldn't communicate with the NVIDIA driver" in state.error
    assert state.gpus == []


def test_gpu_state_exit_9_alone_means_driver_not_loaded():
    out = ["::gpufleet:: begin query-gpu", "::gpufleet:: rc query-gpu 9"]
    state = parse_gpu_state(out)
    assert state.status == "driver-not-loaded"
    assert state.error == "nvidia-smi exited with 9"


def test_gpu_state_mismatch():
    state = parse_gpu_state(lines("samples", "gpu-state-mismatch.txt"))
    assert state.status == "mismatch"
    assert state.nvml_version == "580.159"
    assert state.error.startswith("Failed to initialize NVML: Driver/library version mismatch")


def test_gpu_state_timeout_is_an_error():
    state = parse_gpu_state(lines("samples", "gpu-state-timeout.txt"))
    assert state.status == "error"
    assert "timed out" in state.error


def test_gpu_state_deprecated_clocks_and_failed_topology():
    state = parse_gpu_state(lines("samples", "gpu-state-deprecated-clocks.txt"))
    assert state.status == "ok"
    first, second = state.gpus
    assert first.app_clocks is None and first.default_app_clocks is None
    assert first.max_clocks == (3996, 1965)
    assert first.compute_cap == "10.0" and first.device_id == "0x2901"
    assert second.memory_mib is None and second.persistence is None
    assert state.supported_clocks == {"00000000:1B:00.0": {}, "00000000:43:00.0": {}}
    assert state.topology.devices == []
    assert state.warnings == ["topology: exit 3: Failed to run topology: Not Supported"]
    assert [process.pid for process in state.processes] == [4242, 4343]
    # A comma in a process name stays in the name.
    assert state.processes[1].process_name == "/opt/my app, v2/run"
    assert state.processes[1].used_memory_mib is None


def test_gpu_state_without_markers_is_an_error():
    with pytest.raises(FactProcessError, match="neither a status nor a query-gpu exit code"):
        parse_gpu_state(["something unexpected"])
