"""The node's own health watch (issue 45): what deploys/health_watch.py installs, and the pure rules
the node applies each run (gpufleet/apps/health_node.py runs them there, without the controller).

Each run reads the GPUs as tools/health does (the GpuHealth fact's command, the same classes and
fixes: gpufleet/plans/health.py), judges a GPU's XIDs since its last reset (the watch records
each reset it makes, with the kernel clock the XID lines are stamped with), escalates a repeat
(the Nth reset of one GPU, or reboot of the node, within a window: the tier's
health_escalate_*), then acts as health_action allows:

- report-only: the journal and the metrics, nothing else;
- drain-only: also drains the node's Slurm node at class drain or worse ("gpufleet health: ..."),
  and resumes it once healthy, only when gpufleet health drained it (an admin's drain is kept);
- remediate: also resets a GPU of class reset while that GPU is idle (the project's one per-GPU
  idle test, operations/drain.py GPU_WORK_ON, run right before `nvidia-smi -r -i N` in the same
  command), drains the node instead while it is busy (the reset waits for the next run), and
  asks Slurm to reboot a node of class reboot (`scontrol reboot ASAP nextstate=RESUME`); without
  Slurm a reboot is only reported.

Nothing acts while a gpufleet run holds the host's lock (tools/rollout, all.py). Pure: settings,
readings and journal in; texts and decisions out.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from gpufleet.facts.health import WATCH_DIR, WATCH_JOURNAL
from gpufleet.facts.network import IbPortCounters
from gpufleet.facts.slurm import SlurmNodeData
from gpufleet.plans.health import CLASSES, Finding, GpuVerdict, HealthRules, HostVerdict, rank

if TYPE_CHECKING:  # the node's zip carries this module without the settings machinery
    from gpufleet.config.settings import Settings

#: root's folder (0700): the journal (append-only, 0600), the reset record, the last event, config
JOURNAL = WATCH_JOURNAL
RESETS = f"{WATCH_DIR}/resets"
LAST_EVENT = f"{WATCH_DIR}/last-event"
STATE = f"{WATCH_DIR}/state.json"
CONFIG = f"{WATCH_DIR}/config.json"
RUN_LOCK = f"{WATCH_DIR}/run.lock"
#: gpufleet's own code for the node (a zip of the modules it needs) and the command that runs it
BUNDLE_DIR = "/usr/local/lib/gpufleet-health"
BUNDLE = f"{BUNDLE_DIR}/gpufleet-health.pyz"
COMMAND = "/usr/local/sbin/gpufleet-health-watch"
SERVICE = "gpufleet-health-watch.service"
TIMER = "gpufleet-health-watch.timer"
UNIT_DIR = "/etc/systemd/system"
METRICS_FILE = "gpufleet_health.prom"
SLURM_CONF = "/etc/slurm/slurm.conf"
#: the host lock of deploys/all.py and tools/rollout (gpufleet/controller/hostlock.py)
HOST_LOCK = "/run/gpufleet-lock/host.lock"
#: the reason the watch drains with; it resumes only nodes whose reason starts so (as tools/health)
SLURM_REASON = "gpufleet health: "
MODES = ("report-only", "drain-only", "remediate")


@dataclass(frozen=True)
class WatchPlan:
    enabled: bool
    interval: int
    action: str
    escalate_count: int
    escalate_window: int
    escalate_to: str
    slurm_check: bool
    slurm_interval: int
    slurm_node_states: tuple[str, ...]
    slurm_prolog: bool
    dcgm_watches: bool
    textfile_dir: str
    nvlink: str
    slurm_node: str

    def node_config(self) -> str:
        """The node's config.json: what the checker needs of the tier (nothing secret)."""
        keys = ("action", "escalate_count", "escalate_window", "escalate_to", "dcgm_watches", "textfile_dir",
                "nvlink", "slurm_node", "interval")
        return json.dumps({k: getattr(self, k) for k in keys}, indent=1, sort_keys=True) + "\n"


