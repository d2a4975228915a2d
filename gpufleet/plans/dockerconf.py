"""Docker's /etc/docker/daemon.json, merged rather than overwritten (pure functions, unit-tested).

gpufleet owns a few keys of daemon.json and nothing else:

    runtimes.nvidia            {"args": [], "path": "nvidia-container-runtime"}
    default-runtime            the tier's docker_default_runtime (nvidia | runc)
    default-shm-size           docker_shm_size
    default-ulimits.<name>     one entry per docker_ulimits name (Soft = Hard = the value, -1 = unlimited)
    features.cdi               true when docker_cdi is on (left alone when it is off)
    live-restore               docker_live_restore (containers keep running while dockerd restarts)
    registry-mirrors[0]        docker_registry_mirror, where the tier names one (the operator's others kept after it)

Every other key the operator set (log driver, other registry mirrors, storage driver, other runtimes,
other ulimits, other features...) is kept as it is. Output is byte-stable (sorted keys, four-space
indent, trailing newline), and the file is written only when the merged document differs from the
current one *as JSON*, so an operator's own formatting survives a run that changes nothing.

Applying a change without killing jobs: dockerd re-reads a few keys on SIGHUP (`systemctl reload
docker`, RELOADABLE below); every other key needs a restart, which stops running containers
unless live-restore is on in the *running* daemon. live-restore itself is reloadable, so
apply_plan() turns it on by a reload first, then restarts with the containers kept alive, or
leaves the restart pending where GPU containers run and the policy (docker_restart_with_gpu_containers)
does not allow it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from gpufleet.plans.package_cache import registry_mirrors

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
    live_restore: bool = True
    registry_mirror: str = "none"   # docker_registry_mirror

    @classmethod
    def from_settings(cls, settings: Any) -> DockerDefaults:
        return cls(
            default_runtime=settings.docker_default_runtime,
            cdi=settings.docker_cdi,
            shm_size=settings.docker_shm_size,
            ulimits=dict(settings.docker_ulimits),
            live_restore=settings.docker_live_restore,
            registry_mirror=settings.docker_registry_mirror,
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
    merged["live-restore"] = want.live_restore
    mirrors = registry_mirrors(merged.get("registry-mirrors"), want.registry_mirror)
    if mirrors is not None:
        merged["registry-mirrors"] = mirrors
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


# Top-level keys dockerd applies on SIGHUP (moby daemon/reload.go and reload_unix.go, Docker 20.10
# to 27: Reload + reloadPlatform). Any other changed key takes effect only at a restart.
RELOADABLE = frozenset({
    "debug", "labels", "live-restore", "max-concurrent-downloads", "max-concurrent-uploads",
    "max-download-attempts", "shutdown-timeout", "insecure-registries", "registry-mirrors",
    "allow-nondistributable-artifacts", "runtimes", "default-runtime", "default-shm-size",
    "default-ipc-mode", "default-cgroupns-mode",
})
RESTART_POLICIES = ("never", "live-restore", "always")


def changed_keys(existing: Mapping[str, Any] | None, merged: Mapping[str, Any]) -> list[str]:
    """Top-level keys whose value differs (added, changed or removed), sorted."""
    old = dict(existing or {})
    return sorted(k for k in {*old, *merged} if old.get(k, _ABSENT) != merged.get(k, _ABSENT))


_ABSENT = object()


def partial(existing: Mapping[str, Any] | None, merged: Mapping[str, Any], keys: list[str]) -> dict[str, Any]:
    """``existing`` with only ``keys`` taken from ``merged`` (the reloadable part of a change)."""
    out: dict[str, Any] = json.loads(json.dumps(dict(existing or {})))
    for key in keys:
        if key in merged:
            out[key] = json.loads(json.dumps(merged[key]))
        else:
            out.pop(key, None)
    return out


@dataclass(frozen=True)
class ApplyPlan:
    """How a daemon.json change reaches the running dockerd.

    steps: ("write-reloadable", keys) | ("reload",) | ("check-live-restore",) | ("write",) | ("restart",)
    pending: the keys left for a later restart ([] = everything applied), and why.
    """

    steps: tuple[tuple[Any, ...], ...]
    pending: tuple[str, ...] = ()
    why: str = ""


def apply_plan(existing: Mapping[str, Any] | None, merged: Mapping[str, Any], *, running: bool,
               live_restore_on: bool, gpu_containers: list[str], policy: str,
               containers: int = 0, restart_for: tuple[str, ...] = ()) -> ApplyPlan:
    """The steps that apply ``merged`` without killing GPU work (pure; unit-tested).

    - nothing to do -> no steps;
    - dockerd not running -> write (it reads the file when it starts);
    - only reloadable keys changed -> write, reload;
    - restart needed, no GPU container running -> write, restart; where other containers run
      (`containers`) and the change brings live-restore, it is turned on by a reload first, so
      they survive;
    - restart needed, GPU containers running: with policy `always`, or `live-restore` and
      live-restore on (now, or after the reload step), as above, the restart checked to happen
      with live-restore on; otherwise only the reloadable part is written and reloaded, the rest
      is pending.

    `restart_for`: reasons for a restart besides daemon.json (the container toolkit installed
    under a running dockerd, which registers `--gpus` only when it starts); they are applied or
    left pending like a restart-needing key.
    """
    if policy not in RESTART_POLICIES:
        raise ValueError(f"restart policy {policy!r}; allowed: {', '.join(RESTART_POLICIES)}")
    keys = changed_keys(existing, merged) if existing is not None else sorted(merged)
    write: tuple[tuple[Any, ...], ...] = (("write",),) if keys else ()
    if not running:
        return ApplyPlan(write)
    reload_keys = [k for k in keys if k in RELOADABLE]
    restart_keys = [k for k in keys if k not in RELOADABLE] + list(restart_for)
    if not restart_keys:
        return ApplyPlan((*write, ("reload",)) if write else ())
    live_after_reload = live_restore_on or ("live-restore" in reload_keys and merged.get("live-restore") is True)
    first: tuple[tuple[Any, ...], ...] = ()
    if not live_restore_on and live_after_reload and (containers or gpu_containers):
        first = (("write-reloadable", tuple(reload_keys)), ("reload",), ("check-live-restore",))
    if not gpu_containers or policy == "always":
        return ApplyPlan((*first, *write, ("restart",)))
    if policy == "live-restore" and live_after_reload:
        return ApplyPlan((*(first or (("check-live-restore",),)), *write, ("restart",)))
    running_text = f"{len(gpu_containers)} GPU container(s) running ({', '.join(gpu_containers[:3])}" + (
        ", ...)" if len(gpu_containers) > 3 else ")")
    why = (f"{running_text} and live-restore is off in the running dockerd "
           f"(docker_restart_with_gpu_containers: {policy})" if policy == "live-restore" else
           f"{running_text} (docker_restart_with_gpu_containers: never)")
    steps = (("write-reloadable", tuple(reload_keys)), ("reload",)) if reload_keys else ()
    return ApplyPlan(steps, tuple(restart_keys), why)
