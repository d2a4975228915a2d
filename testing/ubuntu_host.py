"""TEST DOUBLE: a simulated Ubuntu 22.04 / 24.04 host, whose facts are answered from recorded
output (tests/fixtures/ubuntu/, see its SOURCES.md), for pyinfra-level tests without a host.

Ubuntu's archive is unreachable from the test machines, so no Ubuntu test host can be built.
Instead a pyinfra State is made with hosts that are never connected to; `Host.get_fact` is
replaced for the duration of `canned()` by `CannedFacts.answer`, which runs each fact's own
`process()` on the recorded text its command would print. A fact the double has no recording
for raises (so a test sees every remote question a deploy would ask), and any attempt to run a
command raises too: nothing leaves this process.

Only the NVIDIA GPUs are simulated as elsewhere (testing/gpusim): their PCI ids are the models'
own (compat.yaml), as /sys/bus/pci would list them before a driver is installed.
"""
from __future__ import annotations

import contextlib
import datetime
import fnmatch
import functools
import re
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra.api import Config, Inventory, State, StringCommand
from pyinfra.api.command import FileUploadCommand
from pyinfra.api.host import Host
from pyinfra.context import ctx_host, ctx_state

from gpufleet.facts.devchar import DaemonReloadPending, DevCharLinks
from gpufleet.facts._common import MARK
from gpufleet.facts.docker import DaemonJson, DockerEngine
from gpufleet.facts.driver import DebianArchiveSources, GpuDeviceUsers
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.kernel import DriverState, ProfilingState
from gpufleet.facts.network import NetworkInterfaces, RdmaDevices
from gpufleet.facts.packages import AptCandidates, HeldPackages, KeyringFingerprints, PackageVersions, StackPackages
from gpufleet.facts.pci import NvidiaPciDevices, PciDevices
from gpufleet.facts.packages import AptVersions, PackageChange, ToolkitIndex
from gpufleet.facts.system import OsRelease
from gpufleet.catalog.gpus import model_for_name

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
UBUNTU = FIXTURES / "ubuntu"
RELEASES = ("22.04", "24.04")


def recorded(release: str, name: str) -> list[str]:
    return (UBUNTU / release / name).read_text().splitlines()


def apt_cache_policy(lines: Sequence[str]) -> dict[str, str | None]:
    """What AptCandidates' command prints for each package of a recorded `apt-cache policy`:
    the package's block, its `Candidate:` line (the command's `sed -n "s/^ *Candidate: //p"`)."""
    out: dict[str, str | None] = {}
    package = None
    for line in lines:
        if re.fullmatch(r"[a-z0-9][a-z0-9+.\-]*:", line):
            package = line[:-1]
        elif package and (m := re.fullmatch(r" *Candidate: (\S+)", line)):
            out[package] = None if m[1] == "(none)" else m[1]
    return out