def watch_plan(settings: Settings) -> WatchPlan:
    return WatchPlan(
        enabled=settings.health_watch, interval=settings.health_interval, action=settings.health_action,
        escalate_count=settings.health_escalate_count, escalate_window=settings.health_escalate_window,
        escalate_to=settings.health_escalate_to, slurm_check=settings.health_slurm_check,
        slurm_interval=settings.health_slurm_interval, slurm_node_states=tuple(settings.health_slurm_node_states),
        slurm_prolog=settings.health_slurm_prolog, dcgm_watches=settings.health_dcgm_watches,
        textfile_dir=settings.health_textfile_dir, nvlink=settings.validate_nvlink,
        slurm_node=settings.rollout_slurm_node_name)


def wrapper() -> str:
    """/usr/local/sbin/gpufleet-health-watch: the system's python3, isolated (no user site, no
    PYTHON* variables), on gpufleet's own zip."""
    return ("#!/bin/sh\n# Managed by gpufleet (deploys/health_watch.py): the node's health watch.\n"
            # slurmd runs its health check and prolog with a bare environment: the tools by their usual paths
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nexport PATH\n"
            f'exec /usr/bin/python3 -I {BUNDLE} "$@"\n')


def service_unit() -> str:
    return ("# Managed by gpufleet (deploys/health_watch.py). Do not edit: changes are reverted.\n"
            "[Unit]\nDescription=gpufleet health watch: check the GPUs, record and act (docs/health.md)\n"
            "After=nvidia-persistenced.service\n\n"
            "[Service]\nType=oneshot\n"
            f"ExecStart={COMMAND} --timer\n"
            # exit 1 means "a finding needs action", which the journal holds: not a failed unit
            "SuccessExitStatus=1\n")


def timer_unit(plan: WatchPlan) -> str:
    return ("# Managed by gpufleet (deploys/health_watch.py). Do not edit: changes are reverted.\n"
            f"# health_interval: {plan.interval} s\n"
            "[Unit]\nDescription=gpufleet health watch, every health_interval\n\n"
            f"[Timer]\nOnActiveSec={plan.interval}\nOnUnitActiveSec={plan.interval}\nAccuracySec=1s\n\n"
            "[Install]\nWantedBy=timers.target\n")


def slurm_lines(plan: WatchPlan) -> dict[str, str | None]:
    """slurm.conf key -> its line on the node (None: the watch's line, if there, is removed):
    Slurm's own health check and, where asked, the prolog."""
    states = ",".join(s.upper() for s in plan.slurm_node_states)
    check = plan.enabled and plan.slurm_check
    return {
        "HealthCheckProgram": f"HealthCheckProgram={COMMAND}" if check else None,
        "HealthCheckInterval": f"HealthCheckInterval={plan.slurm_interval}" if check else None,
        "HealthCheckNodeState": f"HealthCheckNodeState={states}" if check else None,
        "Prolog": f"Prolog={COMMAND}" if plan.enabled and plan.slurm_prolog else None,
    }


def reset_script(gpu_work_on: str) -> str:
    """`sh -c SCRIPT gpufleet-health-reset INDEX`: the one per-GPU idle test, then the reset, in
    one command (a job that starts after the check sees the reset refused by the driver, never a
    job killed by a decision made earlier). Exit 75 and a BUSY line while the GPU is in use."""
    return (gpu_work_on.strip() + "\n"
            'case $1 in *[!0-9]*|"") echo "not a GPU index: $1" >&2; exit 2;; esac\n'
            'what=$(gpu_work "$1")\n'
            'if [ -n "$what" ]; then echo "BUSY: $what" | tr "\\n" " " >&2; echo >&2; exit 75; fi\n'
            'exec nvidia-smi -r -i "$1"\n')


