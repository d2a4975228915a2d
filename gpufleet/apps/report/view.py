"""What the HTML report shows, as pure functions of report rows (report.schema.json): a status
per cell, one version per component beside the resolved one, the hosts that need attention
first, and the fleet summary on top.

Cell statuses: pass | warn | fail | skip (does not apply) | pending (a run, an upgrade or a
reboot is due) | info (no judgement, e.g. the GPUs) | none (nothing known: unreachable host).
A skip is never a pass, and an installed version that differs from the resolved one fails its
cell whatever the checks said. Rows written by an older gpufleet (without `versions` and
`resolved`) render too, from their text fields.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

CELL_STATUSES = ("fail", "warn", "pending", "pass", "skip", "info", "none")
SYMBOLS = {"pass": "✓", "warn": "!", "fail": "✗", "skip": "–", "pending": "↻", "info": "", "none": ""}
ATTENTION = ("fail", "warn", "pending", "ok")  # the order hosts are listed in
COMPONENTS = (("driver", "Driver"), ("cuda", "CUDA"), ("cudnn", "cuDNN"), ("container_toolkit", "Container toolkit"))

# (key, heading) of the HTML table, in order: what was installed, what runs on it, how it is
# tuned and locked down, then what to do (drift, problems)
COLUMNS: tuple[tuple[str, str], ...] = (
    ("host", "Host"), *COMPONENTS, ("pytorch", "PyTorch"), ("health", "GPU health"),
    ("tuning", "Persistence, clocks"), ("firewall", "Firewall"), ("ssh_hardening", "SSH"),
    ("endpoints", "Metrics"), ("kernel", "Kernel, reboot"), ("drift", "Drift (all.py)"), ("problems", "Problems"),
)

STACK_CHECK = "the CUDA toolkit and cuDNN are the resolved releases"
KERNEL_CHECK = "every installed kernel has the nvidia module"
DRIVER_CHECK = "the loaded driver = the installed driver = the resolved driver"
MISMATCH_CHECK = "no driver mismatch is pending"
# the checks that have a column of their own (gpufleet/checks/validation.py names them; a unit test
# keeps these in step)
CHECK_OF = {"firewall": "the host firewall is active", "ssh_hardening": "sshd's effective configuration is hardened",
            "health": "the GPUs are healthy (ECC, row remapper, throttling, PCIe, NVLink, XIDs)",
            "pytorch": "the host's PyTorch build runs on its GPUs and driver"}
REFUSED = "all.py refuses this host at planning time"

# A problem's label names what is wrong, as the columns do. A check's area is the deploy that
# owns it, which is not always that: the driver deploy also installs CUDA and cuDNN, so a cuDNN
# changed by hand read "driver: ..." (its label comes from the components that differ).
LABEL_OF = {KERNEL_CHECK: "kernel", CHECK_OF["firewall"]: "firewall", CHECK_OF["ssh_hardening"]: "SSH",
            CHECK_OF["health"]: "GPU health", CHECK_OF["pytorch"]: "PyTorch"}
AREA_LABELS = {"preflight": "hardware", "docker": "containers", "monitoring": "metrics", "probe": "GPU probe",
               "pytorch": "PyTorch", "health": "GPU health"}


@dataclass
class Cell:
    status: str
    text: str = ""
    note: str = ""  # a second, smaller line
    resolved: str | None = None  # the version the host's tier resolves, shown beside the installed one
    differs: bool = False  # installed (or loaded) != resolved
    compared: str = "resolved"  # what `resolved` is: the resolved version, or the planned clock pair
    details: list[str] = field(default_factory=list)  # folded away under <details>
    summary: str = ""  # the <summary> line of the details
    items: list[dict[str, str]] = field(default_factory=list)  # problems: status, what, message, fix
    alert: bool = False  # the note is a difference to see (a loaded driver that is not the installed one)

    @property
    def symbol(self) -> str:
        return SYMBOLS[self.status]


def worst(statuses: list[str], empty: str = "skip") -> str:
    """fail > warn > pending > pass > skip: one failing check fails the cell; all skipped is a skip."""
    for status in ("fail", "warn", "pending", "pass", "skip"):
        if status in statuses:
            return status
    return empty


def _checks(row: dict[str, Any]) -> list[dict[str, str]]:
    return ((row.get("validation") or {}).get("checks")) or []


def _check_line(c: dict[str, str]) -> str:
    text = f"{c['area']}: {c['name']}" + (f": {c['message']}" if c.get("message") else "")
    return text + (f" (fix: {c['fix']})" if c.get("fix") and c["status"] in ("fail", "warn") else "")


def _from_summary(text: str | None) -> Cell:
    """A check's summary as gather writes it: 'ok' | 'fail: why' | 'skip: why' | None."""
    if not text:
        return Cell("none", "-")
    status, _, message = text.partition(": ")
    status = {"ok": "pass"}.get(status, status)
    if status not in ("pass", "warn", "fail", "skip"):
        return Cell("info", text)
    return Cell(status, status, note=message)


