"""
DCGM's active diagnostic, ``dcgmi diag -r LEVEL -j``, read as DCGM prints its JSON.

Levels (NVIDIA, dcgmi diag reference): 1 quick deployment checks (seconds: the validation
gate), 2 medium (about two minutes: the rollout's canary), 3 long hardware diagnostics (about
15 minutes: ``tools/health --burn-in`` on new hosts). Level 2 and up load the GPUs, so the same
remote command first checks that no GPU work runs and runs nothing if some does (``busy``): the
check belongs to the action, as in operations/drain.py's idle_check.

Two JSON shapes exist, and both are read:
- current DCGM (4.x; dcgmi/Diag.cpp ``HelperJsonBuildOutput``, schema
  testing/python3/dcgm_diag_schema.json of github.com/NVIDIA/DCGM): ``{"DCGM Diagnostic":
  {"test_categories": [{"category", "tests": [{"name", "results": [{"entity_group",
  "entity_group_id", "entity_id", "status", "warnings": [{"warning", "error_id",
  "error_category", "error_severity"}]}], "test_summary": {"status"}}]}], "runtime_error"?},
  "entity_groups": [...], "metadata": {"version", "Driver Version Detected"}}``, statuses
  ``Pass``/``Fail``/``Skip``/``Warn`` (dcgmi's HelperDisplayDiagResult);
- the legacy key ``"DCGM GPU Diagnostic"`` (DCGM's own sample, testing/TestDiagManagerStrings.h,
  recorded in tests/fixtures/dcgm/legacy-per-gpu.json): results name ``"gpu_ids": "0,1,2,3"``
  and statuses are upper case (``PASS``, ``FAIL``, ``SKIP``).

dcgmi may print text around the JSON (DCGM's own test harness trims to the outer braces:
testing/python3/DcgmiDiag.py ``trimJsonText``); so does this. Only failing results are kept:
a pass says nothing the verdict needs, and the fact stays small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand
from typing_extensions import override

from ._common import GPU_WORK, MARK, JsonMixin

#: run levels and how long each may take before `timeout` ends it (seconds): DCGM's documented
#: durations (seconds, about 2 minutes, about 15 minutes) with room for an 8-GPU host
LEVEL_TIMEOUTS: dict[int, int] = {1: 300, 2: 1200, 3: 5400}
#: from this level on the diagnostic loads the GPUs: it runs only when they are idle
LOADS_GPUS_FROM = 2

_NEW_KEY, _LEGACY_KEY = "DCGM Diagnostic", "DCGM GPU Diagnostic"


@dataclass(frozen=True)
class DiagWarning(JsonMixin):
    text: str
    error_id: int | None = None     # DCGM_FR_* number (dcgmlib/dcgm_errors.h)
    severity: int | None = None     # dcgmErrorSeverity_t: 1 monitor, 2 isolate, 4 triage, 5 config, 6 reset
    category: int | None = None     # dcgmErrorCategory_t (10 hardware memory, 13 hardware PCIe, ...)


@dataclass(frozen=True)
class DiagResult(JsonMixin):
    category: str                   # Deployment | Integration | Hardware | Stress
    test: str                       # software, pcie, memory, targeted_stress, ...
    gpu: int | None                 # the GPU's DCGM id (its nvidia-smi index); None: not one GPU's
    status: str                     # fail | warn
    warnings: list[DiagWarning] = field(default_factory=list)


@dataclass(frozen=True)
class DcgmDiagData(JsonMixin):
    status: str                     # pass | fail | error | not-installed | busy
    level: int = 1
    failed: list[str] = field(default_factory=list)      # names of the failed tests
    results: list[DiagResult] = field(default_factory=list)  # the failing results, per GPU
    detail: str = ""                # error, busy: what happened
    version: str = ""               # DCGM's version (metadata)


def _json_part(lines: list[str]) -> Any:
    text = "\n".join(line for line in lines if not line.startswith(MARK))
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        return None
    try:
        return json.loads(text[start:end + 1])
    except ValueError:
        return None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _warnings(raw: Any) -> list[DiagWarning]:
    out = []
    for w in raw if isinstance(raw, list) else []:
        if isinstance(w, dict):
            out.append(DiagWarning(str(w.get("warning", "")), _int(w.get("error_id")), _int(w.get("error_severity")),
                                   _int(w.get("error_category"))))
    return out


def _gpus_of(result: dict[str, Any]) -> list[int | None]:
    """The GPU(s) a result is about: the current shape's GPU entity, the legacy "gpu_ids" list."""
    if "entity_id" in result:
        group = result.get("entity_group")
        gid = _int(result.get("entity_id"))
        return [gid if group in (None, "GPU") else None]
    ids = str(result.get("gpu_ids", result.get("gpu_id", "")))
    found: list[int | None] = [int(i) for i in ids.split(",") if i.strip().isdigit()]
    return found or [None]


