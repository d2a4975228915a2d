"""Docker's /etc/docker/daemon.json, merged rather than overwritten (pure functions, unit-tested).

gpufleet owns a few keys of daemon.json and nothing else:

    runtimes.nvidia            {"args": [], "path": "nvidia-container-runtime"}
    default-runtime            the tier's docker_default_runtime (nvidia | runc)
    default-shm-size           docker_shm_size
    default-ulimits.<name>     one entry per docker_ulimits name (Soft = Hard = the value, -1 = unlimited)
    features.cdi               true when docker_cdi is on (left alone when it is off)

Every other key the operator set (log driver, registry mirrors, storage driver, other runtimes,
other ulimits, other features...) is kept as it is. Output is byte-stable (sorted keys, four-space
indent, trailing newline), and the file is written only when the merged document differs from the
current one *as JSON*, so an operator's own formatting survives a run that changes nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

DAEMON_JSON = "/etc/docker/daemon.json"
NVIDIA_RUNTIME = {"args": [], "path": "nvidia-container-runtime"}


class MalformedDaemonJson(ValueError):
    """The existing daemon.json is not a JSON object gpufleet can merge into."""


@dataclass(frozen=True)
class DockerDefaults:
    """The part of a host's settings that ends up in daemon.json."""

    default_runtime: str            # "nvidia" | "runc"
    cdi: bool
    shm_size: str                   # "1g"
    ulimits: Mapping[str, int]      # {"memlock": -1, "stack": 67108864}

    @classmethod
    def from_settings(cls, settings: Any) -> "DockerDefaults":
        return cls(
            default_runtime=settings.docker_default_runtime,
            cdi=settings.docker_cdi,
            shm_size=settings.docker_shm_size,
            ulimits=dict(settings.docker_ulimits),
        )


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            # dockerd itself refuses duplicate keys; merging would silently pick one.
            raise MalformedDaemonJson(f"key {key!r} appears twice")
        seen[key] = value
    return seen


def parse(raw: bytes | None) -> dict[str, Any] | None:
    """The existing file's content as a dict; None when there is no file.

    An empty (or whitespace-only) file counts as ``{}``. Anything else that is not a JSON object
    (bad syntax, a list, duplicate keys, wrongly typed gpufleet-owned sections, not UTF-8) raises
    MalformedDaemonJson with a message naming the problem and its line.
    """
    if raw is None:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedDaemonJson(f"not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        return {}
    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError as exc:
        raise MalformedDaemonJson(f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise MalformedDaemonJson(f"expected a JSON object at the top level, found {type(doc).__name__}")
    for section in ("runtimes", "default-ulimits", "features"):
        if section in doc and not isinstance(doc[section], dict):
            raise MalformedDaemonJson(f"{section!r} must be an object, found {type(doc[section]).__name__}")
    return doc


def merge(existing: Mapping[str, Any] | None, want: DockerDefaults) -> dict[str, Any]:
    """``existing`` with gpufleet's keys set to ``want``; every other key unchanged. Pure."""
    merged: dict[str, Any] = json.loads(json.dumps(dict(existing or {})))  # deep copy
    runtimes = merged.setdefault("runtimes", {})
    runtimes["nvidia"] = dict(NVIDIA_RUNTIME, args=list(NVIDIA_RUNTIME["args"]))
    merged["default-runtime"] = want.default_runtime
    merged["default-shm-size"] = want.shm_size
    ulimits = merged.setdefault("default-ulimits", {})
    for name, limit in sorted(want.ulimits.items()):
        ulimits[name] = {"Hard": limit, "Name": name, "Soft": limit}
    if want.cdi:
        merged.setdefault("features", {})["cdi"] = True
    return merged


def replaced_keys(existing: Mapping[str, Any] | None, merged: Mapping[str, Any]) -> list[str]:
    """gpufleet-owned keys where the operator had set a *different* value (to report, not hide)."""
    if not existing:
        return []
    out = []

    def walk(old: Any, new: Any, path: str) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for key in old:
                if key in new:
                    walk(old[key], new[key], f"{path}.{key}" if path else key)
        elif old != new:
            out.append(path)

    walk(dict(existing), dict(merged), "")
    return out


def render(config: Mapping[str, Any]) -> str:
    """Byte-stable text of ``config``: sorted keys, four-space indent, trailing newline."""
    return json.dumps(config, indent=4, sort_keys=True, ensure_ascii=False) + "\n"


def needs_write(existing: Mapping[str, Any] | None, merged: Mapping[str, Any]) -> bool:
    """True when there is no file, or its JSON differs from the merged document."""
    return existing is None or dict(existing) != dict(merged)
