"""Which GPU to pull: health readings (facts/health.py) turned into findings, each with a class
and one line saying what to do. The classes, fixes and their sources are data
(gpufleet/data/health.yaml), not code: this module only compares readings with them.

Classes, from harmless to worst: ok, monitor, reset (a GPU reset clears it), reboot (the node),
drain (out of service until someone looks), rma (return the GPU). A host needs action when its
worst class is reset or worse.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from gpufleet import yamlload
from gpufleet.facts.dcgm_diag import DcgmDiagData, DiagResult, DiagWarning
from gpufleet.facts.health import GpuHealthData, GpuHealthReading

CLASSES = ("ok", "monitor", "reset", "reboot", "drain", "rma")
#: a finding of this class or worse needs someone to act (exit codes, the gate, Slurm)
ACTION = "reset"
#: DCGM's limit of retired pages (single- and double-bit), past which it asks for the field
#: diagnostic (health.yaml S7)
RETIRED_PAGES_LIMIT = 63


#: NVML's recovery actions by number (health.yaml S9)
RECOVERY_ACTIONS = {0: "NONE", 1: "GPU_RESET", 2: "NODE_REBOOT", 3: "DRAIN_P2P", 4: "DRAIN_AND_RESET",
                    5: "RECOVER_IMEX_DOMAIN", 6: "BUS_RESET", 7: "SYSTEM_REBOOT"}


def rank(cls: str) -> int:
    return CLASSES.index(cls)


@dataclass(frozen=True)
class Finding:
    check: str
    cls: str
    detail: str
    fix: str
    source: str = ""

    def as_json(self) -> dict[str, str]:
        return {"check": self.check, "class": self.cls, "detail": self.detail, "fix": self.fix}


@dataclass(frozen=True)
class GpuVerdict:
    index: int
    bus_id: str
    name: str
    findings: tuple[Finding, ...]

    @property
    def worst(self) -> str:
        return max((f.cls for f in self.findings), key=rank, default="ok")


@dataclass(frozen=True)
class HostVerdict:
    gpus: tuple[GpuVerdict, ...]
    host_findings: tuple[Finding, ...] = ()   # not one GPU's: nvidia-smi failing, the kernel log unread
    #: DCGM's diagnostic when it was asked for: "" (not asked), pass, fail, error, busy, not-installed
    diag_status: str = ""
    diag_detail: str = ""

    @property
    def worst(self) -> str:
        return max([*(g.worst for g in self.gpus), *(f.cls for f in self.host_findings)], key=rank, default="ok")

    @property
    def needs_action(self) -> bool:
        return rank(self.worst) >= rank(ACTION)

    def actionable(self) -> list[tuple[GpuVerdict | None, Finding]]:
        """(GPU or None, finding) of every finding that needs action, worst first."""
        found: list[tuple[GpuVerdict | None, Finding]] = [
            (None, f) for f in self.host_findings if rank(f.cls) >= rank(ACTION)]
        found += [(g, f) for g in self.gpus for f in g.findings if rank(f.cls) >= rank(ACTION)]
        return sorted(found, key=lambda pair: -rank(pair[1].cls))


@dataclass(frozen=True)
class Rule:
    cls: str
    detail: str
    fix: str
    source: str


@dataclass(frozen=True)
class HealthRules:
    checks: dict[str, Rule]
    xids: dict[int, Rule]
    xid_other: Rule
    sources: dict[str, str] = field(default_factory=dict)
    dcgm_severities: dict[int, Rule] = field(default_factory=dict)
    dcgm_other: Rule | None = None
    nvlink_links: dict[str, int] = field(default_factory=dict)   # links per GPU, by model name


def _rule(raw: Any, where: str, sources: dict[str, str]) -> Rule:
    if not isinstance(raw, dict) or raw.get("class") not in CLASSES or not raw.get("fix"):
        raise ValueError(f"health.yaml {where}: needs a class (one of {', '.join(CLASSES)}) and a fix")
    if raw.get("source") not in sources:
        raise ValueError(f"health.yaml {where}: source {raw.get('source')!r} is not listed under sources")
    return Rule(raw["class"], str(raw.get("detail", "")), str(raw["fix"]), raw["source"])


def rules_from(doc: Any) -> HealthRules:
    sources = {str(k): str(v) for k, v in (doc.get("sources") or {}).items()}
    checks = {name: _rule(raw, f"checks.{name}", sources) for name, raw in (doc.get("checks") or {}).items()}
    xids = {int(code): _rule(raw, f"xids.{code}", sources) for code, raw in (doc.get("xids") or {}).items()}
    severities = {int(code): _rule(raw, f"dcgm_severities.{code}", sources)
                  for code, raw in (doc.get("dcgm_severities") or {}).items()}
    links: dict[str, int] = {}
    for model, raw in (doc.get("nvlink_links") or {}).items():
        if not isinstance(raw, dict) or not isinstance(raw.get("count"), int) or raw.get("source") not in sources:
            raise ValueError(f"health.yaml nvlink_links.{model}: needs an integer count and a listed source")
        links[str(model)] = raw["count"]
    return HealthRules(checks, xids, _rule(doc.get("xid_other"), "xid_other", sources), sources, severities,
                       _rule(doc.get("dcgm_other"), "dcgm_other", sources), links)


@cache
def health_rules() -> HealthRules:
    text = resources.files("gpufleet").joinpath("data/health.yaml").read_text(encoding="utf-8")
    return rules_from(yamlload.safe_load(text))


def _found(rules: HealthRules, check: str, **values: Any) -> Finding:
    rule = rules.checks[check]
    return Finding(check, rule.cls, rule.detail.format(**values), rule.fix.format(**values), rule.source)


def gpu_findings(r: GpuHealthReading, rules: HealthRules, nvlink: str = "any") -> list[Finding]:
    """What one GPU's readings say (an empty list: healthy). `nvlink`: the tier's validate_nvlink
    (required: a GPU without an active link, or with fewer links than its model has, is a finding;
    absent: links are not looked at)."""
    out: list[Finding] = []

    def add(check: str, **values: Any) -> None:
        out.append(_found(rules, check, **values))

    if r.remap_failure:
        add("row_remap_failure")
    if r.remap_pending:
        add("row_remap_pending")
    retired = (r.retired_single_bit or 0) + (r.retired_double_bit or 0)
    if retired >= RETIRED_PAGES_LIMIT:
        add("retired_pages_limit", count=retired)
    if r.retired_pending:
        add("retired_pages_pending")
    if (r.ecc_uncorrected_volatile or 0) > 0:
        add("ecc_uncorrected_volatile", count=r.ecc_uncorrected_volatile)
    elif (r.ecc_uncorrected_aggregate or 0) > 0:
        add("ecc_uncorrected_aggregate", count=r.ecc_uncorrected_aggregate)
    if r.ecc_mode == "Disabled":
        add("ecc_disabled")
    if r.hw_thermal_slowdown:
        add("hw_thermal_slowdown", temperature=r.temperature)
    if r.hw_power_brake:
        add("hw_power_brake")
    if r.hw_slowdown and not (r.hw_thermal_slowdown or r.hw_power_brake):
        add("hw_slowdown")
    if r.sw_thermal_slowdown:
        add("sw_thermal_slowdown", temperature=r.temperature)
    if r.pcie_width is not None and r.pcie_width_max and r.pcie_width < r.pcie_width_max:
        add("pcie_width_degraded", width=r.pcie_width, max=r.pcie_width_max)
    if r.pcie_gen is not None and r.pcie_gen_max and r.pcie_gen < r.pcie_gen_max:
        add("pcie_gen_below_max", gen=r.pcie_gen, max=r.pcie_gen_max)
    if r.power_limit and r.power_default_limit and r.power_limit < r.power_default_limit:
        add("power_limit_below_default", limit=f"{r.power_limit:g}", default=f"{r.power_default_limit:g}")
    if r.mig_mode and r.mig_pending and r.mig_mode != r.mig_pending:
        add("mig_change_pending", current=r.mig_mode, pending=r.mig_pending)
    if r.fabric_state and r.fabric_state not in ("Completed",):
        add("fabric_not_ready", state=r.fabric_state, status=r.fabric_status or "N/A")
    elif r.fabric_status and r.fabric_status != "Success":
        add("fabric_not_ready", state=r.fabric_state, status=r.fabric_status)
    down = [link for link, up in r.nvlinks if not up]
    if nvlink != "absent" and down:
        add("nvlink_down", links=", ".join(map(str, down)), total=len(r.nvlinks))
    elif nvlink == "required" and not r.nvlinks:
        add("nvlink_missing")
    expected = rules.nvlink_links.get(r.name)
    if nvlink == "required" and r.nvlinks and expected and len(r.nvlinks) < expected:
        add("nvlink_fewer_links", listed=len(r.nvlinks), model=r.name, expected=expected)
    action = r.recovery_action
    if action in (1, 4, 6):
        add("recovery_reset", action=RECOVERY_ACTIONS[action])
    elif action in (2, 7):
        add("recovery_reboot", action=RECOVERY_ACTIONS[action])
    elif action in (3, 5):
        add("recovery_drain", action=RECOVERY_ACTIONS[action])
    if r.pcie_replays:
        add("pcie_replays", count=r.pcie_replays)
    if r.temperature is not None and r.temperature_slowdown and r.temperature >= r.temperature_slowdown - 5:
        add("near_slowdown_temperature", temperature=r.temperature, threshold=r.temperature_slowdown)
    for code in sorted(set(r.xids)):
        rule = rules.xids.get(code, rules.xid_other)
        times = r.xids.count(code)
        out.append(Finding(f"xid_{code}", rule.cls,
                           f"XID {code} ({rule.detail or 'see NVIDIA XID catalogue'}) logged {times} time(s) since boot or the GPU's last reset",
                           rule.fix, rule.source))
    return out


def diag_findings(result: DiagResult, level: int, rules: HealthRules) -> list[Finding]:
    """What one failed DCGM diagnostic result says: a finding per DCGM error, classed by the
    severity DCGM gave it (health.yaml dcgm_severities), with DCGM's own message."""
    fallback = rules.dcgm_other or rules.xid_other
    out = []
    for w in result.warnings or [DiagWarning("")]:
        rule = fallback if w.severity is None else rules.dcgm_severities.get(w.severity, fallback)
        said = w.text.strip() or f"{result.test} {result.status}ed, with no message"
        code = "" if w.error_id is None else f", DCGM error {w.error_id}"
        out.append(Finding(f"dcgm_{result.test}", rule.cls,
                           f"DCGM diagnostic level {level}, {result.category or 'test'} {result.test}: {said} "
                           f"({rule.detail}{code})", rule.fix, rule.source))
    return out


