"""Per-host gpufleet settings: tier defaults merged under the host's inventory data, validated.

Deploys call ``host_settings(host)``; ``deploys/all.py`` calls ``validate_inventory(inventory)``
once before any operation so every broken host is reported together, before anything changes.

Precedence (first wins): runtime ``host.data.x = ...`` > inventory override data > host data >
group data (later groups win, as in pyinfra) > inventory-wide data > tier > tiers.yaml defaults.
pyinfra's deploy ``data_defaults`` are deliberately not read: the tier is the default.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

from gpufleet.catalog.compat import compat_data
from gpufleet.errors import Incompatible, InventoryError
from gpufleet.config.hostcontext import fleet_context, host_context
from gpufleet.catalog.gpus import model_for_name
from gpufleet.config.resolver import Resolution, resolve
from gpufleet.config.offline import internet_problems
from gpufleet.config.schema import KEYS, BadValue, show, text_problem
from gpufleet.catalog.sshd_policy import deploy_user, lockouts
from gpufleet.catalog.tiers import tier_defaults, tier_names

#: pyinfra connector / global keys that are never gpufleet's (besides anything starting with "_").
_PYINFRA_PREFIXES = ("ssh_", "winrm_", "fake_", "chroot_", "vagrant_", "terraform_")


@dataclass(frozen=True)
class Settings:
    """Validated, read-only settings of one host. Field names are the inventory keys."""

    host: str
    tier: str
    tier_mismatch: str
    driver_source: str
    driver_branch: str
    driver_version: str
    driver_flavour: str
    driver_reboot: str
    driver_repo_url: str
    driver_persistence: str
    driver_hold: bool
    driver_repo_keyring_url: str
    driver_repo_key_fingerprint: str
    driver_kernel_headers: str
    driver_module_signing_key: str
    driver_reboot_force: bool
    driver_dcgm: bool
    driver_upgrade_in_place: bool
    driver_upgrade_pending: str
    cuda_version: str
    cuda_driver_compat: str
    cudnn_version: str
    pytorch_version: str
    pytorch_runtime: str
    pytorch_python: str
    pytorch_venv_path: str
    pytorch_index_url: str
    pytorch_wheel_dir: str
    clock_policy: Any  # "max" | "default" | "unmanaged" | {"memory": int, "graphics": int}
    gpu_mig: Any  # "none" | "unmanaged" | {"all" | GPU index: (profile, ...)}
    nccl_profile: str
    docker_source: str
    docker_default_runtime: str
    docker_cdi: bool
    docker_shm_size: str
    docker_ulimits: Mapping[str, int]
    docker_repo_url: str
    docker_repo_fingerprint: str
    docker_toolkit_repo_url: str
    docker_toolkit_repo_fingerprint: str
    docker_toolkit_version: str
    docker_smoke_image: str
    docker_live_restore: bool
    docker_restart_with_gpu_containers: str
    docker_registry_mirror: str
    packages_cache_url: str
    packages_cache_serve: bool
    packages_cache_port: int
    packages_cache_upstream_ports: tuple[int, ...]
    packages_internet: bool
    tuning_omp_threads: Any  # "auto" | int
    tuning_pytorch_alloc_conf: str
    tuning_nccl_debug_vars: bool
    tuning_nccl_socket_ifname: str
    tuning_nccl_ib_hca: str
    tuning_cpu_governor: str
    tuning_profiling: str
    storage_scratch: str
    storage_scratch_devices: Any  # "auto" | (device path, ...)
    storage_scratch_path: str
    storage_scratch_group: str
    storage_shm_size: str
    hardening_permit_root_login: str
    hardening_password_auth: bool
    hardening_allow_users: tuple[str, ...]
    hardening_allow_groups: tuple[str, ...]
    hardening_max_auth_tries: int
    hardening_login_grace_time: int
    hardening_extra_kex: tuple[str, ...]
    hardening_tcp_forwarding: bool
    hardening_agent_forwarding: bool
    hardening_x11_forwarding: bool
    hardening_client_alive_interval: int
    hardening_max_startups: str
    hardening_rsa_host_key_bits: int
    hardening_moduli_min_bits: int
    hardening_unattended_upgrades: bool
    firewall_enabled: bool
    firewall_open_ports: tuple[str, ...]
    firewall_trusted_cidrs: tuple[str, ...]
    firewall_cluster_cidrs: tuple[str, ...]
    firewall_revert_after: int
    hardening_sshd_revert_after: int
    monitoring_node_exporter: bool
    monitoring_node_exporter_port: int
    monitoring_dcgm_exporter: bool
    monitoring_dcgm_exporter_port: int
    monitoring_dcgm_exporter_version: str
    monitoring_scrape_ports: tuple[str, ...]
    monitoring_listen_address: str
    monitoring_allowed_cidrs: tuple[str, ...]
    health_watch: bool
    health_interval: int
    health_action: str
    health_escalate_count: int
    health_escalate_window: int
    health_escalate_to: str
    health_slurm_check: bool
    health_slurm_interval: int
    health_slurm_node_states: tuple[str, ...]
    health_slurm_prolog: bool
    health_dcgm_watches: bool
    health_textfile_dir: str
    rollout_batch_size: int
    rollout_require_idle: bool
    rollout_canary_diag_level: int
    rollout_lock_wait: int
    acceptance_new_host: bool
    acceptance_rollout: bool
    acceptance_diag_level: int
    acceptance_port: int
    acceptance_allreduce_mib: int
    acceptance_timeout: int
    rollout_snapshot: str
    rollout_snapshot_target: str
    rollout_snapshot_size: str
    rollout_snapshot_command: tuple[str, ...]
    rollout_slurm_node_name: str
    rollout_drain_timeout: int
    rollout_slurm_reboot: str
    validate_os_release: str
    validate_gpu_models: tuple[str, ...]
    validate_gpu_count: tuple[int, int]
    validate_nvswitch: str
    validate_nvlink: str
    validate_rdma: str
    validate_min_ram_gb: int
    validate_min_nic_gbps: int
    validate_min_nvme_tb: float
    extra_packages: tuple[str, ...]
    #: keys the inventory set explicitly (the rest came from the tier)
    overridden: tuple[str, ...] = ()
    #: planning-time resolution against the tier's first expected GPU model (None if none declared)
    plan: Resolution | None = None

    def __getitem__(self, key: str) -> Any:
        if key not in KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in KEYS else default

    def as_dict(self) -> dict[str, Any]:
        """The settings as a plain dict in schema order (no plan)."""
        return {key: getattr(self, key) for key in KEYS}

    def describe(self) -> dict[str, Any]:
        """Ordered mapping for a plan view: settings (overrides marked), then resolved versions."""
        out: dict[str, Any] = {"host": self.host}
        for key in KEYS:
            value = getattr(self, key)
            if isinstance(value, Mapping):
                value = dict(value)
            out[key] = f"{value} (inventory)" if key in self.overridden else value
        if self.plan is not None:
            for key, value in self.plan.describe().items():
                out[f"resolved.{key}"] = value
        return out


def _check_fields_match_schema() -> None:
    # A Settings field without a schema entry (or the reverse) is a bug in this module.
    names = {f.name for f in fields(Settings)} - {"host", "overridden", "plan"}
    if names != set(KEYS):
        raise RuntimeError(f"Settings fields and schema.KEYS differ: {sorted(names ^ set(KEYS))}")


_check_fields_match_schema()


def is_pyinfra_key(key: str) -> bool:
    """True for pyinfra's own data keys (global arguments, connector settings)."""
    return key.startswith("_") or key.startswith(_PYINFRA_PREFIXES) or key in _connector_keys()


