"""Gather one report row per inventory host, in parallel, through pyinfra's own API.

The inventory file is loaded exactly as the pyinfra CLI loads it (pyinfra_cli.inventory), every
host is connected in its own greenlet (up to --workers at once), and its facts are read as soon
as it is connected, so a slow or dead host never holds up the others. A host that cannot be
reached becomes a row with status "unreachable" and the connection error; a host whose facts
fail becomes "error" with the exception. No host is ever left out.

Drift (what deploys/all.py would change) is computed the way `pyinfra INV deploys/all.py --dry`
computes it, in the same process and over the same connections: all.py is planned for each
reachable host (planning only reads facts), and the operations that would change something are
counted and named per host. A host whose planning fails gets the error instead.
"""
from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import gpufleet.deploys

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings
    from gpufleet.controller.inventory_source import InventorySource

# The folder that holds deploys/: the top of a checkout, the gpufleet package of an installed
# wheel (pyproject.toml's package-dir), so deploy paths such as "deploys/all.py" are found in both.
PACKAGE = gpufleet.deploys.FOLDER.parent


@dataclass
class Progress:
    """Prints "[done/total] host: status (seconds)" lines to stderr as hosts finish."""

    total: int
    stream: Any = sys.stderr
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    def __call__(self, name: str, status: str, seconds: float) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {name}: {status} ({seconds:.1f} s)", file=self.stream, flush=True)


def _versions(pkgs: dict[str, str | None], prefixes: tuple[str, ...]) -> str | None:
    found = sorted({f"{name} {version}" for name, version in pkgs.items()
                    if version and name.startswith(prefixes)})
    return ", ".join(found) or None


COMPONENTS = ("driver", "cuda", "cudnn", "container_toolkit")
# the packages a component's one version is read from when nothing resolves for the host
_MAIN_PACKAGE = {"cuda": re.compile(r"cuda-toolkit-\d+-\d+"), "cudnn": re.compile(r"(lib)?cudnn\d+(-cuda-\d+)?"),
                 "container_toolkit": re.compile(r"nvidia-container-toolkit")}
_DETAIL_PREFIXES = {"driver": ("cuda-drivers", "nvidia-fabricmanager"), "cuda": ("cuda-toolkit",),
                    "cudnn": ("libcudnn", "cudnn"), "container_toolkit": ("nvidia-container-toolkit",),
                    "docker": ("docker-ce", "docker.io")}


def component_versions(pkgs: dict[str, str | None], driver_installed: str | None, res: Any | None,
                       toolkit_version: str | None) -> tuple[dict[str, str | None], dict[str, str | None],
                                                             dict[str, dict[str, str]]]:
    """(installed, resolved, packages): one installed version per component, the version the
    host's resolution wants (None: nothing to install, or nothing resolves), and the packages
    behind each (for the details). CUDA and cuDNN are compared as upstream releases (13.0.2,
    9.17.0.29), the container toolkit as the Debian version it is pinned to (1.18.0-1)."""
    from gpufleet.versions import upstream_of

    driver_names = {*res.driver_packages, *([res.pinning_package] if res.pinning_package else [])} if res else set()
    packages = {c: {n: v for n, v in sorted(pkgs.items())
                    if v and (n.startswith(prefixes) or (c == "driver" and n in driver_names))}
                for c, prefixes in _DETAIL_PREFIXES.items()}
    wanted = {"cuda": [res.cuda_package] if res is not None and res.cuda_release and res.cuda_package else [],
              "cudnn": list(res.cudnn_packages[:1]) if res is not None and res.cudnn_release else []}
    installed: dict[str, str | None] = {"driver": driver_installed}
    for comp in ("cuda", "cudnn", "container_toolkit"):
        names = [n for n in wanted.get(comp, []) if pkgs.get(n)] or [
            n for n in packages[comp] if _MAIN_PACKAGE[comp].fullmatch(n)]
        found = sorted({v if comp == "container_toolkit" else upstream_of(v) for n in names if (v := pkgs[n])})
        installed[comp] = " + ".join(found) or None
    resolved: dict[str, str | None] = {
        "driver": res.driver_version if res is not None else None,
        "cuda": res.cuda_release if res is not None and res.cuda_package else None,
        "cudnn": res.cudnn_release if res is not None else None,
        "container_toolkit": toolkit_version if res is not None else None,
    }
    return installed, resolved, packages


