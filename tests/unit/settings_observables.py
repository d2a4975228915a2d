"""What gpufleet visibly does for one host, computed without a host: the observables the
settings-are-alive test (test_settings_alive.py) compares before and after one key changes.

A host of a tier is simulated with testing/ubuntu_host.py (an Ubuntu 24.04 host whose facts are
answered from recorded output; every command refused), plus recorded samples for what that
double does not answer (sshd, nftables, NICs, RDMA, GPUs). For it, in order (the comparison
stops at the first one that differs):

- inventory: the problems planning-time validation reports for the host's data (gpufleet.config.settings);
- plan: the plan view, deploys/plan.py, as pyinfra's CLI runs it, without its `override:` lines
  and the tier_mismatch word of its MISMATCH lines (those only echo the inventory);
- deploy: every command pyinfra's real operations yield when deploys/all.py's areas are planned
  in its order (preflight .. hardening; a refused host gets nothing more), uploaded files with
  their content, random ids masked;
- log: what the areas print (warnings, refusals, no-op messages), and what all.py prints at exit (pending upgrades);
- gate: the validation gate's verdict (area, check, status) on the same facts;
- rollout: the commands tools/rollout's drain, snapshot and reboot steps (deploys/upgrade.py) yield, what its
  validation of a canary refuses, and
  the batch size its runner takes from the survey step (gpufleet/rollout/plan.py);
- lock: the command all.py and tools/rollout send to take the host's lock (gpufleet/controller/hostlock.py).
"""
from __future__ import annotations

import importlib
import inspect
import io
import json
import logging
import re
import runpy
from collections.abc import Callable, Mapping
from contextlib import redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.api.command import FileUploadCommand
from pyinfra.api.exceptions import PyinfraError

import gpufleet.facts.nftables as nf
import gpufleet.facts.ssh as fs
import gpufleet.facts.sshd_files as sf
import gpufleet.facts.storage as st
from gpufleet.errors import InventoryError
from gpufleet.facts.cpu import CpuFreqData
from gpufleet.facts.gpu import GpuState
from gpufleet.facts.kernel import DriverState
from gpufleet.facts.network import NetworkInterfaces, RdmaDevices
from gpufleet.facts.system import SystemResourcesData
from gpufleet.catalog.tiers import tier_defaults
from testing.ubuntu_host import FIXTURES, REPO, UbuntuHost, canned, make_state, on_host

#: all.py's areas before the gate, in its order
AREAS = ("preflight", "base", "driver", "docker", "tuning", "pytorch", "storage", "monitoring", "hardening")
OBSERVABLES = ("inventory", "plan", "deploy", "log", "gate", "rollout", "lock")
NAME = "gpu01.example.internal"


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def _fact_case(path: str) -> list[str]:
    """The recorded output of a fact case (tests/unit/facts/<fact>/<case>.json)."""
    case = json.loads((REPO / "tests/unit/facts" / path).read_text())
    return case["output"] if "output" in case else _lines(REPO / case["output_file"])


SSH = FIXTURES / "ssh"
UBUNTU_SSH = FIXTURES / "ubuntu" / "ssh"