def archive_sources_output(release: str) -> list[str]:
    """DebianArchiveSources' own command run over a temporary copy of the release's recorded apt
    sources (22.04: the one-line sources.list; 24.04: deb822 ubuntu.sources), as the host prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        listd = Path(tmp, "sources.list.d")
        listd.mkdir()
        main = Path(tmp, "sources.list")
        for name in ("sources.list", "ubuntu.sources"):
            if (UBUNTU / release / name).exists():
                (main if name == "sources.list" else listd / name).write_text((UBUNTU / release / name).read_text())
        command = (DebianArchiveSources().command().replace("/etc/apt/sources.list.d", str(listd))
                   .replace("/etc/apt/sources.list ", f"{main} "))
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True).stdout
    return [line.replace(tmp + "/sources.list.d", "/etc/apt/sources.list.d").replace(str(main), "/etc/apt/sources.list")
            for line in out.splitlines()]


# pyinfra's own facts the deploys' operations ask, answered as on a host where none of gpufleet's
# files, units or packages exist yet
_PYINFRA_EMPTY = {"File": None, "Directory": None, "Link": None, "Sha1File": None, "Sha256File": None,
                  "Md5File": None, "FileContents": None, "FindInFile": [], "DebPackages": {}, "DebPackage": None,
                  "SystemdStatus": {}, "SystemdEnabled": {}, "AptSources": []}


@dataclass
class UbuntuHost:
    """One simulated host: the release's recordings plus the GPUs it has."""

    release: str  # "22.04" | "24.04"
    gpus: Sequence[str]  # nvidia-smi names, one per GPU
    nvswitches: int = 0
    rdma: bool = False
    files: Mapping[str, bool] = field(default_factory=dict)  # path -> exists (the File fact)
    needrestart: bool = True  # /etc/needrestart exists: Ubuntu 22.04+ servers ship needrestart
    # a host deploys/all.py provisioned with Ubuntu's own driver at an earlier SRU, its prebuilt
    # modules and kernel flavour metapackages held (22.04/provisioned/: installed packages, what
    # apt offers now); what tools/rollout and tools/rollback plan on
    provisioned: bool = False
    machine: str = "x86_64"  # `uname -m` (the Arch fact): aarch64 for Grace hosts (GH200, GB200)

    def _dpkg_lines(self) -> list[str]:
        if self.provisioned:
            return recorded(self.release, "provisioned/dpkg-query.txt")
        return recorded(self.release, "dpkg-query-linux-image.txt")

    def _pci(self) -> list[str]:
        lines = []
        for n, name in enumerate(self.gpus):
            model = model_for_name(name)
            assert model is not None, name
            lines.append(f"0000:{0x10 + n:02x}:00.0 vendor=0x10de device={model.pci_ids[0]} class=0x030200 "
                         "subsys=0x10de driver=")
        for n in range(self.nvswitches):
            lines.append(f"0000:{0x80 + n:02x}:00.0 vendor=0x10de device=0x22a3 class=0x068000 subsys=0x10de driver=")
        return lines

    def driver_state_output(self) -> list[str]:
        """DriverState's command output on a host with no NVIDIA driver yet: its sections, from
        the recorded `uname -r` and `mokutil --sb-state` (headers of the running kernel absent)."""
        release = recorded(self.release, "uname-r.txt")[0].strip()
        mokutil = " ".join(recorded(self.release, "mokutil-sb-state.txt")) + " "
        return [f"{MARK} begin proc-version", f"{MARK} begin proc-gpus", f"{MARK} begin modules",
                f"{MARK} begin packages", f"{MARK} begin nvml-libs", f"{MARK} begin kernel",
                f"release={release}", "headers=no", f"{MARK} begin kernels", f"{release} none",
                f"{MARK} begin reboot-pkgs", f"{MARK} begin secure-boot", "efi=yes", f"mokutil={mokutil}"]

    def answer(self, cls: type, kwargs: Mapping[str, Any]) -> Any:
        name = cls.__name__
        if cls is OsRelease:
            return OsRelease().process(recorded(self.release, "os-release.txt"))
        if cls is DriverState:
            return DriverState().process(self.driver_state_output())
        if cls in (PciDevices, NvidiaPciDevices):
            return cls().process(self._pci())
        if cls is GpuState:  # no driver installed: no nvidia-smi
            return GpuState().process((FIXTURES / "facts/samples/gpu-state-no-nvidia-smi.txt").read_text().splitlines())
        if cls is RdmaDevices:
            lines = (FIXTURES / "facts/samples/sys-class-infiniband.txt").read_text().splitlines() if self.rdma else []
            return RdmaDevices().process(lines)
        if cls is NetworkInterfaces:
            return NetworkInterfaces().process([])
        if cls is PackageVersions:  # dpkg-query -W PATTERN...: names and globs
            wanted = list(kwargs["packages"])
            installed = [ln for ln in self._dpkg_lines() if any(fnmatch.fnmatchcase(ln.split()[0], w) for w in wanted)]
            names = [w for w in wanted if not set("*?[") & set(w)]
            return PackageVersions().process([f"{MARK} want {' '.join(names)}", f"{MARK} begin dpkg", *installed])
        if cls is AptVersions and self.provisioned:  # apt-cache madison PKG...
            lines = recorded(self.release, "provisioned/apt-cache-madison.txt")
            return AptVersions().process([ln for ln in lines if ln.split("|")[0].strip() in kwargs["packages"]])
        if cls is AptVersions:
            # A fresh host's index once the run has read the sources it adds (NVIDIA's repository,
            # restricted): STAND-IN, every package at every release compat.yaml names, each at
            # revision -1 (the revision is the only part made up; what is asked for is real)
            return {p: [f"{v}-1" for v in _compat_releases()] for p in kwargs["packages"]}
        if cls is ToolkitIndex:  # a toolkit with no components of its own in the stand-in index
            return {}
        if cls is PackageChange:  # no package change ever ran, dpkg --audit clean
            return PackageChange().process(["LoadState=not-found", "SubState=dead", "Result=success", "ExecMainStatus=0"])
        if cls is AptCandidates:
            policy = apt_cache_policy(recorded(self.release, "apt-cache-policy.txt"))
            return AptCandidates().process([f"{p} {policy.get(p) or '(none)'}" for p in kwargs["packages"]])
        if cls is HeldPackages:  # dpkg-query's Status-Want "hold" (status "h?")
            return HeldPackages().process([ln.split()[0] for ln in self._dpkg_lines() if ln.split()[-1].startswith("h")])
        if cls is StackPackages:  # a fresh host: no CUDA toolkit or cuDNN installed, no record of gpufleet's
            return StackPackages.default()
        if cls is KeyringFingerprints:
            return KeyringFingerprints().process([])
        if cls is DebianArchiveSources:
            return DebianArchiveSources().process(archive_sources_output(self.release))
        if cls is GpuDeviceUsers:
            return []
        if cls is DaemonJson:  # no Docker yet
            return DaemonJson().process([f"{MARK} exists no"])
        if cls is DockerEngine:
            return DockerEngine().process([f"{MARK} begin version"])
        if cls in (DevCharLinks, DaemonReloadPending, ProfilingState):  # no driver: no device nodes, no
            # nvidia module loaded, no profiling option; no reload deferred
            return cls.default()
        if name == "BlockDevices":  # no block devices recorded for it: no drive known, none blank
            return cls.default()  # type: ignore[attr-defined]
        if name == "Arch":
            return self.machine
        if name == "TmpDir":
            return "/tmp"
        if name == "Date":
            return datetime.datetime(2026, 11, 30, 12, 0, 0)
        if name == "Directory" and kwargs.get("path") == "/etc/needrestart" and self.needrestart:
            return {"mode": 755, "user": "root", "group": "root"}
        if name == "File" and self.files.get(kwargs["path"]):
            return {"size": 1, "mode": 600, "user": "root", "group": "root"}
        if cls.__module__.startswith("pyinfra.") and name in _PYINFRA_EMPTY:
            return _PYINFRA_EMPTY[name]
        raise LookupError(f"simulated Ubuntu host: no recording for fact {name}({dict(kwargs)})")


