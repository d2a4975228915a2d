"""Render report rows as a terminal table, Markdown, HTML and JSON (format: report.schema.json)."""
from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any

from gpufleet import controller_files, rendering
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
    ("pytorch", "PyTorch"), ("firewall", "Firewall"), ("ssh_hardening", "SSH hardening"),
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
        return "; ".join((row.get("validation") or {}).get("failed", [])) or "-"
    if value is None:
        return "-"
    return str(value)


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


def terminal(doc: dict[str, Any], width: int = 40) -> str:
    keys = [k for k, _ in COLUMNS]
    heads = dict(COLUMNS)
    table = [[heads[k] for k in keys]] + [[_clip(cell(r, k), width) for k in keys] for r in doc["hosts"]]
    widths = [max(len(line[i]) for line in table) for i in range(len(keys))]
    out = ["  ".join(text.ljust(widths[i]) for i, text in enumerate(line)).rstrip() for line in table]
    out.insert(1, "  ".join("-" * w for w in widths))
    states = ", ".join(f"{n} {s}" for s, n in sorted(doc["summary"]["states"].items()))
    out.append(f"\n{doc['summary']['hosts']} hosts ({states}) in {doc['seconds']:.1f} s")
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