def _said(cell: Cell) -> Cell:
    """A check's cell: its word, and its message in plain sight only when it failed or warns."""
    cell.text = {"pass": "ok"}.get(cell.status, cell.text)
    if cell.status not in ("fail", "warn") and cell.note:
        cell.details, cell.summary = [cell.note], "why" if cell.status == "skip" else "more"
        cell.note = ""
    return cell


def _check_cell(row: dict[str, Any], key: str) -> Cell:
    """The cell of a check with a column of its own; PyTorch's names the build (its version)."""
    check = next((c for c in _checks(row) if c["name"] == CHECK_OF[key]), None)
    cell = Cell(check["status"], check["status"], note=check["message"]) if check else _from_summary(row.get(key))
    message = cell.note
    cell = _said(cell)
    if key == "pytorch" and cell.status in ("pass", "warn", "fail", "skip"):
        build = re.search(r"\btorch (\d\S*)", message)
        missing = "imports no torch" in message or "no PyTorch" in message
        cell.text = build.group(1) if build else "none" if missing else cell.text
    return cell


def _component(row: dict[str, Any], key: str) -> Cell:
    versions, resolved = row.get("versions"), row.get("resolved") or {}
    if versions is None:  # an older report: its package text, unjudged
        legacy = row.get("driver_installed") if key == "driver" else row.get(key)
        return Cell("info", legacy or "-")
    installed, want = versions.get(key), resolved.get(key)
    packages = row.get("packages") or {}
    details = [f"{name} {version}" for name, version in (packages.get(key) or {}).items()]
    if key == "container_toolkit":
        details += [f"{name} {version}" for name, version in (packages.get("docker") or {}).items()]
    cell = Cell("pass", installed or "none", resolved=want, details=details,
                summary=f"{len(details)} package{'s' if len(details) != 1 else ''}" if details else "")
    checks = _checks(row)
    if key == "driver" and row.get("driver_loaded") and installed and row["driver_loaded"] != installed:
        cell.note, cell.alert = f"≠ loaded {row['driver_loaded']}", True
    if want is None:
        why = row.get("resolved_error")
        cell.status = "fail" if key == "driver" and row.get("mismatch") else "skip"
        cell.note = cell.note or ("nothing resolves" if why else
                                  "not managed by the tier" if installed else "the tier installs none")
        if why:  # the same reason on every component: folded away
            cell.details, cell.summary = [why, *cell.details], "why"
        return cell
    cell.differs = installed != want
    if installed is None:
        cell.status, cell.note = "fail", "missing"
    elif cell.differs:
        cell.status = "fail"
    if key == "driver":
        agree = next((c for c in checks if c["name"] == DRIVER_CHECK), None)
        if cell.differs and installed and agree and agree["status"] == "warn":
            # a driver behind the inventory is tools/rollout's job: the gate warns (or fails, per
            # driver_upgrade_pending); the difference stays marked
            cell.status, cell.note = "warn", cell.note or "upgrade pending: tools/rollout"
        others = [c["status"] for c in checks if c["area"] == "driver"
                  and c["name"] not in (STACK_CHECK, KERNEL_CHECK, DRIVER_CHECK)]
        cell.status = "fail" if row.get("mismatch") else worst([cell.status, *others])
    elif key == "container_toolkit":
        cell.status = worst([cell.status, *(c["status"] for c in checks if c["area"] == "docker")])
    return cell


def _cells(row: dict[str, Any]) -> dict[str, Cell]:
    """Every cell but the host's."""
    out: dict[str, Cell] = {"problems": _problems(row)}
    if row.get("status") == "unreachable":
        return {key: out.get(key, Cell("none", "")) for key, _ in COLUMNS if key != "host"}
    for key, _ in COMPONENTS:
        out[key] = _component(row, key)
    out["tuning"] = _tuning(row)
    for key in CHECK_OF:
        out[key] = _check_cell(row, key)
    out["endpoints"] = _endpoints(row.get("endpoints") or [])
    kernel_check = next((c for c in _checks(row) if c["name"] == KERNEL_CHECK), None)
    status = kernel_check["status"] if kernel_check else "info"
    if row.get("reboot_pending") and status in ("pass", "skip", "info"):
        status = "pending"
    notes = ["reboot pending"] if row.get("reboot_pending") else []
    if kernel_check and kernel_check["status"] in ("fail", "warn"):
        notes.append(kernel_check["message"])
    out["kernel"] = Cell(status, row.get("kernel") or "-", note="; ".join(notes),
                         details=[kernel_check["message"]] if kernel_check and not notes else [],
                         summary="why" if kernel_check and kernel_check["status"] == "skip" else "more")
    out["drift"] = _drift(row.get("drift"))
    return {key: out[key] for key, _ in COLUMNS if key != "host"}


