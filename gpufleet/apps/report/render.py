"""Render report rows as a terminal table, Markdown, HTML and JSON (format: report.schema.json)."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from gpufleet.controller import controller_files
from gpufleet import rendering
from gpufleet.printable import printable

from . import view

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().with_name("report.schema.json")

# (key, heading) in table order
COLUMNS: tuple[tuple[str, str], ...] = (
    ("host", "Host"), ("state", "State"), ("tier", "Tier"), ("gpus", "GPUs"),
    ("driver", "Driver loaded / installed"), ("cuda", "CUDA"), ("cudnn", "cuDNN"),
    ("container_toolkit", "Container toolkit"), ("kernel", "Kernel"), ("held_packages", "Held packages"),
    ("reboot_pending", "Reboot pending"), ("persistence", "Persistence"), ("clocks", "Clocks"),
    ("pytorch", "PyTorch"), ("health", "GPU health"), ("firewall", "Firewall"), ("ssh_hardening", "SSH hardening"),
    ("endpoints", "Metrics endpoints"), ("drift", "Drift (all.py)"),
    ("problems", "Problems"),
)


def cell(row: dict[str, Any], key: str) -> str:
    """The text of one table cell, printable (the terminal table and the Markdown report show
    host strings: a control character is escaped, never sent to the terminal or the file)."""
    return printable(_cell(row, key))


def _cell(row: dict[str, Any], key: str) -> str:
    if row.get("status") == "unreachable" and key not in ("host", "state", "tier", "problems"):
        return ""
    value = row.get(key)
    if key == "gpus":
        gpus = row.get("gpus") or []
        return ", ".join(f"{g['model']} x {g['count']}" for g in gpus) or "none"
    if key in ("driver", "cuda", "cudnn", "container_toolkit") and "versions" in row:
        # one version per component, and the resolved one where it differs (package lists: the JSON)
        installed, want = row["versions"].get(key), (row.get("resolved") or {}).get(key)
        text = installed or "-"
        if key == "driver":
            text = f"{row.get('driver_loaded') or '-'} / {text}" + (" MISMATCH" if row.get("mismatch") else "")
        return text + (f" (resolved {want})" if want and want != installed else "")
    if key == "driver":
        loaded, installed = row.get("driver_loaded") or "-", row.get("driver_installed") or "-"
        return f"{loaded} / {installed}" + (" MISMATCH" if row.get("mismatch") else "")
    if key == "held_packages":
        return ", ".join(value or []) or "-"
    if key == "endpoints":
        return ", ".join(f"{e['name']} {e['url']}" + ("" if e["status"] == "pass" else f" ({e['status']})")
                         for e in value or []) or "-"
    if key == "reboot_pending":
        return "yes" if value else "no"
    if key == "drift":
        if not value:
            return "-"
        if value.get("changes") is None:
            return "error: " + (value.get("error") or "")[:120]
        text = f"{value['changes']} change{'s' if value['changes'] != 1 else ''}"
        text += "".join(f"; {p}" for p in value.get("pending") or [])
        return text + (f" ({value['error']})" if value.get("error") else "")
    if key == "problems":
        if row.get("status") in ("unreachable", "error"):
            return row.get("error") or ""
        if (row.get("validation") or {}).get("checks"):  # labelled by what is wrong, each once
            return "; ".join(f"{p['label']}: {p['name']}: {p['message']}" for p in view.problems(row)
                             if p["status"] == "fail") or "-"
        return "; ".join((row.get("validation") or {}).get("failed", [])) or "-"
    if key == "health":
        check = next((c for c in (row.get("validation") or {}).get("checks") or []
                      if c["name"] == view.CHECK_OF["health"]), None)
        event = health_event_text(row)
        if check is None:
            return event or "-"
        return ("ok" if check["status"] == "pass" else check["status"]) + (
            f": {check['message']}" if check["status"] != "pass" and check.get("message") else "") + (
            f"; last event {event}" if event else "")
    if value is None:
        return "-"
    return str(value)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{max(0, int(seconds))}s"


def health_event_text(row: dict[str, Any], now: float | None = None, short: bool = False) -> str:
    """The health watch's last event and its age: 'reset reset 2h ago' (its class, what it did)."""
    import time

    event = row.get("health_event")
    if not event:
        return ""
    age = _age((time.time() if now is None else now) - float(event["time"]))
    what = event["class"] if event["action"] in ("seen", event["class"]) else f"{event['class']} {event['action']}"
    return f"{what} {age}" if short else f"{what}, {age} ago"