REPORT_PACKAGES = ("cuda-toolkit-*", "cuda-drivers*", "libcudnn*", "cudnn*", "nvidia-container-toolkit",
                   "docker-ce", "docker.io", "nvidia-fabricmanager*")


def host_row(host: Any, probe: bool = False) -> dict[str, Any]:
    """Facts and validation results of one connected host, as a report row (see the schema)."""
    from gpufleet.errors import Incompatible
    from gpufleet.facts.packages import HeldPackages, PackageVersions
    from gpufleet.config.settings import host_settings
    from gpufleet.checks.validation import Context, fresh_host_facts, run_checks

    from .view import clocks_text

    row: dict[str, Any] = {"status": "ok"}
    try:
        settings = host_settings(host)
    except Exception as error:  # InventoryError: report it, with the facts we can still read
        settings = None
        row["status"] = "error"
        row["error"] = str(error)
    with fresh_host_facts(host):
        ctx = Context(host, settings)
        gpu, drv = ctx.gpu, ctx.driver
        res, refused = None, None
        if settings is not None:
            try:
                res = ctx.resolution()  # the validation checks ask the same facts (answered from memory)
            except Incompatible as error:
                refused = error.reason
            except Exception as error:  # noqa: BLE001 - the checks report it too; the row stays
                refused = f"{type(error).__name__}: {error}"
        driver_packages = sorted({*res.driver_packages, *([res.pinning_package] if res.pinning_package else [])}
                                 - set(REPORT_PACKAGES)) if res is not None else []
        pkgs = host.get_fact(PackageVersions, packages=[*REPORT_PACKAGES, *driver_packages])
        held = host.get_fact(HeldPackages)
        # the same facts (answered from memory) as the gate's clock check
        clocks = clock_column(host, settings, gpu.driver_version) if gpu.ok and gpu.gpus else None
    row["tier"] = settings.tier if settings else (host.data.get("tier") or None)
    models: dict[str, int] = {}
    for g in gpu.gpus:
        models[g.name] = models.get(g.name, 0) + 1
    row["gpus"] = [{"model": m, "count": c} for m, c in models.items()]
    row["gpu_status"] = gpu.status
    row["driver_loaded"] = drv.module_version
    row["driver_installed"] = drv.userspace_version
    row["mismatch"] = bool(drv.mismatch or gpu.status == "mismatch")
    row["versions"], row["resolved"], row["packages"] = component_versions(
        pkgs, drv.userspace_version, res, settings.docker_toolkit_version if settings else None)
    if refused:
        row["resolved_error"] = refused
    row["cuda"] = _versions(pkgs, ("cuda-toolkit",))
    row["cudnn"] = _versions(pkgs, ("libcudnn", "cudnn"))
    row["container_toolkit"] = _versions(pkgs, ("nvidia-container-toolkit",))
    row["kernel"] = drv.kernel_release
    row["held_packages"] = list(held)
    row["reboot_pending"] = bool(drv.reboot_pending)
    if gpu.ok and gpu.gpus:
        off = [str(g.index) for g in gpu.gpus if g.persistence is not True]
        row["persistence"] = f"off on GPU {', '.join(off)}" if off else "on"
    else:
        row["persistence"] = None
    row["gpu_clocks"] = clocks
    row["clocks"] = clocks_text(clocks) if clocks else None

    # the PyTorch build is read even without --probe: importing torch loads no GPU
    results = run_checks(host, settings, probe=probe, torch_probe=True) if settings else []
    _check_columns(row, host, settings, results)
    row["state"] = classify(row, results)
    return row