@lru_cache(maxsize=1)
def _connector_keys() -> frozenset[str]:
    # Ask pyinfra which data keys its connectors read (e.g. docker_identifier), so they are
    # never mistaken for gpufleet's docker_* keys.
    from typing import get_type_hints

    from pyinfra.api.connectors import get_all_connectors

    keys: set[str] = set()
    for connector in get_all_connectors().values():
        data_cls = getattr(connector, "data_cls", None)
        if data_cls is not None:
            try:
                keys.update(get_type_hints(data_cls))
            except Exception:  # a connector with odd annotations must not break validation
                pass
        keys.update(getattr(connector, "data_meta", None) or {})
    return frozenset(keys)


def explicit_data(host: Any) -> dict[str, Any]:
    """The data the inventory set for ``host`` (no deploy data_defaults), merged by precedence."""
    inventory = host.inventory
    merged: dict[str, Any] = {}
    layers: Iterable[Mapping[str, Any]] = (
        inventory.get_data() or {},
        inventory.get_groups_data(host.groups) or {},
        inventory.get_host_data(host.name) or {},
        inventory.get_override_data() or {},
        getattr(host.data, "override_datas", {}) or {},
    )
    for layer in layers:
        merged.update(layer)
    return merged


def _name(text: Any, limit: int = 80) -> str:
    """A host or key name as it may appear in a one-line message (newlines and the like escaped,
    longer than `limit` shortened)."""
    text = str(text)
    if len(text) > limit:
        return show(text, limit=limit)
    return text if all(32 <= ord(c) < 127 for c in text) else repr(text)[1:-1]


