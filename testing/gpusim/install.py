"""Controller side of the gpufleet GPU SIMULATOR (a TEST DOUBLE, not NVIDIA software).

parse_spec() turns a SPEC string such as ``h200x2`` or ``t4@595.45.04`` into a GpuSpec;
install() writes the simulator into a test host's root filesystem before it boots and
builds the fake kernel views (/proc/driver/nvidia, /sys/bus/pci/devices) the harness
bind-mounts into the container.

SPEC grammar:  <model>[x<count>][@<driver version>][:<option>]...
    model    h200 | h100 | a100 | t4 | v100   (see models.json)
    count    number of GPUs, default 1 (h200x1 and h200x2 replay the recorded hosts)
    version  driver version, default 580.159.04 (the recorded hosts)
    options  nodriver     PCI devices exist but no driver is loaded
             open         open kernel module flavour (default where the GPU supports it)
             proprietary  proprietary kernel module flavour
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil

HERE = pathlib.Path(__file__).resolve().parent
MODELS = json.loads((HERE / "models.json").read_text())

# Where things land inside the host root filesystem.
LIB_DIR = "usr/lib/gpusim"
CONFIG_PATH = "etc/gpusim/gpus.json"
SCRIPTS = ("nvidia-smi", "nvidia-persistenced", "gpusimctl")

# Recorded strings of /proc/driver/nvidia/version (tests/fixtures/nvidia/*/proc-version.txt).
# The proprietary line follows the same layout; its build date is invented (unverified).
PROC_VERSION_OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (nixbld@)  \n"
PROC_VERSION_PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  {version}  Release Build  (nixbld@)  \n"
PROC_VERSION_GCC = "GCC version:  gcc version 15.3.0 (GCC) \n"

# /proc/driver/nvidia/gpus/<bus>/information, as in proc-gpus.txt (tabs are part of it).
PROC_GPU_INFORMATION = (
    "Model: \t\t {name}\n"
    "IRQ:   \t\t {irq}\n"
    "GPU UUID: \t {uuid}\n"
    "Video BIOS: \t {vbios}\n"
    "Bus Type: \t PCIe\n"
    "DMA Size: \t 52 bits\n"
    "DMA Mask: \t 0xfffffffffffff\n"
    "Bus Location: \t {bus}\n"
    "Device Minor: \t {minor}\n"
    "GPU Firmware: \t {firmware}\n"
    "GPU Excluded:\t No\n"
)

# Local dpkg diversions (`dpkg-divert --local --rename`): the Debian packages `nvidia-smi` and
# `nvidia-persistenced` then install their binaries as *.distrib and keep the stand-ins.
DIVERTED = ("/usr/bin/nvidia-smi", "/usr/bin/nvidia-persistenced")

SPEC_RE = re.compile(
    r"^(?P<model>[a-z][a-z0-9]*?)(?:x(?P<count>[0-9]+))?(?:@(?P<version>[0-9]+(?:\.[0-9]+){1,2}))?(?P<opts>(?::[a-z]+)*)$"
)


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    spec: str
    model: str
    count: int
    driver_version: str
    flavour: str  # "open" or "proprietary"
    driver_loaded: bool

    @property
    def branch(self) -> int:
        return int(self.driver_version.split(".")[0])

    @property
    def recorded_host(self) -> str | None:
        """Name of the recorded host this spec replays (identities and readings), if any."""
        key = f"{self.model}x{self.count}"
        return key if key in MODELS["recorded_hosts"] else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def parse_spec(spec: str) -> GpuSpec:
    known = ", ".join(sorted(MODELS["models"]))
    m = SPEC_RE.match(spec.strip().lower())
    if not m:
        raise ValueError(
            f"bad GPU simulator spec {spec!r}: expected <model>[x<count>][@<driver version>][:nodriver|:open|:proprietary]; "
            f"known models: {known}"
        )
    model = m.group("model")
    if model not in MODELS["models"]:
        raise ValueError(f"unknown GPU model {model!r} in spec {spec!r}; known models: {known}")
    data = MODELS["models"][model]
    count = int(m.group("count") or 1)
    if not 1 <= count <= 16:
        raise ValueError(f"GPU count must be 1..16 in spec {spec!r}")
    version = m.group("version") or MODELS["default_driver"]
    if len(version.split(".")) < 2:
        raise ValueError(f"driver version {version!r} in spec {spec!r} needs at least major.minor")
    opts = [o for o in m.group("opts").split(":") if o]
    for o in opts:
        if o not in ("nodriver", "open", "proprietary"):
            raise ValueError(f"unknown option {o!r} in spec {spec!r}; known: nodriver, open, proprietary")
    if "open" in opts and "proprietary" in opts:
        raise ValueError(f"spec {spec!r} asks for both open and proprietary kernel modules")
    open_since = data.get("open_since", data["min_driver"])
    if "open" in opts:
        if not data["open_module"]:
            raise ValueError(f"{data['name']} has no open kernel module support (Turing and newer only)")
        flavour = "open"
    elif "proprietary" in opts:
        flavour = "proprietary"
    else:
        # The open flavour is the default from R560 on, for GPUs the open modules support.
        open_ok = data["open_module"] and _version_tuple(version) >= _version_tuple(open_since)
        flavour = "open" if open_ok and int(version.split(".")[0]) >= 560 else "proprietary"
    return GpuSpec(spec=spec, model=model, count=count, driver_version=version,
                   flavour=flavour, driver_loaded="nodriver" not in opts)


def _cuda_version(branch: int) -> str:
    table = {int(k): v for k, v in MODELS["cuda_by_branch"].items()}
    lower = [b for b in table if b <= branch]
    return table[max(lower)] if lower else "N/A"


def _driver_supports(spec: GpuSpec, data: dict) -> bool:
    """Whether this driver claims the GPU (else nvidia-smi finds no devices, as on real hosts)."""
    if data["last_branch"] is not None and spec.branch > data["last_branch"]:
        return False
    floor = data.get("open_since", data["min_driver"]) if spec.flavour == "open" else data["min_driver"]
    return _version_tuple(spec.driver_version) >= _version_tuple(floor)


def _fake_uuid(seed: str) -> str:
    h = hashlib.sha256(seed.encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _generated_gpu(spec: GpuSpec, data: dict, index: int) -> dict:
    """Identity of a GPU that was not recorded: deterministic per spec and index."""
    seed = f"gpusim/{spec.model}x{spec.count}/{index}"
    return {
        "uuid": _fake_uuid(seed),
        "pdi": "0x" + hashlib.sha256(("pdi/" + seed).encode()).hexdigest()[:16],
        "serial": str(1650000000000 + int(hashlib.sha256(("sn/" + seed).encode()).hexdigest()[:8], 16) % 10**9),
        "module_id": str(index + 1),
        "board_id": f"0x{6 + index:x}",
        "minor": index,
        "bus_id": f"00000000:00:{6 + index:02X}.0",
        "fabric": data.get("fabric", {"state": "N/A", "status": "N/A", "clique_id": "N/A", "cluster_uuid": "N/A"}),
        "readings": dict(data["readings"]),
        "readings_by_view": {},
    }


def build_config(spec: GpuSpec) -> dict:
    """The content of /etc/gpusim/gpus.json: everything the host-side scripts need."""
    data = MODELS["models"][spec.model]
    recorded = MODELS["recorded_hosts"].get(spec.recorded_host or "")
    gpus = []
    for index in range(spec.count):
        ident = dict(recorded["gpus"][index]) if recorded else _generated_gpu(spec, data, index)
        gpu = {k: v for k, v in data.items() if k not in ("readings", "fabric", "sources", "unverified", "nvswitch",
                                                                  "mig_source")}
        gpu.update(ident)
        gpu["index"] = index
        gpu["gsp_fw"] = spec.driver_version if spec.flavour == "open" else "N/A"
        gpus.append(gpu)

    if recorded:
        topology = dict(recorded["topology"])
        state = dict(recorded.get("initial_state", {}))
    else:
        # NVLink between every pair: through NVSwitches (NV<links>), or direct links split among peers.
        link = "PHB"
        if data["nvlink"] and spec.count > 1:
            per_peer = data["nvlink"]["links"] if data["nvswitch"] else data["nvlink"]["links"] // (spec.count - 1)
            link = f"NV{per_peer}" if per_peer else "PHB"
        topology = {"cpu_affinity": None, "numa_affinity": "0", "gpu_numa_id": "N/A", "link": link if spec.count > 1 else None}
        state = {"persistence": False}

    nvswitches = []
    if data["nvswitch"] and spec.count > 1:
        sw = data["nvswitch"]
        for k in range(sw["count"]):
            nvswitches.append({"bus_id": f"00000000:00:{6 + spec.count + k:02X}.0", "device": sw["device"],
                               "class": sw["class"], "subsystem_vendor": sw["subsystem_vendor"],
                               "subsystem_device": sw["subsystem_device"]})

    return {
        "_comment": "gpufleet GPU SIMULATOR configuration -- a TEST DOUBLE, not NVIDIA software",
        "spec": spec.spec,
        "model": spec.model,
        "driver": {
            "version": spec.driver_version,
            "flavour": spec.flavour,
            "loaded": spec.driver_loaded,
            "cuda_version": _cuda_version(spec.branch),
            "app_clocks_deprecated": spec.branch >= MODELS["app_clocks_deprecated_from_branch"],
            "supports_gpus": _driver_supports(spec, data),
        },
        "initial_state": state,
        "topology": topology,
        "gpus": gpus,
        "nvswitches": nvswitches,
    }


def _sys_bus(bus_id: str) -> str:
    """00000000:00:06.0 (nvidia-smi) -> 0000:00:06.0 (sysfs, procfs)."""
    return bus_id[4:].lower()


def _write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _build_proc(config: dict, proc: pathlib.Path) -> None:
    drv = config["driver"]
    tmpl = PROC_VERSION_OPEN if drv["flavour"] == "open" else PROC_VERSION_PROPRIETARY
    _write(proc / "version", tmpl.format(version=drv["version"]) + PROC_VERSION_GCC)
    (proc / "gpus").mkdir(parents=True, exist_ok=True)
    if not drv["supports_gpus"]:
        return
    for gpu in config["gpus"]:
        bus = _sys_bus(gpu["bus_id"])
        _write(proc / "gpus" / bus / "information", PROC_GPU_INFORMATION.format(
            name=gpu["name"], irq=41, uuid=gpu["uuid"], vbios=gpu["vbios"].lower(), bus=bus,
            minor=gpu["minor"], firmware=gpu["gsp_fw"]))


def _build_sys_pci(config: dict, pci: pathlib.Path) -> None:
    pci.mkdir(parents=True, exist_ok=True)
    bound = config["driver"]["loaded"] and config["driver"]["supports_gpus"]
    functions = [(g["bus_id"], g["pci_device"], "0x030200", g["subsystem_vendor"], g["subsystem_device"])
                 for g in config["gpus"]]
    functions += [(s["bus_id"], s["device"], s["class"], s["subsystem_vendor"], s["subsystem_device"])
                  for s in config["nvswitches"]]
    for bus_id, device, klass, sub_vendor, sub_device in functions:
        d = pci / _sys_bus(bus_id)
        for name, value in (("vendor", "0x10de"), ("device", device), ("class", klass),
                            ("subsystem_vendor", sub_vendor), ("subsystem_device", sub_device)):
            _write(d / name, value + "\n")
        if bound:
            # readlink -f on it gives .../drivers/nvidia, as sys-pci.txt shows (driver=nvidia).
            (d / "driver").symlink_to("/sys/bus/pci/drivers/nvidia")


def _add_diversion(root: pathlib.Path) -> None:
    """Record `dpkg-divert --local --rename` for each DIVERTED path, so Debian's packages keep off them."""
    path = root / "var/lib/dpkg/diversions"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines()
    present = {lines[i] for i in range(0, len(lines) - 2, 3)}
    if text and not text.endswith("\n"):
        text += "\n"
    for diverted in DIVERTED:
        if diverted not in present:
            text += f"{diverted}\n{diverted}.distrib\n:\n"
    path.write_text(text)