# ---------------------------------------------------------------------------------------------
# The journal and what the node decides each run
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One line of the journal: what was seen, when, its class, what was done and why."""
    time: float                # unix time
    boot: str                  # /proc/sys/kernel/random/boot_id
    gpu: int | None            # None: the node, not one GPU
    bus_id: str
    check: str
    cls: str
    action: str                # seen | cleared | reset | drain | reboot | resume | busy | held | failed | kept
    reason: str
    detail: str = ""

    def as_json(self) -> str:
        return json.dumps({"time": round(self.time, 3), "boot": self.boot, "gpu": self.gpu, "bus_id": self.bus_id,
                           "check": self.check, "class": self.cls, "action": self.action, "reason": self.reason,
                           "detail": self.detail}, sort_keys=True)


def parse_journal(lines: Iterable[str]) -> list[Event]:
    """The journal's events, oldest first; a line that is not one (cut short by a crash) is skipped."""
    out = []
    for line in lines:
        try:
            raw = json.loads(line)
            out.append(Event(float(raw["time"]), str(raw["boot"]), raw["gpu"] if isinstance(raw["gpu"], int) else None,
                             str(raw["bus_id"]), str(raw["check"]), str(raw["class"]), str(raw["action"]),
                             str(raw["reason"]), str(raw.get("detail", ""))))
        except (ValueError, KeyError, TypeError):
            continue
    return out


@dataclass(frozen=True)
class Need:
    """One finding that needs action (class reset or worse), after escalation."""
    gpu: GpuVerdict | None
    check: str
    cls: str
    detail: str

    @property
    def bus_id(self) -> str:
        return self.gpu.bus_id if self.gpu else ""


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


#: the counter that says the link went down and came back (a flap); the others count link errors
IB_FLAP = "link_downed"


def with_ib(verdict: HostVerdict, ports: list[IbPortCounters] | None, before: dict[str, Any],
            rules: HealthRules) -> tuple[HostVerdict, dict[str, Any]]:
    """The verdict with the InfiniBand/RoCE ports' news since the last run folded in (health.yaml
    ib_*: a port in use that is down or gone, a flap, grown error counters), and what the next run
    compares with. A port is in use once seen ACTIVE/LinkUp: one never cabled is no finding.
    Counters first seen are history, not news; counters cleared by hand (`perfquery -R`) start
    again. `ports` None: they could not be read this run (nothing judged, the memory kept)."""
    if ports is None:
        return verdict, before
    found: list[Finding] = []
    memory: dict[str, Any] = {}

    def add(check: str, key: str, **values: Any) -> None:
        rule = rules.checks[check]
        found.append(Finding(f"{check}:{key}", rule.cls, rule.detail.format(**values), rule.fix, rule.source))

    for port in ports:
        key, name = f"{port.device}/{port.port}", f"{port.device} port {port.port}"
        remembered = before.get(key)
        old: dict[str, Any] = remembered if isinstance(remembered, dict) else {}
        up = port.state == "ACTIVE" and port.phys_state == "LinkUp"
        in_use = up or bool(old.get("in_use"))
        memory[key] = {"in_use": in_use, "counters": dict(port.counters)}
        if in_use and not up:
            add("ib_port_down", key, port=name, state=f"{port.state or '?'}/{port.phys_state or '?'}")
        was = {k: v for k, v in (old.get("counters") or {}).items() if isinstance(v, int)}
        now = port.counters
        if IB_FLAP in was and now.get(IB_FLAP, 0) > was[IB_FLAP]:
            add("ib_link_flapped", key, port=name, was=was[IB_FLAP], now=now[IB_FLAP])
        grown = [f"{k} {was[k]} -> {v}" for k, v in sorted(now.items()) if k != IB_FLAP and k in was and v > was[k]]
        if grown:
            add("ib_link_errors", key, port=name, counters=", ".join(grown))
    for key, old in sorted(before.items()):
        if key not in memory and isinstance(old, dict) and old.get("in_use"):
            # the HCA itself is gone (fell off the bus, driver unloaded): remembered until it is back
            add("ib_port_down", key, port=key.replace("/", " port "), state="gone from /sys/class/infiniband")
            memory[key] = old
    return replace(verdict, host_findings=verdict.host_findings + tuple(found)), memory