def assess(data: GpuHealthData, rules: HealthRules | None = None, nvlink: str = "any",
           diag: DcgmDiagData | None = None) -> HostVerdict:
    """The host's verdict from its GpuHealth fact, and DCGM's diagnostic when one ran."""
    rules = rules or health_rules()
    host: list[Finding] = []
    if data.status == "no-nvidia-smi":
        host.append(_found(rules, "no_nvidia_smi"))
    elif data.status != "ok":
        host.append(_found(rules, "nvidia_smi_failed", error=data.error or "no output"))
    if data.status == "ok" and not data.kernel_log:
        host.append(_found(rules, "kernel_log_unreadable"))
    for bus, code in data.unmatched_xids:
        rule = rules.xids.get(code, rules.xid_other)
        host.append(Finding(f"xid_{code}", rule.cls, f"XID {code} on PCI {bus}, a GPU nvidia-smi does not list "
                                                    f"({rule.detail or 'see NVIDIA XID catalogue'})",
                            rule.fix, rule.source))
    by_gpu: dict[int, list[Finding]] = {}
    if diag is not None:
        known = {r.index for r in data.gpus}
        for result in diag.results:
            found = diag_findings(result, diag.level, rules)
            if result.gpu is not None and result.gpu in known:
                by_gpu.setdefault(result.gpu, []).extend(found)
            else:
                host.extend(found)
    gpus = tuple(GpuVerdict(r.index, r.bus_id, r.name, tuple(gpu_findings(r, rules, nvlink) + by_gpu.get(r.index, [])))
                 for r in data.gpus)
    return HostVerdict(gpus, tuple(host), diag.status if diag else "", diag.detail if diag else "")


def summary_line(verdict: HostVerdict) -> str:
    """One line for Slurm's health check or a log: the worst finding, with its GPU."""
    worst = verdict.actionable()
    if not worst:
        return f"ok: {len(verdict.gpus)} GPU(s) healthy" if verdict.worst == "ok" else \
            f"{verdict.worst}: {len(verdict.gpus)} GPU(s), nothing needs action"
    gpu, finding = worst[0]
    where = f"GPU {gpu.index} ({gpu.bus_id}): " if gpu else ""
    more = f" (+{len(worst) - 1} more)" if len(worst) > 1 else ""
    return f"{finding.cls}: {where}{finding.detail}{more}. Fix: {finding.fix}"


def all_findings(verdict: HostVerdict) -> Iterable[tuple[GpuVerdict | None, Finding]]:
    yield from ((None, f) for f in verdict.host_findings)
    for gpu in verdict.gpus:
        yield from ((gpu, f) for f in gpu.findings)