def document(rows: list[dict[str, Any]], inventory: str, seconds: float) -> dict[str, Any]:
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "inventory": inventory,
        "seconds": round(seconds, 2),
        "summary": {"hosts": len(rows), "states": states, **view.fleet_summary(rows)},
        "columns": [{"key": k, "heading": h} for k, h in COLUMNS],
        "hosts": rows,
    }


# The compact terminal table: (key, heading, widest, narrowest) in order; Problems takes what
# the others leave of the width. What it leaves out (the loaded driver, kernel, holds, clocks,
# firewall, SSH, endpoints, the checks' wording and fixes) is in `--wide`, the Markdown, the
# HTML and the JSON.
COMPACT: tuple[tuple[str, str, int, int], ...] = (
    ("host", "Host", 28, 16), ("state", "State", 16, 8), ("tier", "Tier", 10, 5), ("gpus", "GPUs", 12, 5),
    ("driver", "Driver", 12, 10), ("cuda", "CUDA", 16, 6), ("cudnn", "cuDNN", 12, 9), ("pytorch", "PyTorch", 14, 5),
    ("health", "Health", 16, 4), ("drift", "Drift", 14, 6), ("problems", "Problems", 0, 34),
)
# the columns that give way first when the table would be wider than WIDTH
SHRINK_ORDER = ("drift", "pytorch", "gpus", "tier", "cuda", "cudnn", "driver", "state", "host")
WIDTH = 160  # the compact table's line width, at most


def compact_cell(row: dict[str, Any], key: str, cell: view.Cell | None = None) -> str:
    """One cell of the compact table: a version, marked '*' where it is not the resolved one
    (which the problem line and --wide name), a check's word, the problems as 'label: message',
    worst first."""
    if row.get("status") == "unreachable" and key not in ("host", "state", "tier", "problems"):
        return ""
    if key == "gpus":  # "4 x A100" (the model in full: --wide)
        return ", ".join(f"{g['count']} x {g['model'].removeprefix('NVIDIA ').removeprefix('Tesla ').split('-')[0]}"
                         for g in row.get("gpus") or []) or "none"
    if key in ("driver", "cuda", "cudnn") and "versions" in row:
        installed, want = row["versions"].get(key), (row.get("resolved") or {}).get(key)
        return (installed or "-") + ("*" if want and want != installed else "")
    if key == "pytorch" and cell is not None:
        return cell.text if cell.status in ("pass", "skip") else "-" if cell.status == "none" else f"{cell.status} {cell.text}"
    if key == "health" and cell is not None:
        event = health_event_text(row, short=True)
        return {"pass": "ok", "none": "-"}.get(cell.status, cell.status) + (f", {event}" if event else "")
    if key == "drift" and cell is not None:
        pending = len(view.upgrades(row)) if (row.get("drift") or {}).get("pending") else 0
        if pending:
            return f"{pending} pending" if cell.text == "in sync" else f"{cell.text} +{pending}"
        return cell.text
    if key == "problems":
        if row.get("status") in ("unreachable", "error"):
            return row.get("error") or ""
        if (row.get("validation") or {}).get("checks"):
            return " | ".join(f"{p['label']}: {p['message'] or p['name']}" for p in view.problems(row)) or "-"
    return _cell(row, key)