def escalated(verdict: HostVerdict, journal: list[Event], now: float, plan: WatchPlan) -> list[Need]:
    """The verdict's findings of class reset or worse, each escalated when it repeats: the Nth
    reset of one GPU (resets the watch made, by bus id) or reboot of the node (reboots it asked
    for) within escalate_window seconds becomes escalate_to (the tier's health_escalate_*)."""
    since = now - plan.escalate_window
    out = []
    for gpu, finding in verdict.actionable():
        need = Need(gpu, finding.check, finding.cls, finding.detail)
        if finding.cls in ("reset", "reboot"):
            done = [e for e in journal if e.time >= since and e.action == finding.cls
                    and (finding.cls == "reboot" or (gpu is not None and e.bus_id == gpu.bus_id))]
            if len(done) + 1 >= plan.escalate_count:
                what = "reset of this GPU" if finding.cls == "reset" else "reboot of the node"
                need = replace(need, cls=plan.escalate_to, detail=(
                    f"{finding.detail}; the {_ordinal(len(done) + 1)} {what} within {plan.escalate_window} s "
                    f"(health_escalate_count {plan.escalate_count}): escalated to {plan.escalate_to}"))
        out.append(need)
    return sorted(out, key=lambda n: -rank(n.cls))


def worst(needs: list[Need]) -> str:
    return max((n.cls for n in needs), key=rank, default="ok")


@dataclass(frozen=True)
class Step:
    """What the node does this run: reset GPU N, drain / resume / reboot the Slurm node, or
    nothing (kind "none": `why` says why, for the journal)."""
    kind: str              # reset | drain | resume | reboot | none
    gpu: int | None = None
    why: str = ""


def reason_of(needs: list[Need]) -> str:
    """Slurm's Reason: the worst need, its GPU, and how many more (Slurm keeps it short)."""
    first = needs[0]
    where = f"GPU {first.gpu.index} ({first.gpu.bus_id}) " if first.gpu else ""
    more = f" (+{len(needs) - 1} more)" if len(needs) > 1 else ""
    return (SLURM_REASON + f"{first.cls}: {where}{first.detail}{more}")[:250]


def plan_steps(needs: list[Need], mode: str, node: SlurmNodeData | None, held_by_run: bool) -> list[Step]:
    """The steps this run takes, before the idle test (a reset step is re-decided by it on the
    node: a busy GPU is not reset, the node is drained instead). `node`: the Slurm node (None or
    without scontrol: not a Slurm node)."""
    if held_by_run:
        return [Step("none", why="a gpufleet run (all.py, tools/rollout) holds the host: nothing acts")] if needs else []
    if mode == "report-only":
        return [Step("none", why="health_action report-only")] if needs else []
    slurm = node is not None and bool(node.scontrol) and not node.error
    ours = slurm and node is not None and node.drain_set and node.reason.startswith(SLURM_REASON)
    admin = slurm and node is not None and node.drain_set and not ours
    steps: list[Step] = []
    top = worst(needs)
    if not needs:
        return [Step("resume", why="healthy again")] if ours else []
    if rank(top) >= rank("drain"):
        if admin:
            return [Step("none", why="drained by an admin: kept as it is")]
        return [] if ours else ([Step("drain")] if slurm else [Step("none", why="not a Slurm node: reported")])
    if mode == "drain-only":
        return [Step("none", why="health_action drain-only: a reset or reboot is left to people")]
    if top == "reboot":
        if not slurm:
            return [Step("none", why="not a Slurm node: the reboot is reported, not made")]
        if admin:
            return [Step("none", why="drained by an admin: kept as it is")]
        if node is not None and "REBOOT" in (node.state or "").upper():
            return [Step("none", why="Slurm has its reboot already")]
        return [Step("reboot")]
    steps = [Step("reset", gpu=n.gpu.index) for n in needs if n.cls == "reset" and n.gpu is not None]
    if not steps:  # a reset need of no listed GPU: nothing to reset it with
        return [Step("none", why="no GPU to reset: reported")]
    return steps