def _recorded() -> dict[str, Any]:
    return {
        "SshdVersion": fs.parse_openssh_version(_lines(UBUNTU_SSH / "ssh-V-24.04.txt")),
        "SshdActivation": fs.parse_sshd_activation(_lines(UBUNTU_SSH / "systemctl-show-ssh-24.04-socket.txt")),
        "SshdEffectiveConfig": fs.parse_sshd_t(_lines(UBUNTU_SSH / "sshd-T-24.04.txt")),
        "AuthorizedKeys": fs.parse_authorized_keys(_lines(SSH / "authorized-keys-trixie-root.txt")),
        "SmallModuli": fs.parse_moduli_counts(_lines(SSH / "moduli-trixie-debian-default.txt")),
        "SshdFiles": sf.parse_sshd_files(_lines(SSH / "sshd-files-trixie-debian-default.txt")),
        # eight blank NVMe data drives beside the system's two (written in the DGX H100's layout),
        # /dev/shm as recorded on a test host
        "BlockDevices": st.parse_block_devices(_lines(FIXTURES / "storage" / "lsblk-probe-hgx-shape-written.txt")),
        "ShmSize": st.parse_shm(_lines(FIXTURES / "storage" / "shm-nspawn-50pct.txt")),
        "NftablesCapability": nf.parse_nftables_state(_lines(SSH / "nftables-state-trixie-container.txt")),
        "NetworkInterfaces": NetworkInterfaces().process(_lines(FIXTURES / "facts/samples/sys-class-net.txt")),
        "RdmaDevices": RdmaDevices().process(_lines(FIXTURES / "facts/samples/sys-class-infiniband.txt")),
        # 2 TB of RAM, 32 cores, cpufreq offering the usual governors (running schedutil)
        "SystemResources": SystemResourcesData(logical_cpus=64, physical_cores=32, sockets=2, numa_nodes=2,
                                               memory_total_kib=2_100_000_000_000 // 1024),
        "CpuFreq": CpuFreqData(governors={f"cpu{n}": "schedutil" for n in range(4)},
                               available=["performance", "schedutil", "ondemand", "powersave"]),
    }


def recorded_fact(cls: type, case: str) -> Any:
    """What fact `cls` makes of the output recorded in its case tests/unit/facts/<module>.<cls>/<case>.json."""
    return cls().process(_fact_case(f"{cls.__module__.split('.')[-1]}.{cls.__name__}/{case}.json"))


def provisioned() -> dict[str, Any]:
    """Facts of a host whose driver works: two H200s (recorded nvidia-smi), the module loaded."""
    return {"GpuState": GpuState().process(_fact_case("gpu.GpuState/recorded_h200_x2.json")),
            "DriverState": DriverState().process(_fact_case("kernel.DriverState/h200_driver_loaded.json"))}


@dataclass
class SimulatedHost(UbuntuHost):
    """testing/ubuntu_host.UbuntuHost plus recorded samples, `extra` facts by class name (they
    win), and each remaining fact's default (what a host without that tool answers)."""

    extra: Mapping[str, Any] = field(default_factory=dict)

    def answer(self, cls: type, kwargs: Mapping[str, Any]) -> Any:
        name = cls.__name__
        if name in self.extra:
            value = self.extra[name]
            return value(kwargs) if callable(value) else value
        recorded = _recorded_facts()
        if name in recorded:
            return recorded[name]
        try:
            return super().answer(cls, kwargs)
        except LookupError:
            answer = cls.default()  # type: ignore[attr-defined]
            if answer is None and cls.__module__.startswith("gpufleet.facts"):
                answer = cls().process([])  # its command printed nothing: the tool is not there
            return answer


_RECORDED: dict[str, Any] = {}


def _recorded_facts() -> dict[str, Any]:
    if not _RECORDED:
        _RECORDED.update(_recorded())
    return _RECORDED


def host_of(tier: str, extra: Mapping[str, Any] | None = None) -> SimulatedHost:
    """A host with the hardware the tier plans for: its first GPU model, its smallest count."""
    values = tier_defaults(tier)
    count = values["validate_gpu_count"]
    count = count if isinstance(count, int) else count[0]
    return SimulatedHost("24.04", [values["validate_gpu_models"][0]] * count,
                         nvswitches=4 if values["validate_nvswitch"] == "required" else 0,
                         rdma=values["validate_rdma"] == "required", extra=dict(extra or {}))


#: what differs from one run to the next: random ids, clock readings
_UUID = re.compile(r"\b[0-9a-f]{32}\b|\d{8}T\d{6}Z?|\d{4}-\d\d-\d\dT[\d:.]+(Z|[+-]\d\d:?\d\d)?|\b1\d{9}(\.\d+)?\b")


def _argument(value: Any) -> str:
    """A callback's argument as text; a function that builds the content from nothing (the
    rollout's manifest) by what it builds."""
    if callable(value) and not inspect.signature(value).parameters:
        return f"<{value.__name__}: {value()}>"
    return f"<{value.__qualname__}>" if callable(value) else repr(value)


def _text(command: Any) -> str:
    if isinstance(command, FileUploadCommand):
        src = command.src
        return f"upload {command.dest}\n" + (src.getvalue() if hasattr(src, "getvalue") else Path(src).read_text())
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    if isinstance(command, FunctionCommand):
        args = [*map(_argument, command.args), *(f"{k}={_argument(v)}" for k, v in sorted(command.kwargs.items()))]
        return f"{command.function.__qualname__}({', '.join(args)})"
    return repr(command)


def _commands(state: Any, host: Any) -> list[str]:
    out = []
    for op_hash in host.op_hash_order:
        if op_hash in state.ops[host]:  # an operation a failed host never got
            out += [_UUID.sub("<id>", _text(c)) for c in state.get_op_data_for_host(host, op_hash).command_generator()]
    return out


class _Grab(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(_UUID.sub("<id>", record.getMessage()))


def _inventory(sim: SimulatedHost, data: dict[str, Any]) -> list[str]:
    from gpufleet.config.settings import host_settings

    state = make_state({NAME: (sim, data)})
    try:
        host_settings(state.inventory.get_host(NAME))
    except InventoryError as error:
        return [str(p) for p in error.problems] if hasattr(error, "problems") else [str(error)]
    return []


def _plan(sim: SimulatedHost, data: dict[str, Any]) -> list[str]:
    state = make_state({NAME: (sim, data)})
    out = io.StringIO()
    with canned({NAME: sim}), redirect_stderr(out), on_host(state, NAME):
        runpy.run_path(str(REPO / "deploys" / "plan.py"))
    # left out: the overrides it lists and the tier_mismatch word it repeats (echoes of the inventory)
    return [re.sub(r"^(\s*MISMATCH) \((warn|fail)\)", r"\1", line) for line in out.getvalue().splitlines()
            if not line.strip().startswith("override:")]


def _deploy(sim: SimulatedHost, data: dict[str, Any]) -> tuple[list[str], list[str]]:
    from gpufleet.config.failures import host_failed

    state = make_state({NAME: (sim, data)})
    state.print_noop_info = True  # as `pyinfra -v`: what each operation found already done
    grab = _Grab()
    logger = logging.getLogger("pyinfra")
    level = logger.level
    logger.addHandler(grab)
    logger.setLevel(logging.INFO)
    try:
        with canned({NAME: sim}), on_host(state, NAME) as host:
            for area in AREAS:
                try:
                    getattr(importlib.import_module(f"gpufleet.deploys.{area}"), area)()
                except PyinfraError:  # the only host failed: pyinfra has no host left
                    pass
                if host_failed(host):
                    break
            commands = _commands(state, host)
    finally:
        logger.removeHandler(grab)
        logger.setLevel(level)
    # what all.py says at the end of the run about this host (driver.py keeps it in the host's context)
    from gpufleet.config.hostcontext import host_context

    done = host_context(host).outcome
    at_exit = [f"pending at exit: {done.driver_pending}"] if done.driver_pending else []
    at_exit += [f"stack pending at exit: {done.stack_pending}"] if done.stack_pending else []
    return commands, grab.lines + at_exit


def _gate(sim: SimulatedHost, data: dict[str, Any]) -> list[str]:
    from gpufleet.config.settings import host_settings
    from gpufleet.checks.validation import run_checks

    state = make_state({NAME: (sim, data)})
    with canned({NAME: sim}), on_host(state, NAME) as host:
        results = run_checks(host, host_settings(host), probe=False)
    return [f"{r.area}: {r.name}: {r.status}" for r in results]


def _rollout(sim: SimulatedHost, data: dict[str, Any]) -> list[str]:
    from gpufleet.deploys import upgrade
    from gpufleet.rollout.context import RolloutContext
    from gpufleet.rollout.plan import batch_size_for

    state = make_state({NAME: (sim, data)})
    ctx = RolloutContext(target="580.159.04", canaries={NAME})   # the canary: its validation runs DCGM too
    with canned({NAME: sim}), on_host(state, NAME) as host:
        upgrade.survey_host(ctx)
        for step in (upgrade.drain, upgrade.snapshot, upgrade.reboot, upgrade.validate):
            try:
                step(ctx)
            except PyinfraError:
                pass
        # the batch the runner makes of a 16-host rollout of such hosts after its canary
        batch = batch_size_for(16, None, None, ctx.survey[NAME]["batch_size"])
        return [*_commands(state, host), *(f"refused: {why}" for why in ctx.reasons.values()), f"batch: {batch}"]


def _lock(sim: SimulatedHost, data: dict[str, Any]) -> list[str]:
    from gpufleet.controller import hostlock

    state = make_state({NAME: (sim, data)})
    with canned({NAME: sim}), on_host(state, NAME) as host:
        return [hostlock.hold_command(hostlock.lock_wait(host), "owner")]


def observe(sim: SimulatedHost, data: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """The observables of one host with inventory data `data`, each computed when first asked."""
    cache: dict[str, Any] = {}

    def deploy() -> Any:
        if "deploy" not in cache:
            cache["deploy"] = _deploy(sim, data)
        return cache["deploy"]

    def valid(compute: Callable[[SimulatedHost, dict[str, Any]], Any]) -> Callable[[], Any]:
        return lambda: None if _inventory(sim, data) else compute(sim, data)

    return {"inventory": lambda: _inventory(sim, data), "plan": valid(_plan),
            "deploy": valid(lambda s, d: deploy()[0]), "log": valid(lambda s, d: deploy()[1]),
            "gate": valid(_gate), "rollout": valid(_rollout), "lock": valid(_lock)}


@dataclass
class Observed:
    """Observables computed lazily and kept: a scenario's reference is computed once."""

    compute: dict[str, Callable[[], Any]]
    values: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, what: str) -> Any:
        if what not in self.values:
            self.values[what] = self.compute[what]()
        return self.values[what]


def first_difference(before: Observed, after: Observed) -> str | None:
    """The first observable (in OBSERVABLES order) that differs, or None."""
    for what in OBSERVABLES:
        if before[what] != after[what]:
            return what
    return None