def diag_from_json(doc: Any, level: int, rc: int | None) -> DcgmDiagData:
    """The fact's value from dcgmi's parsed JSON (either shape) and its exit code."""
    body = doc.get(_NEW_KEY, doc.get(_LEGACY_KEY)) if isinstance(doc, dict) else None
    if not isinstance(body, dict):
        return DcgmDiagData(status="error", level=level,
                            detail=f"dcgmi diag -r {level} -j printed JSON without a {_NEW_KEY!r} object (exit {rc})")
    meta = _object(doc.get("metadata"))
    version = str(meta.get("version") or body.get("version") or "")
    if body.get("runtime_error"):
        return DcgmDiagData(status="error", level=level, version=version,
                            detail=f"dcgmi diag -r {level}: {str(body['runtime_error'])[:300]}")
    failed: list[str] = []
    results: list[DiagResult] = []
    seen = 0
    for cat in body.get("test_categories") or []:
        if not isinstance(cat, dict):
            continue
        for test in cat.get("tests") or []:
            if not isinstance(test, dict):
                continue
            seen += 1
            name = str(test.get("name", "?"))
            summary = _object(test.get("test_summary"))
            test_failed = str(summary.get("status", "")).lower() == "fail"
            per_gpu = False
            for res in test.get("results") or []:
                if not isinstance(res, dict):
                    continue
                status = str(res.get("status", "")).lower()
                if status not in ("fail", "warn"):
                    continue
                test_failed |= status == "fail"
                for gpu in _gpus_of(res):
                    per_gpu |= gpu is not None
                    results.append(DiagResult(str(cat.get("category", "")), name, gpu, status,
                                              _warnings(res.get("warnings"))))
            if test_failed and not per_gpu:
                # failed as a whole (the summary's errors are not one GPU's)
                results.append(DiagResult(str(cat.get("category", "")), name, None, "fail",
                                          _warnings(summary.get("warnings"))))
            if test_failed:
                failed.append(name)
    if failed:
        return DcgmDiagData(status="fail", level=level, failed=failed, results=results, version=version)
    if not seen:
        return DcgmDiagData(status="error", level=level, version=version,
                            detail=f"dcgmi diag -r {level} -j reported no test (exit {rc})")
    if rc not in (0, None):
        return DcgmDiagData(status="error", level=level, results=results, version=version,
                            detail=f"dcgmi diag -r {level} exited {rc} with no failed test")
    return DcgmDiagData(status="pass", level=level, results=results, version=version)


def parse_dcgm_diag(lines: list[str], level: int = 1) -> DcgmDiagData:
    """The fact's value from its command's output: our marker lines, then dcgmi's JSON."""
    rc: int | None = None
    for line in lines:
        if line.startswith(f"{MARK} level ") and line.split()[-1].isdigit():
            level = int(line.split()[-1])
        if line.strip() == f"{MARK} no-dcgmi":
            return DcgmDiagData(status="not-installed", level=level, detail="DCGM (dcgmi) not installed")
        if line.startswith(f"{MARK} busy"):
            return DcgmDiagData(status="busy", level=level,
                                detail="GPU work is running, diagnostic not run: " + line[len(MARK) + 5:].strip()[:300])
        if line.startswith(f"{MARK} rc "):
            rc = int(line.split()[-1])
    doc = _json_part(lines)
    if doc is None:
        text = " ".join(line.strip() for line in lines if not line.startswith(MARK))[:300]
        return DcgmDiagData(status="error", level=level, detail=f"dcgmi diag -r {level} -j exited {rc}: {text}")
    return diag_from_json(doc, level, rc)


# $1 the run level, $2 its timeout in seconds, $3 1 when the level loads the GPUs (idle first)
_DIAG_SCRIPT = (
    "echo '" + MARK + " level '\"$1\"; "
    "if ! command -v dcgmi >/dev/null 2>&1; then echo '" + MARK + " no-dcgmi'; exit 0; fi; "
    "if [ \"$3\" = 1 ]; then " + GPU_WORK + "; if [ -n \"$pids$apps\" ]; then "
    "echo \"" + MARK + " busy ${apps:+$apps }${pids:+processes holding /dev/nvidia*: $pids}\" | tr '\\n' ' '; echo; "
    "exit 0; fi; fi; "
    "timeout \"$2\" dcgmi diag -r \"$1\" -j 2>&1; echo \"" + MARK + " rc $?\""
)


class DcgmDiag(FactBase[DcgmDiagData]):
    """``dcgmi diag -r LEVEL -j`` where DCGM is installed (level 2 and 3 only on idle GPUs)."""

    gpufleet_no_prefetch = True  # runs for seconds to minutes on the GPUs: never in a later run's prefetch

    @override
    def command(self, level: int = 1) -> StringCommand:
        level = int(level)
        if level not in LEVEL_TIMEOUTS:
            raise ValueError(f"DCGM diagnostic level {level}: allowed {', '.join(map(str, LEVEL_TIMEOUTS))}")
        return StringCommand("sh", "-c", QuoteString(_DIAG_SCRIPT), "dcgm-diag", str(level),
                             str(LEVEL_TIMEOUTS[level]), "1" if level >= LOADS_GPUS_FROM else "0")

    @override
    def process(self, output: list[str]) -> DcgmDiagData:
        return parse_dcgm_diag(output)