def metrics(verdict: HostVerdict, needs: list[Need], journal: list[Event], now: float, ok: bool) -> str:
    """The node exporter's textfile: each finding's class per GPU (0 ok .. 5 rma, CLASSES' order;
    a healthy GPU one series with finding=""), the run's time, and the journal's events by class."""
    def label(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")

    escalated_cls = {(n.bus_id, n.check): n.cls for n in needs}
    lines = ["# HELP gpufleet_gpu_health_class The class of a GPU's finding: 0 ok, 1 monitor, 2 reset, 3 reboot, "
             "4 drain, 5 rma (gpufleet health watch).",
             "# TYPE gpufleet_gpu_health_class gauge"]
    for gpu in verdict.gpus:
        found = [(f.check, escalated_cls.get((gpu.bus_id, f.check), f.cls)) for f in gpu.findings] or [("", "ok")]
        for check, cls in found:
            lines.append(f'gpufleet_gpu_health_class{{gpu="{gpu.index}",bus_id="{label(gpu.bus_id)}",'
                         f'finding="{label(check)}",class="{cls}"}} {rank(cls)}')
    for finding in verdict.host_findings:
        cls = escalated_cls.get(("", finding.check), finding.cls)
        lines.append(f'gpufleet_gpu_health_class{{gpu="",bus_id="",finding="{label(finding.check)}",'
                     f'class="{cls}"}} {rank(cls)}')
    top = max([worst(needs), verdict.worst], key=rank)
    lines += ["# HELP gpufleet_health_worst_class The node's worst class this run (0 ok .. 5 rma).",
              "# TYPE gpufleet_health_worst_class gauge", f"gpufleet_health_worst_class {rank(top)}",
              "# HELP gpufleet_health_last_run_timestamp_seconds When the watch last ran.",
              "# TYPE gpufleet_health_last_run_timestamp_seconds gauge",
              f"gpufleet_health_last_run_timestamp_seconds {now:.3f}",
              "# HELP gpufleet_health_last_run_success Whether the last run read the GPUs.",
              "# TYPE gpufleet_health_last_run_success gauge", f"gpufleet_health_last_run_success {int(ok)}",
              "# HELP gpufleet_health_events_total Journal events by class.",
              "# TYPE gpufleet_health_events_total counter"]
    counts = {cls: 0 for cls in CLASSES}
    for event in journal:
        if event.cls in counts:
            counts[event.cls] += 1
    lines += [f'gpufleet_health_events_total{{class="{cls}"}} {n}' for cls, n in counts.items()]
    return "\n".join(lines) + "\n"


def parse_dcgm_health(text: str) -> list[tuple[str, str, str, str, str]]:
    """(entity group, entity id, system, health, message) of each incident `dcgmi health -c -j`
    reports (dcgmi/Health.cpp: body -> "GPU" -> children -> id -> children -> "Errors" -> children
    -> system -> value "Warning" | "Failure", its message in "overflow"). Not JSON: none."""
    try:
        body = json.loads(text).get("body") or {}
    except (ValueError, AttributeError):
        return []
    out = []
    for group, node in body.items():
        if group == "Overall Health" or not isinstance(node, dict):
            continue
        for eid, entity in (node.get("children") or {}).items():
            errors = (((entity or {}).get("children") or {}).get("Errors") or {}).get("children") or {}
            for system, found in errors.items():
                if isinstance(found, dict) and found.get("value") in ("Warning", "Failure"):
                    message = " ".join(str(x) for x in found.get("overflow") or []).strip()
                    out.append((str(group), str(eid), str(system), str(found["value"]), message))
    return out


def with_dcgm(verdict: HostVerdict, incidents: list[tuple[str, str, str, str, str]], rules: HealthRules) -> HostVerdict:
    """The verdict with DCGM's health watch incidents folded in, in the same classes (health.yaml
    dcgm_health_warning / dcgm_health_failure): a GPU's on that GPU (DCGM's GPU id is its index),
    the rest (an NVSwitch's) on the host."""
    by_gpu: dict[int, list[Finding]] = {}
    host: list[Finding] = []
    for group, eid, system, health, message in incidents:
        rule = rules.checks["dcgm_health_failure" if health == "Failure" else "dcgm_health_warning"]
        detail = rule.detail.format(system=system, message=message or "no message")
        check = "dcgm_" + "".join(c if c.isalnum() else "_" for c in system.lower()).strip("_")
        finding = Finding(check, rule.cls, detail if group == "GPU" else f"{group} {eid}: {detail}", rule.fix, rule.source)
        if group == "GPU" and eid.isdigit():
            by_gpu.setdefault(int(eid), []).append(finding)
        else:
            host.append(finding)
    gpus = tuple(replace(g, findings=g.findings + tuple(by_gpu.get(g.index, []))) for g in verdict.gpus)
    return replace(verdict, gpus=gpus, host_findings=verdict.host_findings + tuple(host))
