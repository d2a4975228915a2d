"""
The CPU frequency governor of every CPU that has cpufreq (/sys/devices/system/cpu/cpu*/cpufreq).

Containers and many VMs have no cpufreq directory at all: then the fact is empty, and there is
no governor to set. Only the shell's `read` is used (no process per CPU).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import JsonMixin, fail, with_values

CPU_ROOT = "/sys/devices/system/cpu"

_LINE = re.compile(r"^(?P<cpu>cpu\d+)\|(?P<governor>[\w-]*)\|(?P<available>[\w -]*)$")


@dataclass(frozen=True)
class CpuFreqData(JsonMixin):
    governors: dict[str, str] = field(default_factory=dict)  # cpu0 -> current governor ("" unreadable)
    available: list[str] = field(default_factory=list)  # governors every CPU offers, in the kernel's order

    @property
    def present(self) -> bool:
        return bool(self.governors)


def cpufreq_command(cpu_root: str = CPU_ROOT) -> str:
    """One line 'cpuN|governor|available governors' per CPU with cpufreq. `cpu_root` exists so
    tests can run the real command against a fake tree."""
    return with_values('for d in "$root"/cpu[0-9]*/cpufreq; do [ -d "$d" ] || continue; '
                       'g=; read -r g < "$d/scaling_governor" 2>/dev/null; '
                       'a=; read -r a < "$d/scaling_available_governors" 2>/dev/null; '
                       'c=${d%/cpufreq}; echo "${c##*/}|$g|$a"; done; true', root=cpu_root)


def parse_cpufreq(lines: Sequence[str]) -> CpuFreqData:
    governors: dict[str, str] = {}
    available: list[str] | None = None
    for line in lines:
        if not line.strip():
            continue
        match = _LINE.match(line.strip())
        if not match:
            raise fail("expected 'cpuN|governor|available governors' from cpufreq", line)
        governors[match.group("cpu")] = match.group("governor")
        offered = match.group("available").split()
        available = offered if available is None else [g for g in available if g in offered]
    return CpuFreqData(governors=governors, available=available or [])


class CpuFreq(FactBase[CpuFreqData]):
    """
    Returns each CPU's cpufreq governor and the governors all of them offer:

    .. code:: python

        CpuFreqData(governors={"cpu0": "powersave", "cpu1": "powersave"},
                    available=["performance", "powersave"])
    """

    @override
    @staticmethod
    def default() -> CpuFreqData:
        return CpuFreqData()

    @override
    def command(self) -> str:
        return cpufreq_command()

    @override
    def process(self, output: list[str]) -> CpuFreqData:
        return parse_cpufreq(output)