def terminal(doc: dict[str, Any], wide: bool = False, width: int = WIDTH) -> str:
    """The fleet table for a terminal: compact (every line at most `width` columns, the hosts
    that need attention first), or with `wide` every column in full, in inventory order."""
    if wide:
        keys, heads = [k for k, _ in COLUMNS], dict(COLUMNS)
        table = [[heads[k] for k in keys]] + [[cell(r, k) for k in keys] for r in doc["hosts"]]
        widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    else:
        keys, heads = [k for k, *_ in COMPACT], {k: h for k, h, *_ in COMPACT}
        rows = view.ordered(doc["hosts"])
        cells = [view.cells(r) for r in rows]
        texts = [[printable(compact_cell(r, k, c.get(k))) for k in keys] for r, c in zip(rows, cells)]
        natural = {k: max([len(heads[k])] + [len(t[i]) for t in texts]) for i, k in enumerate(keys)}
        size = {k: min(natural[k], widest) if widest else natural[k] for k, _, widest, _ in COMPACT}
        least = {k: narrowest for k, _, _, narrowest in COMPACT}
        gaps = 2 * (len(keys) - 1)
        for key in SHRINK_ORDER:  # give way, least needed first, down to each one's narrowest
            over = sum(size[k] for k in keys if k != "problems") + gaps + least["problems"] - width
            if over <= 0:
                break
            size[key] -= min(over, max(0, size[key] - least[key]))
        size["problems"] = min(size["problems"], width - gaps - sum(size[k] for k in keys if k != "problems"))
        widths = [size[k] for k in keys]
        table = [[heads[k] for k in keys]] + [[_clip(t, widths[i]) for i, t in enumerate(line)] for line in texts]
    out = ["  ".join(text.ljust(widths[i]) for i, text in enumerate(line)).rstrip() for line in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    states = ", ".join(f"{n} {s}" for s, n in sorted(doc["summary"]["states"].items()))
    out += ["", f"{doc['summary']['hosts']} hosts ({states}) in {doc['seconds']:.1f} s"]
    if not wide:
        out.append("*: not the resolved version (the problem names it); every column: --wide")
        # narrower than the narrowest columns allow: Problems, the last column, gives the rest
        out = [_clip(line, width) for line in out]
    return "\n".join(out)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(doc: dict[str, Any]) -> str:
    def esc(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    lines = ["# gpufleet fleet report", "",
             f"Inventory `{doc['inventory']}`, generated {doc['generated_at']}, "
             f"{doc['summary']['hosts']} hosts in {doc['seconds']:.1f} s.", "",
             "| " + " | ".join(h for _, h in COLUMNS) + " |",
             "|" + "---|" * len(COLUMNS)]
    for row in doc["hosts"]:
        lines.append("| " + " | ".join(esc(cell(row, k)) for k, _ in COLUMNS) + " |")
    lines += ["", "States: " + ", ".join(f"{s}: {n}" for s, n in sorted(doc["summary"]["states"].items())), ""]
    return "\n".join(lines)


def html_page(doc: dict[str, Any]) -> str:
    """One self-contained page: the fleet summary, then the hosts that need attention first,
    each cell with its status (gpufleet/apps/report/view.py)."""
    hosts = doc["hosts"]
    return rendering.render("report/report.html.j2",
        doc=doc, fleet={**view.fleet_summary(hosts), **doc["summary"]},  # a report from before the summary had them
        rows=[(row, view.cells(row)) for row in view.ordered(hosts)],
        columns=view.COLUMNS, components=view.COMPONENTS, component_keys=[k for k, _ in view.COMPONENTS],
        symbols=view.SYMBOLS, tiers=view.tier_rows(hosts),
        versions={key: view.version_rows(hosts, key) for key, _ in view.COMPONENTS},
        upgrades={row["host"]: view.upgrades(row) for row in hosts},
        attention_labels=(("fail", "failing"), ("warn", "warnings"), ("pending", "pending"), ("ok", "ok")))


def write_all(doc: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    controller_files.ensure_dir(out_dir, tighten=False)  # the operator's --out: created 0700, an existing one left as it is
    paths = {"json": out_dir / "fleet-report.json", "md": out_dir / "fleet-report.md",
             "html": out_dir / "fleet-report.html"}
    controller_files.write(paths["json"], json.dumps(doc, indent=2, sort_keys=False) + "\n", tighten=False)
    controller_files.write(paths["md"], markdown(doc), tighten=False)
    controller_files.write(paths["html"], html_page(doc), tighten=False)
    return paths