def _check_columns(row: dict[str, Any], host: Any, settings: Settings | None, results: list[Any]) -> None:
    """The row's columns that show the gate's results (firewall, sshd, marker, MIG, profiling,
    endpoints, PyTorch) and its counts."""
    from gpufleet.checks.validation import FAIL, PYTORCH_CHECK

    from .view import problem_label

    by_name = {r.name: r for r in results}

    def summary(name: str) -> str | None:
        r = by_name.get(name)
        if r is None:
            return None
        return ("ok" if r.status == "pass" else r.status) + (
            f": {r.message}" if r.status != "pass" and r.message else "")

    row["firewall"] = summary("the host firewall is active")
    row["ssh_hardening"] = summary("sshd's effective configuration is hardened")
    row["marker"] = summary("the gpufleet marker matches the tier")
    mig = by_name.get("MIG partitions are what gpu_mig sets")
    row["mig"] = None  # quiet where MIG is off as set, or does not apply
    if mig is not None and mig.status != "skip" and not (
            mig.status == "pass" and mig.message.startswith(("no GPU", "MIG off"))):
        row["mig"] = f"{'ok' if mig.status == 'pass' else mig.status}: {mig.message}"
    # the gate's profiling check (gpufleet/plans/profiling.py's plan): quiet where admins only is as set
    profiling = by_name.get("GPU performance counters are for whom tuning_profiling says")
    row["profiling"] = None
    if profiling is not None and profiling.status != "skip" and not (
            profiling.status == "pass" and settings is not None and settings.tuning_profiling == "admins"):
        row["profiling"] = f"{'ok' if profiling.status == 'pass' else profiling.status}: {profiling.message}"
    row["endpoints"] = endpoints(host, settings, by_name) if settings else []
    torch = by_name.get(PYTORCH_CHECK)
    row["pytorch"] = f"{'ok' if torch.status == 'pass' else torch.status}: {torch.message}" if torch else None
    row["validation"] = {
        # "unmanaged" is always 0 now (no deploy is a placeholder); kept: schema_version 1 requires it
        "counts": {s: sum(1 for r in results if r.status == s) for s in ("pass", "fail", "warn", "skip", "unmanaged")},
        # labelled by what is wrong, as the report's columns (a cuDNN changed by hand: "cuDNN: ...")
        "failed": [f"{problem_label(r.to_json(), row)}: {r.name}: {r.message}" for r in results if r.status == FAIL],
        "checks": [r.to_json() for r in results],
    }


def clock_column(host: Any, settings: Settings | None, driver: str | None) -> dict[str, Any] | None:
    """The clocks gpufleet applied on each GPU (application or locked clocks, whichever the
    host's driver uses) beside the pair the tuning plan wants: the plan the deploy applies, the
    plan view shows and the gate checks (gpufleet.plans.tuning). No settings: the applied pairs only."""
    from gpufleet.plans.tuning import METHOD_NAMES, host_applied_clocks, policy_text

    from gpufleet.config.failures import Refused
    from gpufleet.plans.tuning import host_mig, mig_clock_skip

    policy = settings.clock_policy if settings is not None else "unmanaged"
    skip: frozenset[str] = frozenset()
    if settings is not None:
        try:  # GPUs in MIG mode have no clock plan, as in the deploy and the gate
            skip = mig_clock_skip(host, host_mig(host, settings.gpu_mig))
        except Refused:
            pass  # the gate's MIG check says why
    found = host_applied_clocks(host, policy, skip)
    if found is None:
        return None
    method, gpus, refused = found

    def pair(p: Any) -> str | None:
        return f"{p.mem},{p.gfx}" if p else None

    return {"method": METHOD_NAMES[method], "driver": driver,
            "policy": policy_text(policy) if settings is not None else None, "refused": refused,
            "gpus": [{"index": g.index, "model": g.name, "bus_id": g.bus_id, "applied": pair(g.applied),
                      "planned": (pair(g.planned) or "default") if g.managed else None, "at_plan": g.at_plan}
                     for g in gpus]}


def endpoints(host: Any, settings: Settings, by_name: dict[str, Any]) -> list[dict[str, str]]:
    """Each exporter the tier turns on: the URL Prometheus scrapes, and what the gate found there."""
    from gpufleet.plans import monitoring
    from gpufleet.checks.validation import exporter_check_name

    address = str(host.data.get("ssh_hostname") or host.name)
    out: list[dict[str, str]] = []
    for exporter in monitoring.exporters(settings):
        result = by_name.get(exporter_check_name(exporter.label))
        out.append({"name": exporter.label, "url": monitoring.public_url(settings, exporter, address),
                    "status": result.status if result else "unknown", "message": result.message if result else ""})
    return out