def clocks_text(clocks: dict[str, Any]) -> str:
    """The clocks column in one line: 'locked 1215,1410 = planned', 'application 3201,1980 ≠
    planned 3201,1785', per group of GPUs when they differ ('... on GPU 0, 1; ...')."""
    groups: dict[tuple[Any, Any, Any], list[str]] = {}
    for g in clocks["gpus"]:
        groups.setdefault((g["applied"], g["planned"], g["at_plan"]), []).append(str(g["index"]))
    parts = []
    for (applied, planned, at_plan), indices in groups.items():
        text = applied or ("none" if clocks["method"] == "locked" else "not reported")
        if at_plan is not None:
            text += (" = planned" + (" default" if planned == "default" else "")) if at_plan else f" ≠ planned {planned}"
        parts.append(text + (f" on GPU {', '.join(indices)}" if len(groups) > 1 else ""))
    if clocks.get("refused"):
        parts[-1] += "; the tuning plan refuses this host"
    elif all(g["at_plan"] is None for g in clocks["gpus"]):
        parts[-1] += " (clock_policy: unmanaged)" if clocks.get("policy") else " (no clock plan)"
    return f"{clocks['method']} " + "; ".join(parts)


_METHOD_NOTES = {"application": "application clocks (nvidia-smi -ac), as nvidia-smi reads them",
                 "locked": "locked clocks (nvidia-smi -lgc/-lmc; application clocks are deprecated on this "
                           "driver), as gpufleet recorded them in /run/gpufleet/gpu-clocks since boot"}


def _tuning(row: dict[str, Any]) -> Cell:
    """Persistence, then the clocks gpufleet applied, labelled by method, with the planned pair
    beside them (`= planned` / `≠ planned ...`): a GPU off its plan fails the cell, as the gate."""
    tuning = [c for c in _checks(row) if c["area"] == "tuning"]
    checks = [f"{SYMBOLS[c['status']] or '-'} {_check_line(c)}" for c in tuning]
    clocks = row.get("gpu_clocks")
    persistence = f"persistence {row['persistence']}" if row.get("persistence") else ""
    if row.get("mig"):
        persistence += ("\n" if persistence else "") + f"MIG {row['mig']}"
    if row.get("profiling"):
        persistence += ("\n" if persistence else "") + f"profiling {row['profiling']}"
    if not clocks:  # no GPU answering, or an older report: the text as gathered
        parts = [persistence, f"clocks {row['clocks']}" if row.get("clocks") else ""]
        return Cell(worst([c["status"] for c in tuning], empty="info"), "\n".join(p for p in parts if p) or "-",
                    details=checks, summary=f"{len(tuning)} checks" if tuning else "")
    gpus = clocks["gpus"]
    applied = sorted({g["applied"] or ("none" if clocks["method"] == "locked" else "not reported") for g in gpus})
    managed = [g for g in gpus if g["at_plan"] is not None]
    off = [g for g in managed if not g["at_plan"]]
    planned = sorted({g["planned"] for g in (off or managed)})
    cell = Cell(worst([c["status"] for c in tuning], empty="info"),
                "\n".join(p for p in (persistence, f"{clocks['method']} clocks {' / '.join(applied)}") if p),
                resolved=" / ".join(planned) or None, differs=bool(off), compared="planned",
                details=[f"GPU {g['index']} {g['model']} ({g['bus_id']}): {clocks['method']} "
                         f"{g['applied'] or 'none'}" + (f", planned {g['planned']}" if g["planned"] else "")
                         for g in gpus] + [_METHOD_NOTES[clocks["method"]] + f" (driver {clocks.get('driver') or '?'})"]
                + checks, summary=f"{len(gpus)} GPUs, {len(tuning)} checks")
    if off:
        cell.status = "fail"
    if clocks.get("refused"):
        cell.status, cell.note = "fail", f"planning refused: {clocks['refused']}"
    elif not managed:
        cell.note = "clock_policy: unmanaged" if clocks.get("policy") else "no clock plan (the inventory fails)"
    return cell