@functools.cache
def _compat_releases() -> list[str]:
    """Every dotted release compat.yaml names (driver, CUDA, cuDNN, DCGM ...), newest first."""
    text = (Path(__file__).resolve().parent.parent / "gpufleet/data/compat.yaml").read_text()
    found = set(re.findall(r"(?<![\w.])\d+\.\d+(?:\.\d+)+(?![\w.])", text))
    return sorted(found, key=lambda v: [int(x) for x in v.split(".")], reverse=True)


def make_state(hosts: Mapping[str, tuple[UbuntuHost, Mapping[str, Any]]]) -> State:
    """A pyinfra State whose inventory holds `hosts` (name -> (simulated host, inventory data))."""
    inventory = Inventory(([(name, dict(data)) for name, (_, data) in hosts.items()], {}))
    return State(inventory, Config())


@contextlib.contextmanager
def canned(hosts: Mapping[str, UbuntuHost]) -> Iterator[list[str]]:
    """Answer every fact of the named hosts from their recordings; refuse any command. Yields the
    list of facts asked (name and arguments), in order."""
    asked: list[str] = []
    original_get_fact, original_run = Host.get_fact, Host.run_shell_command

    def get_fact(self: Host, cls: type, *args: Any, **kwargs: Any) -> Any:
        if self.name not in hosts:
            raise LookupError(f"{self.name} is not a simulated host")
        asked.append(f"{cls.__name__}{sorted(kwargs.items()) or ''}")
        return hosts[self.name].answer(cls, kwargs)

    def no_commands(self: Host, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"simulated host {self.name}: a command would run: {args[:1]}")

    Host.get_fact, Host.run_shell_command = get_fact, no_commands  # type: ignore[method-assign]
    try:
        yield asked
    finally:
        Host.get_fact, Host.run_shell_command = original_get_fact, original_run  # type: ignore[method-assign]


@contextlib.contextmanager
def on_host(state: State, name: str) -> Iterator[Host]:
    """pyinfra's context for deploy code run for one host (what the CLI sets per host)."""
    host = state.inventory.get_host(name)
    with ctx_state.use(state), ctx_host.use(host):
        yield host


def planned_operations(state: State, host: Host) -> list[tuple[str, list[str]]]:
    """(operation name, its commands as text) of everything planned for `host`, in order: what
    `pyinfra ... --dry` would show, with uploaded files as "upload DEST" and their content."""
    out = []
    for op_hash in host.op_hash_order:
        names = ", ".join(sorted(state.get_op_meta(op_hash).names))
        commands = []
        for command in state.get_op_data_for_host(host, op_hash).command_generator():
            if isinstance(command, FileUploadCommand):
                src = command.src
                text = src.getvalue() if hasattr(src, "getvalue") else Path(src).read_text()
                commands.append(f"upload {command.dest}\n{text}")
            elif isinstance(command, StringCommand):
                commands.append(command.get_raw_value())
            else:
                commands.append(repr(command))
        out.append((names, commands))
    return out