def classify(row: dict[str, Any], results: list[Any]) -> str:
    """fresh | provisioned | changed | mismatch-pending | unreachable | error."""
    if row["status"] == "unreachable":
        return "unreachable"
    if row.get("mismatch"):
        return "mismatch-pending"
    if row["status"] == "error":
        return "error"
    marker = next((r for r in results if r.name == "the gpufleet marker matches the tier"), None)
    if marker is not None and marker.status == "fail" and "missing" in marker.message:
        return "fresh"
    if any(r.status == "fail" for r in results):
        return "changed"
    return "provisioned"


def gather(inventory_path: str | InventorySource, workers: int = 20, drift: bool = True, probe: bool = False,
           progress: Callable[[str, str, float], None] | None = None,
           deploy: str = "deploys/all.py") -> list[dict[str, Any]]:
    """One row per host of the inventory, in inventory order."""
    from gpufleet.controller.fleet_read import connected_fleet, read_each
    from gpufleet.controller.inventory_source import InventorySource

    # the inventory with --limit, --data and config.py, as the pyinfra command line takes them
    source = inventory_path if isinstance(inventory_path, InventorySource) else InventorySource(str(inventory_path))
    with connected_fleet(source, workers, PACKAGE) as fleet:   # all.py's checks: these hosts only
        rows = read_each(fleet, lambda host: host_row(host, probe=probe), workers, progress)
        hosts = fleet.hosts
        if drift:
            plan_drift(fleet.state, [h for h in hosts if rows.get(h.name, {}).get("status") in ("ok", "error")
                                     and h.connected], rows, deploy)
    for host in hosts:
        rows[host.name].setdefault("drift", None)
    return [rows[h.name] for h in hosts]


def _pending(host: Any) -> list[str]:
    """Changes all.py leaves alone on this host (a driver, CUDA toolkit or cuDNN upgrade, a CUDA
    toolkit or cuDNN changed by hand): drift all the same, each for tools/rollout."""
    from gpufleet.controller.run_summary import pending

    return pending(host)


def plan_drift(state: Any, hosts: list[Any], rows: dict[str, dict[str, Any]], deploy: str) -> None:
    """Plan `deploy` (deploys/all.py) for each host and record the operations that would change."""
    from pyinfra.api.exceptions import PyinfraError
    from pyinfra.context import ctx_config, ctx_host

    from gpufleet import pyinfra_private
    from gpufleet.pyinfra_private import exec_file
    from gevent.pool import Pool

    path = str(PACKAGE / deploy)
    errors: dict[str, str] = {}

    def plan(host: Any) -> None:
        try:
            with ctx_config.use(state.config.copy()), ctx_host.use(host):
                exec_file(path)
        except Exception as error:  # noqa: BLE001 - the host's planning error is its drift
            if isinstance(error, PyinfraError) and host in state.failed_hosts:
                # Refused at planning time like the others: pyinfra raises "No hosts
                # remaining!" in whichever host is refused last (a different one each time,
                # as they are planned at once), which is no error of that host's.
                return
            errors[host.name] = f"{type(error).__name__}: {error}".strip()

    # All hosts at once, each in its own greenlet, as `pyinfra` itself plans a deploy file: one
    # host's fact round trips no longer wait for another's (serial planning was most of a
    # 100-host report).
    pool = Pool(max(1, state.config.PARALLEL or len(hosts) or 1))
    for host in hosts:
        pool.spawn(plan, host)
    pool.join()
    for host in hosts:
        if host.name in errors:
            rows[host.name]["drift"] = {"method": "plan", "changes": None, "operations": [],
                                        "conditional": [], "error": errors[host.name][:2000]}
            continue
        names: list[str] = []
        conditional: list[str] = []
        for op_hash in state.get_op_order():
            if op_hash not in state.ops[host]:
                continue
            op_data = state.get_op_data_for_host(host, op_hash)
            if pyinfra_private.planned_change(op_data.operation_meta):
                # As `pyinfra --dry` does: an op behind `_if` (e.g. reload when a file changed)
                # only runs if an earlier one changes something, so it is not drift by itself.
                target = conditional if op_data.global_arguments.get("_if") else names
                target.append(", ".join(state.op_meta[op_hash].names))
        failed = host in state.failed_hosts
        rows[host.name]["drift"] = {"method": "plan", "changes": len(names), "operations": names,
                                    "conditional": conditional,
                                    "error": "all.py refuses this host at planning time" if failed else None,
                                    "pending": _pending(host)}
