"""Every key of gpufleet/data/tiers.yaml is alive: read by code, and changing it changes what
gpufleet does.

1. Read by code: a module of the product (gpufleet/, deploys/, operations/, facts/) reads it as `settings.KEY`, `x["KEY"]`, `x.get("KEY")`,
`getattr(x, "KEY")`, the resolver's `_wish(x, "KEY", default)`, or from a table of keys a loop
walks (`for key, ... in (("KEY", ...), ...)`). The settings machinery, which handles every key
alike (the schema, the Settings dataclass's field list, the tiers loader, the docs generator),
does not count, nor does a message that merely names the key.

Computed from the source with ast, so a key added to tiers.yaml and forgotten by the code fails
here (test_a_forgotten_key_is_found proves the check can fail).

2. Changes behaviour: for every key, a host of a tier (simulated from recorded output,
tests/unit/settings_observables.py; SCENARIOS below: the tier, the inventory data and the
facts that let the key matter, such as a busy GPU for driver_reboot_force) is planned with the
key at its value and at another value its grammar accepts (enums and booleans: every other
value, derived from the schema; the rest: ALTERNATIVE below, checked against the schema) that
planning does not refuse. Something gpufleet produces must differ: the planning-time verdict
on the inventory, the plan view (its lines echoing the inventory left out), the commands
pyinfra's operations yield for all.py's areas, what those areas print (no-op messages too), the
validation gate's verdicts, the commands of tools/rollout's drain and snapshot steps and its
batch size, or the command that takes the host's lock. A key whose change changes none of them
fails, named. No key is exempt (no live-only list): every effect shows on recorded facts.
test_a_dead_key_fails_naming_it and test_a_key_read_but_ignored_deep_in_the_code_fails_too
prove this check can fail; test_observing_twice_gives_the_same_observables that it cannot
pass by noise."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("gpufleet", "deploys", "operations", "facts")
#: handle every key alike: a key named there is not read by anyone for what it means
MACHINERY = {"gpufleet/config/schema.py", "gpufleet/config/settings_doc.py", "gpufleet/catalog/tiers.py"}
READERS = {"get", "getattr", "_wish", "setdefault", "pop"}


def tier_keys(text: str) -> set[str]:
    data = yaml.safe_load(text)
    keys = set(data.get("defaults") or {})
    for values in (data.get("tiers") or {}).values():
        keys |= set(values or {})
    return keys


def keys_read(source: str, keys: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in keys:
            found.add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in keys:
            found.add(node.slice.value)
        elif isinstance(node, ast.For):  # a table of keys the loop reads one by one
            found |= {c.value for c in ast.walk(node.iter) if isinstance(c, ast.Constant) and c.value in keys}
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in READERS:
                found |= {a.value for a in node.args if isinstance(a, ast.Constant) and a.value in keys}
    return found


def unread_keys(root: Path, keys: set[str]) -> set[str]:
    read: set[str] = set()
    for top in PRODUCT:
        for path in (root / top).rglob("*.py"):
            if str(path.relative_to(root)) not in MACHINERY:
                read |= keys_read(path.read_text(encoding="utf-8"), keys)
    return keys - read


KEYS = tier_keys((ROOT / "gpufleet/data/tiers.yaml").read_text(encoding="utf-8"))


def test_tiers_yaml_has_keys():
    assert {"tier_mismatch", "clock_policy", "tuning_cpu_governor", "validate_min_ram_gb"} <= KEYS


def test_every_key_is_read_by_code():
    assert unread_keys(ROOT, KEYS) == set(), "keys of tiers.yaml no module reads (implement or remove them)"


def test_a_forgotten_key_is_found(tmp_path):
    """The check can fail: a product tree that reads two keys and names a third only in a
    message and in the schema leaves the third unread."""
    text = "defaults:\n  tuning_a: 1\n  tuning_b: 2\ntiers:\n  x:\n    tuning_c: 3\n"
    keys = tier_keys(text)
    assert keys == {"tuning_a", "tuning_b", "tuning_c"}
    (tmp_path / "gpufleet/config").mkdir(parents=True)
    (tmp_path / "gpufleet/config/schema.py").write_text("KEYS = {'tuning_c': int}\nx['tuning_c']\n")
    (tmp_path / "gpufleet/use.py").write_text(
        "def f(settings, data):\n"
        "    raise ValueError('tuning_c')  # a message naming a key reads nothing\n"
        "    return settings.tuning_a + data.get('tuning_b', 0)\n")
    assert unread_keys(tmp_path, keys) == {"tuning_c"}
    (tmp_path / "gpufleet/loop.py").write_text("for key in ('tuning_c',):\n    print(settings[key])\n")
    assert unread_keys(tmp_path, keys) == set()


# --- 2. changing a key changes behaviour -------------------------------------------------------

from dataclasses import dataclass, field, replace  # noqa: E402
from typing import Any  # noqa: E402

from gpufleet.facts.docker import DockerEngine, DockerLive  # noqa: E402
from gpufleet.facts.gpu import GpuProcess  # noqa: E402
from gpufleet.facts.nftables import NftablesCapability  # noqa: E402
from gpufleet.facts.slurm import SlurmNodeData  # noqa: E402
from gpufleet.config.schema import KEYS as SCHEMA  # noqa: E402
from gpufleet.catalog.tiers import tier_defaults  # noqa: E402
from tests.unit import settings_observables as so  # noqa: E402


@dataclass(frozen=True)
class Scenario:
    """A host of `tier` with inventory data `data` and facts `facts` (by fact class name)."""

    tier: str
    data: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)

    def observed(self, change: dict[str, Any] | None = None) -> so.Observed:
        host = so.host_of(self.tier, self.facts)
        data = {"tier": self.tier, "validate_os_release": "ubuntu-24.04", "ssh_user": "root", **self.data,
                **(change or {})}
        return so.Observed(so.observe(host, data))

    def value(self, key: str) -> Any:
        return self.data.get(key, tier_defaults(self.tier)[key])


def _busy_gpus() -> dict[str, Any]:
    state = so.provisioned()["GpuState"]
    job = GpuProcess(pid=4242, process_name="python3", used_memory_mib=1024, gpu_uuid=state.gpus[0].uuid)
    return {**so.provisioned(), "GpuState": replace(state, processes=[job])}


SCENARIOS = {
    # the simulated HGX has no NVLink in its (driverless) topology: warn keeps every area planned
    "hgx": Scenario("hgx", {"tier_mismatch": "warn"}),
    # the same host with its driver working: two H200s as recorded
    "hgx-provisioned": Scenario("hgx", {"tier_mismatch": "warn", "validate_gpu_count": [1, 8]}, so.provisioned()),
    # the dcgm exporter also brings DCGM: without it, driver_dcgm alone decides
    "hgx-no-exporter": Scenario("hgx", {"tier_mismatch": "warn", "monitoring_dcgm_exporter": False}),
    # tools/rollout on a Slurm node running a GPU job, snapshots by LVM or by a command
    "rollout": Scenario("hgx", {"tier_mismatch": "warn", "validate_gpu_count": [1, 8]},
                        {**_busy_gpus(), "SlurmNode": lambda kwargs: SlurmNodeData(
                            scontrol="/usr/bin/scontrol", node=kwargs.get("node") or "gpu01", state="mixed")}),
    # tiers where other values are possible: A100s without DCGM's exporter; PCIe boards, no NVSwitch
    "research": Scenario("research", {"tier_mismatch": "warn", "monitoring_dcgm_exporter": False}),
    "render": Scenario("render", {"tier_mismatch": "warn"}),
    "inference": Scenario("inference", {"tier_mismatch": "warn"}),
    # the scrapers' networks set: other metrics ports are opened to them
    "inference-scraped": Scenario("inference", {"tier_mismatch": "warn", "monitoring_allowed_cidrs": ["10.0.0.0/8"]}),
    # the driver pinned below CUDA 13.0 Update 2's toolkit driver (580.95.05), that update asked
    # for by name, but in its family ("13.0" alone would be Update 1, which 580.82.07 drives)
    "hgx-old-driver": Scenario("hgx", {"tier_mismatch": "warn", "driver_version": "580.82.07",
                                       "cuda_version": "13.0.2"}),
    # a provisioned host (580.159.04) whose inventory now asks for another driver
    "hgx-pending": Scenario("hgx", {"tier_mismatch": "warn", "validate_gpu_count": [1, 8],
                                    "driver_version": "580.126.09"}, so.provisioned()),
    "dev": Scenario("dev", {"tier_mismatch": "warn"}),
    # deployed as a sudo user: root login may be turned off (as root it is refused at planning)
    "hgx-sudo": Scenario("hgx", {"tier_mismatch": "warn", "ssh_user": "gpufleet", "_sudo": True}),
    # Debian 12 ships R535 only: the tier's R580 is refused when the tier is planned there
    "render-distro-debian": Scenario("render", {"tier_mismatch": "warn", "driver_source": "distro", "cuda_version": "none",
                                                "validate_os_release": "debian-12"}),
    # a driver change due while a process holds /dev/nvidia0, reboots allowed by the inventory
    "hgx-busy": Scenario("hgx", {"tier_mismatch": "warn", "driver_reboot": "allowed"}, {"GpuDeviceUsers": [4242]}),
    # Docker 26 running a GPU container with live-restore off, no daemon.json yet
    "docker-gpu-job": Scenario("hgx", {"tier_mismatch": "warn"}, {
        "DockerEngine": so.recorded_fact(DockerEngine, "docker_26_running"),
        "DockerLive": so.recorded_fact(DockerLive, "docker-live-gpu-container")}),
    # a host that can load nftables rules (not a container): the dead-man timer is armed
    "hgx-nftables": Scenario("hgx", {"tier_mismatch": "warn"},
                             {"NftablesCapability": so.recorded_fact(NftablesCapability, "no_namespace_check")}),
    # the node's health watch on, as Slurm's health check and prolog too, on a node with a slurm.conf
    "hgx-watch": Scenario("hgx", {"tier_mismatch": "warn", "health_watch": True, "health_slurm_check": True,
                                  "health_slurm_prolog": True},
                          {"File": lambda kwargs: {"size": 1, "mode": 644, "user": "root", "group": "root"}
                           if kwargs.get("path") == "/etc/slurm/slurm.conf" else None}),
    # the host that serves the fleet's package cache
    "hgx-cache": Scenario("hgx", {"tier_mismatch": "warn", "packages_cache_serve": True}),
    # an air-gapped host whose every download comes from the site's mirrors (packages_internet: true)
    "hgx-mirrored": Scenario("hgx", {"tier_mismatch": "warn", "driver_repo_url": "https://mirror.example.com/cuda/repos",
                                     "docker_repo_url": "https://mirror.example.com/docker",
                                     "docker_toolkit_repo_url": "https://mirror.example.com/libnvidia-container",
                                     "pytorch_wheel_dir": "/srv/wheels", "docker_smoke_image": "none"}),
    "rollout-idle": Scenario("hgx", {"tier_mismatch": "warn", "validate_gpu_count": [1, 8]}, _busy_gpus()),
    "rollout-lvm": Scenario("hgx", {"tier_mismatch": "warn", "rollout_snapshot": "lvm",
                                    "rollout_snapshot_target": "vg0/root"}, so.provisioned()),
    "rollout-command": Scenario("hgx", {"tier_mismatch": "warn", "rollout_snapshot": "command",
                                        "rollout_snapshot_command": ["cloudctl", "snapshot", "{host}"]},
                                so.provisioned()),
}

FINGERPRINT = "0123456789ABCDEF0123456789ABCDEF01234567"
#: The other value of each key whose grammar is not a short list of words (enums and booleans
#: take every other value their schema lists), and the scenario it is tried on (default hgx).
ALTERNATIVE: dict[str, tuple[Any, str]] = {
    "driver_branch": ("570", "inference"),
    "driver_version": ("580.126.09", "hgx"),
    "driver_repo_url": ("https://mirror.example.com/cuda/repos", "hgx"),
    "driver_repo_keyring_url": ("https://mirror.example.com/cuda-keyring_1.1-1_all.deb", "hgx"),
    "driver_repo_key_fingerprint": (FINGERPRINT, "hgx"),
    "driver_module_signing_key": ("/var/lib/shim-signed/mok/MOK.priv", "hgx"),
    "cuda_version": ("none", "render"),
    "cudnn_version": ("none", "hgx"),
    "pytorch_version": ("none", "research"),  # on hgx (pytorch_runtime: venv) none is refused at planning
    "pytorch_python": ("/opt/conda/envs/ml/bin/python", "research"),
    "pytorch_venv_path": ("/srv/pytorch", "hgx"),
    "pytorch_index_url": ("https://mirror.example.com/pytorch/whl/{variant}", "hgx"),
    "pytorch_wheel_dir": ("/srv/wheels", "hgx"),
    "clock_policy": ("default", "hgx-provisioned"),
    "gpu_mig": ({"all": ["3g.71gb", "3g.71gb"]}, "hgx-provisioned"),
    "nccl_profile": ("tcp", "hgx"),
    "docker_shm_size": ("2g", "hgx"),
    "docker_ulimits": ({"memlock": -1, "stack": 8388608}, "hgx"),
    "docker_repo_url": ("https://mirror.example.com/docker", "hgx"),
    "docker_repo_fingerprint": (FINGERPRINT, "hgx"),
    "docker_toolkit_repo_url": ("https://mirror.example.com/libnvidia-container", "hgx"),
    "docker_toolkit_repo_fingerprint": (FINGERPRINT, "hgx"),
    "docker_toolkit_version": ("1.17.8-1", "hgx"),
    "docker_smoke_image": ("none", "hgx"),
    "docker_registry_mirror": ("https://registry-mirror.example.com", "hgx"),
    "packages_cache_url": ("http://cache.example.com:3142", "hgx"),
    "packages_cache_port": (3143, "hgx-cache"),
    "packages_cache_upstream_ports": ([80, 443, 8080], "hgx-cache"),
    "tuning_omp_threads": (3, "hgx"),
    "tuning_pytorch_alloc_conf": ("expandable_segments:False", "hgx"),
    "tuning_nccl_socket_ifname": ("=eth0", "hgx"),
    "tuning_nccl_ib_hca": ("=mlx5_1", "hgx"),
    "storage_scratch_devices": (["/dev/nvme2n1", "/dev/nvme3n1"], "hgx"),
    "storage_scratch_path": ("/data", "hgx"),
    "storage_scratch_group": ("mlteam", "hgx"),
    "storage_shm_size": ("64g", "hgx"),
    "hardening_allow_users": (["root"], "hgx"),
    "hardening_allow_groups": (["sudo"], "hgx"),
    "hardening_max_auth_tries": (4, "hgx"),
    "hardening_login_grace_time": (60, "hgx"),
    "hardening_extra_kex": ([], "hgx"),
    "hardening_client_alive_interval": (120, "hgx"),
    "hardening_max_startups": ("5:30:50", "hgx"),
    "hardening_rsa_host_key_bits": (3072, "hgx"),  # the recorded host's RSA key: nothing to replace
    "hardening_moduli_min_bits": (4096, "hgx"),
    "firewall_open_ports": (["22/tcp", "443/tcp"], "hgx"),
    "firewall_trusted_cidrs": (["10.0.0.0/8"], "hgx"),
    "firewall_cluster_cidrs": (["10.0.0.0/8"], "hgx"),
    "firewall_revert_after": (120, "hgx-nftables"),
    "hardening_sshd_revert_after": (120, "hgx"),
    "monitoring_node_exporter_port": (9101, "hgx"),
    "monitoring_dcgm_exporter_port": (9401, "hgx"),
    "monitoring_dcgm_exporter_version": ("4.4.0", "hgx"),
    "monitoring_listen_address": ("127.0.0.1", "hgx"),
    "monitoring_allowed_cidrs": (["10.0.0.0/8"], "hgx"),
    "monitoring_scrape_ports": (["9091/tcp"], "inference-scraped"),
    "rollout_batch_size": (2, "hgx"),
    "rollout_lock_wait": (30, "hgx"),
    "acceptance_diag_level": (2, "hgx"),
    "acceptance_port": (29401, "hgx"),
    "acceptance_allreduce_mib": (1024, "hgx"),
    "acceptance_timeout": (300, "hgx"),
    "rollout_snapshot_target": ("vg1/data", "rollout-lvm"),
    "rollout_snapshot_size": ("20G", "rollout-lvm"),
    "rollout_snapshot_command": (["cloudctl", "snapshot", "--name", "{snapshot}", "{host}"], "rollout-command"),
    "rollout_slurm_node_name": ("gpu-node-7", "rollout"),
    "rollout_drain_timeout": (60, "rollout"),
    "rollout_canary_diag_level": (0, "rollout"),
    "validate_os_release": ("ubuntu-24.04", "render-distro-debian"),
    "validate_gpu_models": (["NVIDIA H200"], "hgx"),
    "validate_gpu_count": (4, "hgx"),
    "validate_min_ram_gb": (4096, "hgx"),
    "validate_min_nic_gbps": (400, "hgx"),
    "validate_min_nvme_tb": (40, "hgx"),
    "extra_packages": (["nvtop"], "hgx"),
    "health_interval": (60, "hgx-watch"),
    "health_escalate_count": (5, "hgx-watch"),
    "health_escalate_window": (3600, "hgx-watch"),
    "health_slurm_interval": (60, "hgx-watch"),
    "health_slurm_node_states": (["idle", "cycle"], "hgx-watch"),
    "health_textfile_dir": ("/srv/node-exporter/textfile", "hgx-watch"),
}
#: keys of an enum or a boolean tried on another scenario than hgx
SCENARIO_OF = {
    "driver_flavour": "research", "driver_source": "dev", "validate_rdma": "inference",
    "cuda_driver_compat": "hgx-old-driver", "driver_upgrade_in_place": "hgx-pending",
    "driver_upgrade_pending": "hgx-pending", "driver_reboot_force": "hgx-busy",
    "docker_restart_with_gpu_containers": "docker-gpu-job",
    "driver_persistence": "hgx-provisioned", "driver_dcgm": "hgx-no-exporter",
    "rollout_require_idle": "rollout-idle", "rollout_snapshot": "rollout-lvm",
    "hardening_permit_root_login": "hgx-sudo", "packages_internet": "hgx-mirrored",
    "health_action": "hgx-watch", "health_escalate_to": "hgx-watch", "health_slurm_check": "hgx-watch",
    "health_slurm_prolog": "hgx-watch", "health_dcgm_watches": "hgx-watch",
}


def alternatives(key: str, current: Any) -> list[Any]:
    """Other values the key's grammar accepts: ALTERNATIVE's, or every other word of an enum."""
    if key in ALTERNATIVE:
        return [ALTERNATIVE[key][0]]
    if isinstance(current, bool):
        return [not current]
    words = SCHEMA[key].allowed().split(" | ")
    return [word for word in words if word != current] if len(words) > 1 else []


def scenario_of(key: str) -> str:
    return ALTERNATIVE[key][1] if key in ALTERNATIVE else SCENARIO_OF.get(key, "hgx")


_REFERENCE: dict[str, so.Observed] = {}


def effect(key: str) -> str | None:
    """Which observable changes when `key` takes another valid value (None: none does)."""
    name = scenario_of(key)
    scenario = SCENARIOS[name]
    reference = _REFERENCE.setdefault(name, scenario.observed())
    current = scenario.value(key)
    for value in alternatives(key, current):
        SCHEMA[key].validate(value)  # BadValue: the table is wrong, not the product
        changed = scenario.observed({key: value})
        if changed["inventory"]:  # refused at planning time: not a value this host can take
            continue
        if (what := so.first_difference(reference, changed)) is not None:
            return f"{what} ({key}: {value!r} instead of {current!r}, on {name})"
    return None


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_observing_twice_gives_the_same_observables(scenario):
    """Otherwise any key would seem alive: every observable of a scenario is the same on a
    second observation (random ids and clock readings are masked)."""
    reference = _REFERENCE.setdefault(scenario, SCENARIOS[scenario].observed())
    assert so.first_difference(reference, SCENARIOS[scenario].observed()) is None


@pytest.mark.parametrize("key", sorted(KEYS))
def test_changing_the_key_changes_what_gpufleet_does(key):
    assert alternatives(key, SCENARIOS[scenario_of(key)].value(key)), f"{key}: no other value to try (add it to ALTERNATIVE)"
    assert effect(key) is not None, f"{key}: no observable changes when it changes (dead setting: implement or remove it)"


def test_a_dead_key_fails_naming_it(monkeypatch):
    """The check can fail: with the settings reader made to ignore docker_shm_size (every
    reader then sees the tier's value, whatever the inventory says), nothing changes and the
    test names the key."""
    import gpufleet.config.settings as gs

    real = gs._settings_for

    def ignoring(host, data):
        return real(host, {k: v for k, v in data.items() if k != "docker_shm_size"})

    assert effect("docker_shm_size") is not None
    monkeypatch.setattr(gs, "_settings_for", ignoring)
    assert effect("docker_shm_size") is None
    with pytest.raises(AssertionError, match="docker_shm_size: no observable changes"):
        test_changing_the_key_changes_what_gpufleet_does("docker_shm_size")


def test_a_key_read_but_ignored_deep_in_the_code_fails_too(monkeypatch):
    """Read (so check 1 passes) but without effect: the thread count computed as if
    tuning_omp_threads were always auto. The key is found dead."""
    import gpufleet.plans.tuning as gt

    assert effect("tuning_omp_threads") is not None
    monkeypatch.setattr(gt, "omp_threads", lambda setting, cores, gpus: max(1, cores // max(1, gpus)))
    assert effect("tuning_omp_threads") is None


def test_every_key_has_a_way_to_be_shown_alive():
    """A key added to tiers.yaml needs another value to try (enum, boolean or ALTERNATIVE); the
    tables name no key tiers.yaml lacks, and no scenario nobody uses."""
    assert set(ALTERNATIVE) | set(SCENARIO_OF) <= KEYS
    assert all(alternatives(key, SCENARIOS[scenario_of(key)].value(key)) for key in KEYS)
    assert {scenario_of(key) for key in KEYS} == set(SCENARIOS)