#: an inventory file's path is named whole, as the operator needs it to find the file: only a
#: path longer than any real one (PATH_MAX) is shortened
_PATH_LIMIT = 4096


def _line(host: str, key: str, problem: str, allowed: str) -> str:
    return f"host {_name(host)}: key '{_name(key)}': {problem}; allowed: {allowed}"


def _hint(text: Any) -> str:
    """Why a name that matched nothing may look right: a look-alike or invisible character."""
    problem = text_problem(text) if isinstance(text, str) else None
    return f" ({problem.split(' contains ', 1)[1]})" if problem and " contains " in problem else ""


def _host_name_problem(name: str) -> str | None:
    """Host names end up in controller paths (.gpufleet/manifests/<host>/) and snapshot commands."""
    problem = text_problem(name) if isinstance(name, str) else "not a string"
    if problem:
        return problem.replace(show(name) + " ", "the name ", 1)
    if not name or any(c.isspace() for c in name):
        return "empty, or contains whitespace"
    if "/" in name and not name.startswith("@") or ".." in name.split("/"):
        return "a path: '/' only in pyinfra connector names (@connector/...), never '..'"
    return None


def _settings_for(host: str, data: Mapping[str, Any]) -> tuple[Settings | None, list[str]]:
    """Build Settings for one host from its explicit data; return (settings, problem lines)."""
    problems: list[str] = []
    name_problem = _host_name_problem(host)
    if name_problem:
        return None, [_line(host, "host name", name_problem, "A-Z a-z 0-9 . _ - : (a pyinfra connector name "
                            "may start with @ and hold /), no whitespace, quotes or other shell metacharacters")]
    tiers = tier_names()
    tier = data.get("tier")
    if tier is None:
        return None, [_line(host, "tier", "missing (every host needs a tier)", ", ".join(tiers))]
    if not isinstance(tier, str) or tier not in tiers:
        close = difflib.get_close_matches(str(tier), tiers, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return None, [_line(host, "tier", f"unknown tier {show(tier)}{hint}{_hint(tier)}", ", ".join(tiers))]

    ours = {}
    for key, value in data.items():
        if key in KEYS:
            ours[key] = value
        elif not is_pyinfra_key(key):
            close = difflib.get_close_matches(str(key), list(KEYS), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "not a gpufleet setting"
            problems.append(_line(host, key, f"unknown key ({hint}){_hint(key)}", "see gpufleet/data/tiers.yaml"))

    merged = dict(tier_defaults(tier))
    merged.update(ours)
    values: dict[str, Any] = {}
    for key, spec in KEYS.items():
        if key not in merged:
            problems.append(_line(host, key, f"no value in tier {tier} or the inventory", spec.allowed()))
            continue
        try:
            values[key] = spec.validate(merged[key])
        except BadValue as bad:
            where = "" if key in ours else f" (from tier {tier})"
            problems.append(_line(host, key, bad.problem + where, bad.allowed))
    if problems:
        return None, problems

    problems += _cross_checks(host, values)
    problems += _lockout_checks(host, values, data)
    if problems:
        return None, problems

    plan, plan_problems = _plan(host, values)
    if plan_problems:
        return None, plan_problems
    problems += _health_checks(host, values)
    problems += _monitoring_checks(host, values)  # after the plan: a driver_source refused there says more
    if problems:
        return None, problems
    return Settings(host=host, overridden=tuple(k for k in KEYS if k in ours), plan=plan, **values), []


def _cross_checks(host: str, values: Mapping[str, Any]) -> list[str]:
    problems = []
    data = compat_data()
    version, branch = values["driver_version"], values["driver_branch"]
    if version != "auto" and values["driver_source"] == "nvidia":
        if branch == "auto":
            problems.append(_line(host, "driver_version", f"pinning {version} needs an explicit driver_branch", "auto"))
        elif version not in data.driver_branches[branch].versions:
            known = ", ".join(data.driver_branches[branch].versions)
            problems.append(_line(host, "driver_version", f"{version} is not a known R{branch} release", f"auto, {known}"))
    problems += _snapshot_checks(host, values)
    problems += [_line(host, key, problem, allowed) for key, problem, allowed in internet_problems(values)]
    if values["pytorch_runtime"] == "venv" and values["pytorch_version"] == "none":
        problems.append(_line(host, "pytorch_runtime", "venv installs the wheel of pytorch_version, which is none",
                              "python (an interpreter the site keeps: pytorch_python), none, or venv with "
                              "pytorch_version set to a release"))
    needs_rdma = data.nccl_profiles[values["nccl_profile"]].get("needs_rdma", False)
    if needs_rdma and values["validate_rdma"] == "absent":
        problems.append(
            _line(host, "nccl_profile", f"profile {values['nccl_profile']} needs RDMA but validate_rdma is absent", "tcp, efa")
        )
    return problems


def _lockout_checks(host: str, values: Mapping[str, Any], data: Mapping[str, Any]) -> list[str]:
    """Hardening that would shut out the user this run logs in as (sshd_policy.lockouts), refused
    before any host changes. Only over SSH: other connectors never log in (the hardening deploy
    refuses them itself)."""
    if host.startswith("@") and not host.startswith("@ssh/"):
        return []
    user = deploy_user(data.get("ssh_user"))
    said = "ssh_user" if data.get("ssh_user") else "ssh_user unset: pyinfra logs in as the controller's user"
    return [_line(host, key, problem, allowed)
            for key, problem, allowed in lockouts(values["hardening_permit_root_login"],
                                                  values["hardening_allow_users"], user, said)]


def _health_checks(host: str, values: Mapping[str, Any]) -> list[str]:
    """Slurm's health check and prolog are the watch's: they need it; a state list needs a state."""
    problems = []
    for key in ("health_slurm_check", "health_slurm_prolog"):
        if values[key] and not values["health_watch"]:
            problems.append(_line(host, key, "is true but health_watch is false (the check they run is the watch's)",
                                  "health_watch: true, or false here"))
    states = values["health_slurm_node_states"]
    if not [s for s in states if s != "cycle"]:
        problems.append(_line(host, "health_slurm_node_states", f"{list(states)} names no node state",
                              "at least one of any | alloc | idle | mixed | nondrained_idle (and cycle)"))
    elif "any" in states and len([s for s in states if s != "cycle"]) > 1:
        problems.append(_line(host, "health_slurm_node_states", f"{list(states)}: any already takes every state",
                              "any alone (and cycle), or the states without any"))
    return problems


def _monitoring_checks(host: str, values: Mapping[str, Any]) -> list[str]:
    """Two exporters cannot share a port (that DCGM needs NVIDIA's repository, the resolver says)."""
    problems = []
    if (values["monitoring_node_exporter"] and values["monitoring_dcgm_exporter"]
            and values["monitoring_node_exporter_port"] == values["monitoring_dcgm_exporter_port"]):
        problems.append(_line(host, "monitoring_dcgm_exporter_port", f"{values['monitoring_dcgm_exporter_port']} is "
                              "also monitoring_node_exporter_port", "another port than the node exporter's"))
    return problems


def _snapshot_checks(host: str, values: Mapping[str, Any]) -> list[str]:
    """rollout_snapshot_target must have the form its provider takes (gpufleet/rollout/snapshot.py)."""
    provider, target = values["rollout_snapshot"], values["rollout_snapshot_target"]
    forms = {
        "lvm": (target.count("/") == 1 and not target.startswith("/") and all(target.split("/")), "VG/LV such as vg0/root"),
        "btrfs": (target.startswith("/"), "the absolute path of a btrfs subvolume such as /"),
        "zfs": (bool(target) and not target.startswith("/") and ":" not in target and "@" not in target,
                "a ZFS dataset such as rpool/ROOT/debian"),
    }
    if provider in forms and not forms[provider][0]:
        return [_line(host, "rollout_snapshot_target", f"{show(target)} does not name a {provider} snapshot target",
                      forms[provider][1])]
    if provider == "command" and not values["rollout_snapshot_command"]:
        return [_line(host, "rollout_snapshot_command", "rollout_snapshot is command but the command is empty",
                      "an argv list such as [cloudctl, snapshot, \"{host}\", --name, \"{snapshot}\"]")]
    return []


def _group_problems(host: Any) -> list[str]:
    """A host in two groups whose data set different tiers, with no tier of its own: pyinfra would
    quietly let the later group win, and the host would get the other tier's driver and limits."""
    inventory = host.inventory
    if "tier" in (inventory.get_host_data(host.name) or {}) or "tier" in (inventory.get_override_data() or {}):
        return []
    tiers = {}
    for group in host.groups:
        data = inventory.get_group_data(group) or {}
        if "tier" in data:
            tiers[group] = data["tier"]
    if len(set(map(str, tiers.values()))) > 1:
        said = ", ".join(f"group {group}: {show(tier)}" for group, tier in tiers.items())
        return [_line(host.name, "tier", f"the host's groups set different tiers ({said})",
                      "one tier per host: set tier on the host, or in only one of its groups")]
    return []


def _plan(host: str, values: Mapping[str, Any]) -> tuple[Resolution | None, list[str]]:
    """Resolve against every GPU model the tier expects, so a combination no declared model can run
    fails at planning time. The first model's resolution becomes Settings.plan."""
    models = [model_for_name(name) for name in values["validate_gpu_models"]]
    nvswitch = values["validate_nvswitch"] == "required"
    failures: dict[str, list[tuple[str, Incompatible]]] = {}
    plan = None
    for model in models:
        assert model is not None  # schema checked the names
        try:
            resolution = resolve([model], values, values["validate_os_release"], nvswitch=nvswitch)
        except Incompatible as exc:
            failures.setdefault(exc.key or "tier", []).append((model.name, exc))
            continue
        plan = plan or resolution
    # one line per key: the first refusal, the other refused models, and what fits all of them
    problems = []
    for key, refused in failures.items():
        first_name, first = refused[0]
        reason = first.reason if first_name in first.reason else f"{first_name}: {first.reason}"
        others = [name for name, _ in refused[1:]]
        if others:
            reason += f" (also refused for {', '.join(others)})"
        problems.append(_line(host, key, f"incompatible: {reason}", _common_allowed([exc for _, exc in refused])))
    return plan, problems


def _common_allowed(refusals: list[Incompatible]) -> str:
    lists = [[item.strip() for item in (exc.allowed or "").split(",") if item.strip()] for exc in refusals]
    if not lists or not all(lists):
        return refusals[0].allowed or "-"
    common = [item for item in lists[0] if all(item in other for other in lists[1:])]
    return ", ".join(common) if common else "none (no value fits every expected GPU model)"


def host_settings(host: Any) -> Settings:
    """Validated settings of one pyinfra host; raises InventoryError listing its problems.

    Computed once per host and run: every deploy asks, and the inventory does not change
    while a run is planned."""
    data = explicit_data(host)
    cached = host_context(host).settings
    if cached is not None and cached[0] == data:
        return cached[1]
    problems = _group_problems(host)
    settings, found = _settings_for(host.name, data)
    problems += found
    if problems:
        raise InventoryError(problems)
    assert settings is not None
    host_context(host).settings = (data, settings)
    return settings


def validate_inventory(inventory: Any, source: Path | str | None = None, hosts: Any = None) -> None:
    """Validate the hosts of a pyinfra Inventory this run touches; raise one InventoryError
    listing all problems.

    `hosts`: default, the running pyinfra state's --limit when it is this inventory's, else every
    host (a broken host outside `--limit` does not stop a run on the others).
    `source` is the inventory file (default: the one the pyinfra command line was given, if a
    .py file): top-level data in it that pyinfra ignores is refused too.

    Once per inventory and run: deploys/all.py asks for every host it plans, and validating
    all N hosts N times made planning quadratic in the fleet size."""
    problems = fleet_context(inventory).problems
    if problems is None:
        problems = _file_problems(source if source is not None else _cli_inventory_file(), inventory)
        if not len(inventory):
            problems.append("inventory: no hosts; allowed: at least one host, each with a tier")
        for host in (list(hosts) if hosts is not None else _hosts_in_play(inventory)):
            data = explicit_data(host)
            found = _group_problems(host)
            settings, more = _settings_for(host.name, data)
            found += more
            if settings is not None and not found:
                host_context(host).settings = (data, settings)  # host_settings() answers from it
            problems += found
        fleet_context(inventory).problems = problems
    if problems:
        raise InventoryError(problems)


def _hosts_in_play(inventory: Any) -> list[Any]:
    """The hosts the running pyinfra state is limited to (`pyinfra --limit`), else all."""
    from pyinfra.context import ctx_state

    state = ctx_state.get() if ctx_state.isset() else None
    limit: Any = getattr(state, "limit_hosts", None)
    if isinstance(limit, list) and state is not None and state.inventory is inventory:
        return [h for h in inventory if h in limit]
    return list(inventory)


def _cli_inventory_file() -> Path | None:
    """The inventory file of the running pyinfra command line, if it is a Python file."""
    import sys

    if Path(sys.argv[0]).name != "pyinfra":
        return None
    try:  # parse the command line as pyinfra did (pyinfra keeps no note of the file)
        from gpufleet import pyinfra_private

        name = pyinfra_private.cli_params(sys.argv[1:]).get("inventory")
    except Exception:
        return None
    path = Path(name) if isinstance(name, str) else None
    return path if path is not None and path.suffix == ".py" and path.is_file() else None


_LITERAL_DATA = (ast.Dict, ast.Constant, ast.JoinedStr, ast.Set)


def _file_problems(source: Path | str | None, inventory: Any) -> list[str]:
    """Top-level names of an inventory file that pyinfra silently ignores (only lists and
    (hosts, data) tuples are groups) and nothing in the file uses, when they hold literal data
    or are named like a setting: an operator who writes `tier = "hgx"` or
    `data = {"cuda_version": "12.8"}` there expects it to apply to every host."""
    if source is None:
        return []
    try:
        tree = ast.parse(Path(source).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []  # pyinfra itself reports an inventory it cannot read
    groups = set(getattr(inventory, "groups", {}) or {})
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    problems = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for target in targets:
            if (not isinstance(target, ast.Name) or target.id.startswith("_") or target.id in groups
                    or target.id in used):
                continue
            if target.id in KEYS or isinstance(getattr(node, "value", None), _LITERAL_DATA):
                problems.append(
                    f"inventory {_name(source, _PATH_LIMIT)}: key '{_name(target.id)}': top-level data that pyinfra ignores "
                    "(only lists of hosts and (hosts, data) tuples are read); allowed: settings in a group's or "
                    "a host's data, or in group_data/all.py")
    return problems