def _endpoints(endpoints: list[dict[str, str]]) -> Cell:
    """The exporters the tier turns on (monitoring_*), each a link; judged by the gate's curl."""
    if not endpoints:
        return Cell("skip", "none", note="no exporter on")
    statuses = [e["status"] if e["status"] in CELL_STATUSES else "info" for e in endpoints]
    return Cell(worst(statuses), "\n".join(e["name"] for e in endpoints),
                items=[{"status": s, "what": e["name"], "message": e.get("message", ""), "url": e["url"]}
                       for s, e in zip(statuses, endpoints)])


def cells(row: dict[str, Any]) -> dict[str, Cell]:
    """The cells of one host's row, by column key (the host's own cell carries its attention)."""
    return {"host": Cell(attention(row)), **_cells(row)}


def _drift(drift: dict[str, Any] | None) -> Cell:
    if not drift:
        return Cell("none", "not computed")
    pending = drift.get("pending") or []
    if drift.get("changes") is None:
        return Cell("fail", "planning failed", note=(drift.get("error") or "")[:300])
    count, ops = drift["changes"], list(drift.get("operations") or [])
    if count:
        ops += [f"{op} (only if an earlier one changes)" for op in drift.get("conditional") or []]
    cell = Cell("pending" if count or pending else "pass", f"{count} change{'s' if count != 1 else ''}" if count else "in sync",
                note="; ".join(_short(p) for p in pending), details=ops, summary=f"{len(ops)} operations" if ops else "")
    if drift.get("error"):  # refused at planning time: all.py cannot bring the host to its tier
        cell.status = "fail"
        cell.note = "; ".join(p for p in (drift["error"], cell.note) if p)
    return cell


def _short(pending: str) -> str:
    """'cuDNN upgrade pending: 9.16.0.29 -> 9.17.0.29 (deploys/all.py changes ...)' without the why."""
    return pending.split(" (", 1)[0]


def problem_label(check: dict[str, str], row: dict[str, Any]) -> str:
    """What a failing or warning check is about, as the columns name it (LABEL_OF)."""
    if check["name"] == STACK_CHECK:
        versions, resolved = row.get("versions") or {}, row.get("resolved") or {}
        off = [heading for key, heading in COMPONENTS if key in ("cuda", "cudnn")
               and resolved.get(key) and versions.get(key) != resolved[key]]
        return ", ".join(off) or "CUDA, cuDNN"
    return LABEL_OF.get(check["name"]) or AREA_LABELS.get(check["area"], check["area"])


def problems(row: dict[str, Any]) -> list[dict[str, str]]:
    """The failed checks, then the warnings (inventory of checks order within each), each once:
    {status, label, name, message, fix}. A loaded driver that is not the installed one fails two
    checks saying the same; the mismatch check's line (with the reboot in its fix) stands for both
    unless the installed driver is not the resolved one either."""
    checks = _checks(row)
    failed = {c["name"] for c in checks if c["status"] == "fail"}
    versions, resolved = row.get("versions") or {}, row.get("resolved") or {}
    out: list[dict[str, str]] = []
    seen: set[tuple[str, str]] = set()
    for status in ("fail", "warn"):
        for c in checks:
            if c["status"] != status:
                continue
            if (c["name"] == DRIVER_CHECK and MISMATCH_CHECK in failed
                    and versions.get("driver") == resolved.get("driver")):
                continue
            label = problem_label(c, row)
            if (label, c.get("message") or "") in seen:
                continue
            seen.add((label, c.get("message") or ""))
            out.append({"status": status, "label": label, "name": c["name"], "message": c.get("message") or "",
                        "fix": c.get("fix") or ""})
    return out


def _problems(row: dict[str, Any]) -> Cell:
    """The failed and warning checks, worst first, labelled by what they are about, with their
    fixes; the other checks folded away (each check listed once)."""
    checks = _checks(row)
    items = [{"status": p["status"], "what": p["label"], "name": p["name"], "message": p["message"], "fix": p["fix"]}
             for p in problems(row)]
    if not checks:  # an older report, or a host whose checks never ran
        items = [{"status": "fail", "what": line, "name": "", "message": "", "fix": ""}
                 for line in (row.get("validation") or {}).get("failed") or []]
    if row.get("status") in ("unreachable", "error") and row.get("error"):
        items.insert(0, {"status": "fail", "what": row["status"], "name": "", "message": row["error"], "fix": ""})
    status = "fail" if row.get("status") in ("unreachable", "error") else worst(
        [c["status"] for c in checks] + [i["status"] for i in items], empty="none")
    counts = {s: sum(1 for c in checks if c["status"] == s) for s in ("pass", "fail", "warn", "skip")}
    summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return Cell(status, "" if items else ("none" if checks else ""), items=items,
                details=[f"{SYMBOLS.get(c['status']) or '-'} {_check_line(c)}" for c in checks
                         if c["status"] not in ("fail", "warn")],
                summary=f"all {len(checks)} checks: {summary}" if checks else "")


