"""
What the GPUs do when they are used: what a container sees of them and the performance probe's
raw output (DCGM's diagnostic: facts/dcgm_diag.py). Each is one small remote command; every
``process()`` is pure and unit-tested (tests/unit/test_validate_facts.py, tests/unit/facts/).
"""

from __future__ import annotations

import importlib.resources
import json
import re
from dataclasses import dataclass, field

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

from ._common import JsonMixin
from .pytorch import interpreter

# ------------------------------------------------------------------------------------------
# What containers see
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContainerGpusData(JsonMixin):
    docker: bool = False  # the docker CLI exists
    active: str = "unknown"  # systemctl is-active docker
    nvidia_runtime: bool = False  # dockerd knows the "nvidia" runtime
    cdi_devices: list[str] = field(default_factory=list)  # nvidia-ctk cdi list: nvidia.com/gpu=0 ...
    toolkit: bool = False  # nvidia-ctk exists

    @property
    def gpu_indices(self) -> list[str]:
        """The per-GPU CDI names by index (nvidia.com/gpu=0, =1...), not =all or =GPU-uuid."""
        return [d for d in self.cdi_devices if re.fullmatch(r"nvidia\.com/gpu=\d+", d)]


def _runtimes_of_info(text: str) -> str:
    """The Runtimes of dockerd's /info answer, as `docker info --format '{{json .Runtimes}}'`
    prints them ("" when the answer is not JSON)."""
    try:
        info = json.loads(text)
    except ValueError:
        return ""
    runtimes = info.get("Runtimes") if isinstance(info, dict) else None
    return json.dumps(runtimes, separators=(",", ":")) if isinstance(runtimes, dict) else ""


def parse_container_gpus(lines: list[str]) -> ContainerGpusData:
    values: dict[str, str] = {}
    cdi: list[str] = []
    for line in lines:
        line = line.strip()
        if line.startswith("cdi:"):
            name = line[4:].strip()
            if re.fullmatch(r"[\w.\-]+/[\w.\-]+=[\w.\-:]+", name):
                cdi.append(name)
            continue
        key, sep, value = line.partition("=")
        if sep and key == "info":
            values["runtimes"] = _runtimes_of_info(value)
        elif sep and key in ("docker", "active", "runtimes", "ctk"):
            values[key] = value.strip()
    return ContainerGpusData(
        docker=values.get("docker") == "yes",
        active=values.get("active") or "unknown",
        nvidia_runtime='"nvidia"' in values.get("runtimes", ""),
        cdi_devices=cdi,
        toolkit=values.get("ctk") == "yes",
    )


# dockerd's runtimes come from its /info endpoint on the default socket when curl is there: the
# same answer `docker info` prints, without starting the docker CLI, which cost a no-op run about
# 30 ms of each host's CPU (bench/fleet.py). The CLI answers where there is no curl or no socket.
_CONTAINER_SCRIPT = r"""
if command -v docker >/dev/null 2>&1; then echo docker=yes; else echo docker=no; fi
echo "active=$(systemctl is-active docker 2>/dev/null)"
if command -v docker >/dev/null 2>&1; then
  info=
  if [ -S /run/docker.sock ] && command -v curl >/dev/null 2>&1; then
    info=$(timeout 20 curl -sf --unix-socket /run/docker.sock http://localhost/info 2>/dev/null | tr -d '\n')
  fi
  if [ -n "$info" ]; then
    echo "info=$info"
  else
    echo "runtimes=$(timeout 20 docker info --format '{{json .Runtimes}}' 2>/dev/null | tr -d '\n')"
  fi
fi
if command -v nvidia-ctk >/dev/null 2>&1; then
  echo ctk=yes
  timeout 20 nvidia-ctk cdi list 2>/dev/null | sed -n 's/^/cdi: /p'
fi
true
"""


