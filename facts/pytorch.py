"""
Which PyTorch the host's python3 imports, and what it was built for: ``torch.__version__``,
``torch.version.cuda`` (None for a CPU-only build) and ``torch.cuda.get_arch_list()`` (the
compute capabilities the wheel carries kernels for). Read on the host by a fixed script; the
controller never imports torch. gpufleet/catalog/pytorch.py judges the answer against the GPUs.

Importing torch costs a second or two of CPU on the host, so the validation gate asks only
when its probes run, and the fact is never prefetched on a later run (gpufleet/controller/factcache.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

from ._common import JsonMixin

MARK = "::gpufleet-torch::"

# Runs on the host (`python3 -c SCRIPT MARK`): one marked JSON line whatever happens. The
# NVML-based availability check keeps torch from initialising CUDA if an old release's
# get_arch_list() asks is_available(); release 2.13's does not (it reads the compiled flags).
SCRIPT = r"""
import json, os, sys
mark = sys.argv[1]
def say(**answer):
    answer["python"] = "%d.%d.%d" % sys.version_info[:3]
    print(mark + " " + json.dumps(answer, sort_keys=True), flush=True)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
try:
    import torch
except ImportError as error:
    say(status="no-torch", reason=str(error)[:200])
    sys.exit(0)
except Exception as error:
    say(status="broken", reason=(type(error).__name__ + ": " + str(error))[:300])
    sys.exit(0)
version = getattr(torch, "__version__", None)
info = getattr(torch, "version", None)
cuda = getattr(info, "cuda", None)
hip = getattr(info, "hip", None)
archs, why = [], ""
try:
    archs = list(torch.cuda.get_arch_list())
except Exception as error:
    why = (type(error).__name__ + ": " + str(error))[:200]
if not archs and cuda:
    # releases whose get_arch_list() is empty while CUDA is unavailable: the compiled list
    flags = getattr(getattr(torch, "_C", None), "_cuda_getArchFlags", None)
    try:
        archs = (flags() or "").split() if flags else []
    except Exception:
        pass
say(status="ok", torch=None if version is None else str(version), cuda=None if cuda is None else str(cuda),
    hip=None if hip is None else str(hip), arch_list=[str(a) for a in archs], reason=why,
    path=os.path.dirname(getattr(torch, "__file__", "") or ""))
"""


@dataclass(frozen=True)
class TorchBuildData(JsonMixin):
    # ok | no-python | no-torch | broken (import failed) | unknown (no answer understood)
    status: str
    torch: str | None = None  # "2.11.0+cu128"
    cuda: str | None = None  # torch.version.cuda: "12.8", None for a CPU-only build
    hip: str | None = None  # torch.version.hip (a ROCm build)
    arch_list: list[str] = field(default_factory=list)  # ["sm_75", ..., "compute_120"]
    python: str | None = None
    path: str = ""  # where torch was imported from
    reason: str = ""

    @property
    def present(self) -> bool:
        return self.status == "ok"

    @property
    def cpu_only(self) -> bool:
        return self.present and not self.cuda and not self.hip


def parse_torch_build(lines: list[str]) -> TorchBuildData:
    """The marked JSON line of SCRIPT; anything else (warnings torch prints) is ignored."""
    for line in lines:
        line = line.strip()
        if not line.startswith(MARK):
            continue
        try:
            raw = json.loads(line[len(MARK):])
        except ValueError:
            return TorchBuildData(status="unknown", reason=f"not JSON: {line[:200]}")
        if not isinstance(raw, dict) or raw.get("status") not in ("ok", "no-torch", "broken"):
            return TorchBuildData(status="unknown", reason=f"unexpected answer: {line[:200]}")

        def text(key: str, raw: dict = raw) -> str | None:
            value = raw.get(key)
            return None if value is None else str(value)

        archs = raw.get("arch_list") or []
        return TorchBuildData(
            status=raw["status"], torch=text("torch"), cuda=text("cuda"), hip=text("hip"),
            arch_list=[str(a) for a in archs] if isinstance(archs, list) else [],
            python=text("python"), path=text("path") or "", reason=text("reason") or "",
        )
    shown = " ".join(line.strip() for line in lines if line.strip())[:300]
    return TorchBuildData(status="unknown", reason=f"the probe printed no answer{': ' + shown if shown else ''}")


def interpreter(python: str) -> str:
    """The interpreter to run: python3 on the PATH, or an absolute path (the tier's
    pytorch_python or gpufleet's venv, checked by gpufleet/config/schema.py; checked again here, as
    the value lands on a command line)."""
    if python == "python3" or (python.startswith("/") and re.fullmatch(r"[A-Za-z0-9._+@/-]+", python)
                               and ".." not in python.split("/")):
        return python
    raise ValueError(f"not an interpreter path: {python!r}")


class TorchBuild(FactBase[TorchBuildData]):
    """
    The PyTorch build an interpreter imports (``python``: the runtime's absolute path, default
    the host's ``python3``; gpufleet/plans/pytorch_runtime.py):

    .. code:: python

        TorchBuildData(status="ok", torch="2.11.0+cu128", cuda="12.8",
                       arch_list=["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"], python="3.11.2")
        TorchBuildData(status="no-torch", reason="No module named 'torch'")
        TorchBuildData(status="no-python")  # no such interpreter on the host
    """

    # never part of a later run's prefetch: importing torch costs seconds (gpufleet/controller/factcache.py)
    gpufleet_no_prefetch = True

    @override
    @staticmethod
    def default() -> TorchBuildData:
        return TorchBuildData(status="no-python", reason="no such interpreter")

    @override
    def requires_command(self, python: str = "python3") -> str:
        return interpreter(python)

    @override
    def command(self, python: str = "python3") -> StringCommand:
        return StringCommand("timeout", "120", interpreter(python), "-c", QuoteString(SCRIPT), QuoteString(MARK),
                             "2>/dev/null", "||", "true")

    @override
    def process(self, output: list[str]) -> TorchBuildData:
        return parse_torch_build(output)