def attention(row: dict[str, Any]) -> str:
    """fail | warn | pending | ok: how urgently a host needs someone."""
    if row.get("status") in ("unreachable", "error") or row.get("mismatch"):
        return "fail"
    statuses = [c.status for c in _cells(row).values()]
    for level in ("fail", "warn"):
        if level in statuses:
            return level
    if "pending" in statuses or row.get("reboot_pending") or upgrades(row):
        return "pending"
    return "ok"


def upgrades(row: dict[str, Any]) -> list[str]:
    """The version changes a host is due: each component whose installed version differs from
    the resolved one, else (a row without versions) its drift's pending list. The pending list
    names packages, one line each ('libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was
    changed by hand: ...', three for one cuDNN): the components say it once."""
    versions, resolved = row.get("versions") or {}, row.get("resolved") or {}
    names = dict(COMPONENTS)
    changes = [f"{names[k]} {versions[k]} -> {resolved[k]}" for k, _ in COMPONENTS
               if versions.get(k) and resolved.get(k) and versions[k] != resolved[k]]
    return changes or [_short(p) for p in (row.get("drift") or {}).get("pending") or []]


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hosts that need attention first (fail, warn, pending, ok), inventory order within each."""
    return sorted(rows, key=lambda r: ATTENTION.index(attention(r)))


def fleet_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """How many hosts per attention level, tier, and installed driver / CUDA / cuDNN / container
    toolkit version; which hosts have upgrades or a reboot pending."""
    def count(values: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for value in values:
            out[value] = out.get(value, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))

    def version(row: dict[str, Any], key: str) -> str:
        if row.get("status") == "unreachable":
            return "unknown"
        if "versions" not in row:
            return "unknown"
        return (row["versions"] or {}).get(key) or "none"

    levels = [attention(r) for r in rows]
    return {
        "attention": {level: levels.count(level) for level in ATTENTION},
        "tiers": count([r.get("tier") or "unknown" for r in rows]),
        "versions": {key: count([version(r, key) for r in rows]) for key, _ in COMPONENTS},
        "upgrades_pending": [r["host"] for r in rows if r.get("status") != "unreachable" and upgrades(r)],
        "reboots_pending": [r["host"] for r in rows if r.get("reboot_pending")],
        # hosts whose GPU health check fails: a GPU to reset, reboot, drain or return
        "health_action": [r["host"] for r in rows
                          if any(c["name"] == CHECK_OF["health"] and c["status"] == "fail" for c in _checks(r))],
    }


def version_rows(rows: list[dict[str, Any]], key: str) -> list[tuple[str, int, int, dict[str, int]]]:
    """(installed version, hosts, of which differ from their resolved version, hosts per tier),
    most hosts first."""
    table: dict[str, tuple[list[int], dict[str, int]]] = {}
    for row in rows:
        if row.get("status") == "unreachable" or "versions" not in row:
            have, off = "unknown", 0
        else:
            have = (row.get("versions") or {}).get(key) or "none"
            want = (row.get("resolved") or {}).get(key)
            off = int(bool(want) and have != want)
        counts, tiers = table.setdefault(have, ([0, 0], {}))
        counts[0] += 1
        counts[1] += off
        tier = row.get("tier") or "unknown"
        tiers[tier] = tiers.get(tier, 0) + 1
    return sorted(((v, n, off, dict(sorted(tiers.items(), key=lambda kv: (-kv[1], kv[0]))))
                   for v, ((n, off), tiers) in table.items()), key=lambda t: (-t[1], t[0]))


def tier_rows(rows: list[dict[str, Any]]) -> list[tuple[str, int, dict[str, int]]]:
    """(tier, hosts, hosts per attention level), most hosts first."""
    table: dict[str, dict[str, int]] = {}
    for row in rows:
        levels = table.setdefault(row.get("tier") or "unknown", {level: 0 for level in ATTENTION})
        levels[attention(row)] += 1
    return sorted(((t, sum(lv.values()), lv) for t, lv in table.items()), key=lambda t: (-t[1], t[0]))