class ContainerGpus(FactBase[ContainerGpusData]):
    """
    Docker engine, its NVIDIA runtime and the GPUs the container toolkit exposes (CDI):

    .. code:: python

        ContainerGpusData(docker=True, active="active", nvidia_runtime=True,
                          cdi_devices=["nvidia.com/gpu=0", "nvidia.com/gpu=all"], toolkit=True)
    """

    @override
    @staticmethod
    def default() -> ContainerGpusData:
        return ContainerGpusData()

    @override
    def command(self) -> StringCommand:
        return StringCommand("sh", "-c", QuoteString(_CONTAINER_SCRIPT))

    @override
    def process(self, output: list[str]) -> ContainerGpusData:
        return parse_container_gpus(output)


# ------------------------------------------------------------------------------------------
# Performance probe (raw lines; gpufleet.plans.perf.parse_probe_output judges them)
# ------------------------------------------------------------------------------------------

# gpufleet/perf_probe.py: a file of the package, read and sent, never imported here
PROBE_SCRIPT = importlib.resources.files("gpufleet").joinpath("perf_probe.py").read_text()


class PerfProbe(FactBase[list[str]]):
    """
    The JSON lines of gpufleet/perf_probe.py run with ``python`` (the PyTorch runtime's
    interpreter, gpufleet/plans/pytorch_runtime.py; default the host's python3): first line
    ``{"status": "ok"|"skipped", ...}``, then one raw measurement per line.
    A host without that interpreter says so the same way.
    """

    gpufleet_no_prefetch = True  # loads every GPU for seconds: never in a later run's prefetch

    @override
    @staticmethod
    def default() -> list[str]:
        return ['{"status": "skipped", "reason": "no such interpreter"}']

    @override
    def requires_command(self, *args, python: str = "python3", **kwargs) -> str:
        return interpreter(python)

    @override
    def command(self, device: str = "cuda", size: int = 8192, iters: int = 20,
                copy_mib: int = 1024, allreduce_mib: int = 2048, python: str = "python3") -> StringCommand:
        if device not in ("cuda", "cpu"):
            raise ValueError(f"probe device must be cuda or cpu, not {device!r}")
        numbers = [int(size), int(iters), int(copy_mib), int(allreduce_mib)]
        return StringCommand(
            interpreter(python), "-c", QuoteString(PROBE_SCRIPT), "--device", device,
            "--size", str(numbers[0]), "--iters", str(numbers[1]),
            "--copy-mib", str(numbers[2]), "--allreduce-mib", str(numbers[3]),
        )

    @override
    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line.strip()]


# gpufleet/allreduce_probe.py: a file of the package, read and sent, never imported here
ALLREDUCE_SCRIPT = importlib.resources.files("gpufleet").joinpath("allreduce_probe.py").read_text()


class AllReduceRank(FactBase[list[str]]):
    """
    One rank of gpufleet/allreduce_probe.py's all-reduce between hosts: the lines it printed
    (NCCL's INFO lines, then one JSON line). Every rank must be asked at once (the controller
    reads the ranks' facts concurrently): a rank alone waits for the others until ``timeout``.
    """

    gpufleet_no_prefetch = True  # a measurement with other hosts: never cached, never batched

    @override
    @staticmethod
    def default() -> list[str]:
        return ['{"status": "error", "reason": "no such interpreter"}']

    @override
    def requires_command(self, *args, python: str = "python3", **kwargs) -> str:
        return interpreter(python)

    @override
    def command(self, master: str, port: int, rank: int, world: int, backend: str = "auto", mib: int = 256,
                iters: int = 5, timeout: int = 60, python: str = "python3") -> StringCommand:
        if backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"all-reduce backend must be auto, nccl or gloo, not {backend!r}")
        numbers = [str(int(v)) for v in (port, rank, world, mib, iters, timeout)]
        return StringCommand(
            interpreter(python), "-c", QuoteString(ALLREDUCE_SCRIPT), "--master", QuoteString(str(master)),
            "--port", numbers[0], "--rank", numbers[1], "--world", numbers[2], "--backend", backend,
            "--mib", numbers[3], "--iters", numbers[4], "--timeout", numbers[5], "2>&1",
        )

    @override
    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line.strip()]