def _install_load_module(root: pathlib.Path) -> None:
    """gpusim-load-module.service: at boot the simulated module becomes the installed driver's."""
    lib = root / LIB_DIR
    shutil.copy2(HERE / "gpusim-load-module", lib / "gpusim-load-module")
    os.chmod(lib / "gpusim-load-module", 0o755)
    _write(lib / "cuda-by-branch.json", json.dumps(MODELS["cuda_by_branch"]) + "\n")
    unit = root / "etc/systemd/system/gpusim-load-module.service"
    _write(unit, (HERE / "gpusim-load-module.service").read_text())
    wants = root / "etc/systemd/system/multi-user.target.wants/gpusim-load-module.service"
    wants.parent.mkdir(parents=True, exist_ok=True)
    if wants.is_symlink() or wants.exists():
        wants.unlink()
    wants.symlink_to("/etc/systemd/system/gpusim-load-module.service")



def _load_module_script():  # type: ignore[no-untyped-def]
    """gpusim-load-module (a host-side script without .py) as a module: one reading of modprobe.d."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("gpusim_load_module", str(HERE / "gpusim-load-module"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


#: inside the host root: what the container sees as /proc/driver
PROC_DRIVER_DIR = "usr/lib/gpusim/kernel/proc-driver"


def install(root: pathlib.Path, spec: str, work: pathlib.Path) -> list[str]:
    """Install the simulator into a host root filesystem `root` (an overlay mount, before boot).
    `work` is a per-host scratch dir on the controller. Returns extra systemd-nspawn arguments
    (e.g. ["--bind-ro=/abs/src:/proc/driver/nvidia", ...]) the harness must pass at boot."""
    parsed = parse_spec(spec)
    config = build_config(parsed)
    root = pathlib.Path(root)
    work = pathlib.Path(work).resolve()

    _write(root / CONFIG_PATH, json.dumps(config, indent=1) + "\n")
    lib = root / LIB_DIR
    if lib.exists():
        shutil.rmtree(lib)
    shutil.copytree(HERE / "templates", lib / "templates")
    for name in SCRIPTS:
        shutil.copy2(HERE / name, lib / name)
        os.chmod(lib / name, 0o755)
        link = root / "usr/bin" / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(f"../lib/gpusim/{name}")
    # the kernel log stand-in, first on root's PATH: the XIDs of injected faults, never the
    # machine's own kernel log
    shutil.copy2(HERE / "dmesg", lib / "dmesg")
    os.chmod(lib / "dmesg", 0o755)
    dmesg = root / "usr/local/sbin/dmesg"
    dmesg.parent.mkdir(parents=True, exist_ok=True)
    if dmesg.is_symlink() or dmesg.exists():
        dmesg.unlink()
    dmesg.symlink_to("../../lib/gpusim/dmesg")
    # the system's nvidia-ml-py, as Debian's python3-pynvml places it: the health fact reads NVML
    _write(root / "usr/lib/python3/dist-packages/pynvml.py", (HERE / "pynvml.py").read_text())
    _add_diversion(root)
    _install_load_module(root)

    args = []
    # nspawn mounts binds aimed into /proc from inside the container (sources resolve in the
    # container's root), and procfs cannot get a new /proc/driver/nvidia mount point: so the
    # view lives in the root and covers the whole of /proc/driver (measured, systemd 252).
    proc_driver = root / PROC_DRIVER_DIR
    if proc_driver.exists():
        shutil.rmtree(proc_driver)
    if parsed.driver_loaded:
        _build_proc(config, proc_driver / "nvidia")
        # the module's parameters as loaded at the first boot (gpusim-load-module writes them again at every boot)
        _load_module_script().write_params(proc=str(proc_driver / "nvidia"), root=str(root))
    else:
        proc_driver.mkdir(parents=True)
    args.append(f"--bind-ro=/{PROC_DRIVER_DIR}:/proc/driver")
    pci = work / "gpusim-sys-bus-pci-devices"
    if pci.exists():
        shutil.rmtree(pci)
    _build_sys_pci(config, pci)
    args.append(f"--bind-ro={pci}:/sys/bus/pci/devices")
    return args
