"""Settings API: host_settings / validate_inventory on in-memory pyinfra inventories (no hosts)."""

from __future__ import annotations

import dataclasses
import runpy
from pathlib import Path

import pytest
from pyinfra.api.exceptions import PyinfraError
from pyinfra.api.inventory import Inventory

from gpufleet.errors import InventoryError
from gpufleet.config.settings import Settings, host_settings, validate_inventory

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def inventory(host_data: dict | None = None, group_data: dict | None = None, all_data: dict | None = None) -> Inventory:
    """One host `gpu-a01` in group `pod`, with the given host / group / inventory-wide data."""
    return Inventory(
        ([("gpu-a01", host_data or {})], all_data or {}),
        pod=(["gpu-a01"], group_data if group_data is not None else {"tier": "hgx"}),
    )


def problems_of(inv: Inventory) -> list[str]:
    with pytest.raises(InventoryError) as info:
        validate_inventory(inv)
    return info.value.problems


# --- broken inventories: one line per problem, naming host, key and allowed values -------------

BROKEN = [
    # (id, host data, group data, expected key, expected fragment in the line)
    ("missing-tier", {}, {}, "tier", "missing"),
    ("unknown-tier", {"tier": "hgx2"}, {}, "tier", "unknown tier 'hgx2' (did you mean 'hgx'?); allowed: dev, research"),
    ("misspelt-key", {"cuda_verison": "13.0"}, None, "cuda_verison", "did you mean 'cuda_version'?"),
    ("unknown-key", {"colour": "blue"}, None, "colour", "not a gpufleet setting"),
    ("string-for-int", {"rollout_batch_size": "2"}, None, "rollout_batch_size", "expected an integer, got str '2'"),
    ("bool-for-int", {"validate_min_ram_gb": True}, None, "validate_min_ram_gb", "expected an integer"),
    ("bad-enum", {"driver_flavour": "closed"}, None, "driver_flavour", "unknown value 'closed'; allowed: open | proprietary | auto"),
    ("bad-reboot", {"driver_reboot": "sometimes"}, None, "driver_reboot", "allowed: never | if-idle | allowed"),
    ("unknown-branch", {"driver_branch": "999"}, None, "driver_branch", "R999 is not in the compatibility data; allowed: auto, 470"),
    ("unverified-branch", {"driver_branch": "R615"}, None, "driver_branch", "unverified data"),
    ("unknown-cuda", {"cuda_version": "13.9"}, None, "cuda_version", "CUDA '13.9' is not in the compatibility data; allowed: none, 13.2"),
    ("float-cuda", {"cuda_version": 12.8}, None, "cuda_version", "quote it"),
    ("unknown-cudnn", {"cudnn_version": "9.99.0"}, None, "cudnn_version", "not in the compatibility data; allowed: none, 9.17.0"),
    ("unknown-driver-version", {"driver_version": "580.1.2"}, None, "driver_version", "not a known R580 release; allowed: auto, 580.65.06"),
    ("bad-clock", {"clock_policy": "turbo"}, None, "clock_policy", "allowed: max | default | unmanaged"),
    ("clock-pair-keys", {"clock_policy": {"mem": 1, "gfx": 2}}, None, "clock_policy", "exactly the keys memory and graphics"),
    ("bad-nccl", {"nccl_profile": "infiniband"}, None, "nccl_profile", "allowed: ib | roce | tcp | efa"),
    ("bad-port", {"firewall_open_ports": ["22/sctp"]}, None, "firewall_open_ports", "bad port '22/sctp'"),
    ("string-not-list", {"extra_packages": "nvtop"}, None, "extra_packages", "expected a list, got str"),
    ("bad-alloc-conf", {"tuning_pytorch_alloc_conf": "expandable_segmentz:True"}, None, "tuning_pytorch_alloc_conf", "unknown PyTorch allocator option"),
    ("bad-gpu-model", {"validate_gpu_models": ["H200"]}, None, "validate_gpu_models", "unknown GPU model 'H200'"),
    ("bad-os", {"validate_os_release": "centos-7"}, None, "validate_os_release", "allowed: debian-12, debian-13, ubuntu-22.04"),
    ("incompatible-branch", {"driver_branch": "535"}, None, "driver_branch", "H200 needs driver >= 550.40.65; the newest known R535 release is 535.309.01 (also refused for NVIDIA B200); allowed: R570"),
    ("incompatible-cuda", {"driver_branch": "570"}, None, "cuda_version", "incompatible"),
    ("incompatible-cudnn", {"cuda_version": "12.8", "cudnn_version": "9.5.1"}, None, "cudnn_version",
     "cuDNN 9.5.1 supports CUDA 12.0, 12.1, 12.2, 12.3, 12.4, 12.5, 12.6, not 12.8"),
    # issue 47 item 3: an update above the pinned driver is refused at planning, with the updates that fit
    ("cuda-update-above-driver", {"driver_branch": "595", "driver_version": "595.45.04", "cuda_version": "13.2.2",
                                  "cudnn_version": "none"}, None, "cuda_version",
     "CUDA 13.2.2 needs driver >= 595.71.05; driver is 595.45.04"),
    ("unknown-cuda-update", {"cuda_version": "13.2.7"}, None, "cuda_version",
     "not an update of CUDA 13.2 in the compatibility data; allowed: none, 13.2, 13.2.2, 13.2.1, 13.2.0"),
    ("proprietary-blackwell", {"driver_flavour": "proprietary"}, None, "driver_flavour", "must use the open kernel modules"),
    ("distro-on-hgx", {"driver_source": "distro", "cuda_version": "none", "cudnn_version": "none"}, None, "driver_source",
     "NVSwitch systems need Fabric Manager 580.173.02, which ubuntu-24.04 does not package"),
    ("distro-cuda-on-ubuntu", {"driver_source": "distro"}, None, "cuda_version",
     "ubuntu-24.04's own CUDA toolkit has no verified driver floor"),
    ("rdma-profile-without-rdma", {"tier": "hgx-cloud", "nccl_profile": "ib"}, None, "nccl_profile", "needs RDMA but validate_rdma is absent"),
]


@pytest.mark.parametrize("host_data, group_data, key, fragment", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_inventory(host_data, group_data, key, fragment):
    problems = problems_of(inventory(host_data, group_data))
    matching = [p for p in problems if p.startswith(f"host gpu-a01: key '{key}': ")]
    assert matching, problems
    assert any(fragment in p for p in matching), matching
    assert all("; allowed: " in p for p in problems)


# --- lock-outs (issue 27 item 8): refused at planning, naming host, key and what is allowed -----

LOCKOUTS = [
    # (id, host data, key, fragment of the problem, fragment of what is allowed)
    ("root-login-off-as-root", {"ssh_user": "root", "hardening_permit_root_login": "no"}, "hardening_permit_root_login",
     '"no" turns root login off, and this host is deployed as root (ssh_user)', "prohibit-password (root by key only)"),
    ("allow-users-without-deploy-user", {"ssh_user": "ops", "_sudo": True, "hardening_allow_users": ["alice", "bob"]},
     "hardening_allow_users", "[alice, bob] does not allow the deploy user ops (ssh_user)", "e.g. [ops, alice, bob]"),
    ("allow-users-without-root", {"ssh_user": "root", "hardening_allow_users": ["alice"]},
     "hardening_allow_users", "does not allow the deploy user root", "[] for no restriction"),
    ("trust-the-internet-v4", {"firewall_trusted_cidrs": ["10.0.0.0/8", "0.0.0.0/0"]}, "firewall_trusted_cidrs",
     "'0.0.0.0/0' trusts every address, the whole internet, on every port", "each at least a /1"),
    ("trust-the-internet-v6", {"firewall_trusted_cidrs": ["::/0"]}, "firewall_trusted_cidrs",
     "'::/0' trusts every address", "each at least a /1"),
    ("trust-the-internet-host-bits", {"firewall_trusted_cidrs": ["10.1.2.3/0"]}, "firewall_trusted_cidrs",
     "trusts every address", "each at least a /1"),
    # training peers get every TCP port: the whole internet, or anything as wide, is refused
    ("cluster-the-internet-v4", {"firewall_cluster_cidrs": ["10.0.0.0/8", "0.0.0.0/0"]}, "firewall_cluster_cidrs",
     "'0.0.0.0/0' is every address, the whole internet", "the networks of the host's training peers"),
    ("cluster-the-internet-v6", {"firewall_cluster_cidrs": ["::/0"]}, "firewall_cluster_cidrs",
     "'::/0' is every address, the whole internet", "at most as wide as a /8 (IPv4) or a /16 (IPv6)"),
    ("cluster-half-the-internet", {"firewall_cluster_cidrs": ["0.0.0.0/1"]}, "firewall_cluster_cidrs",
     "'0.0.0.0/1' spans 2^31 addresses, a part of the whole internet", "at most as wide as a /8"),
    ("cluster-global-unicast", {"firewall_cluster_cidrs": ["2000::/3"]}, "firewall_cluster_cidrs",
     "'2000::/3' spans 2^125 addresses", "a /16 (IPv6)"),
    ("cluster-v4-mapped", {"firewall_cluster_cidrs": ["::ffff:0.0.0.0/96"]}, "firewall_cluster_cidrs",
     "spans 2^32 IPv4 addresses, as IPv6 writes them", "a /8 (IPv4)"),
    ("cluster-wider-than-a-slash-8", {"firewall_cluster_cidrs": ["10.0.0.0/7"]}, "firewall_cluster_cidrs",
     "'10.0.0.0/7' spans 2^25 addresses", "a /8 (IPv4)"),
]


@pytest.mark.parametrize("host_data, key, problem, allowed", [c[1:] for c in LOCKOUTS], ids=[c[0] for c in LOCKOUTS])
def test_lockout_refused_at_planning(host_data, key, problem, allowed):
    problems = problems_of(inventory(host_data))
    assert len(problems) == 1, problems
    line = problems[0]
    assert line.startswith(f"host gpu-a01: key '{key}': "), line
    assert problem in line and "; allowed: " in line and allowed in line.partition("; allowed: ")[2], line


@pytest.mark.parametrize("host_data", [
    {"ssh_user": "gpufleet", "_sudo": True, "hardening_permit_root_login": "no"},  # root login off as a sudo user
    {"ssh_user": "gpufleet", "_sudo": True, "hardening_allow_users": ["gpufleet", "lab-admin"]},
    {"ssh_user": "lab-7", "_sudo": True, "hardening_allow_users": ["lab-?", "gpufleet"]},  # sshd's wildcards count
    {"ssh_user": "root", "hardening_allow_users": ["root@10.0.0.*", "alice"]},  # USER@HOST: the user part
    {"firewall_trusted_cidrs": ["0.0.0.0/1", "::/1", "10.0.0.0/8"]},
    {"firewall_cluster_cidrs": ["10.0.0.0/8", "fd00::/16", "100.64.0.0/10", "::ffff:10.1.0.0/112", "192.0.2.7"]},
], ids=["root-off-sudo-user", "deploy-user-listed", "pattern", "user-at-host", "half-the-internet", "cluster-networks"])
def test_no_lockout_passes(host_data):
    validate_inventory(inventory(host_data))


def test_named_users_are_the_ones_whose_keys_can_be_checked():
    from gpufleet.catalog.sshd_policy import named_users

    assert named_users(["alice", "root@10.0.0.*", "lab-?", "*", "bob", "alice@192.0.2.1"]) == ["alice", "root", "bob"]


def test_unset_ssh_user_is_the_controllers_login_name(monkeypatch):
    monkeypatch.setattr("getpass.getuser", lambda: "root")
    problems = problems_of(inventory({"hardening_permit_root_login": "no"}))
    assert "ssh_user unset: pyinfra logs in as the controller's user" in problems[0], problems
    monkeypatch.setattr("getpass.getuser", lambda: "ops")
    validate_inventory(inventory({"hardening_permit_root_login": "no"}))


def test_lockouts_are_not_judged_for_connectors_that_never_log_in():
    inv = Inventory(([("@local", {"hardening_permit_root_login": "no", "ssh_user": "root"})], {}), pod=(["@local"], {"tier": "hgx"}))
    validate_inventory(inv)


def test_inventory_error_is_a_pyinfra_error_and_lists_every_host():
    inv = Inventory(
        (["a", "b", "c"], {}),
        good=(["a"], {"tier": "dev"}),
        bad=(["b", "c"], {"tier": "render", "driver_reboot": "yes"}),
    )
    with pytest.raises(PyinfraError) as info:
        validate_inventory(inv)
    message = str(info.value)
    assert message.splitlines()[0] == "gpufleet: 2 problems in the inventory:"
    assert "host b: key 'driver_reboot'" in message and "host c: key 'driver_reboot'" in message
    assert "host a:" not in message


def test_several_problems_on_one_host_are_all_reported():
    problems = problems_of(inventory({"cuda_verison": "13.0", "driver_flavour": 1, "rollout_batch_size": 0}))
    assert len(problems) == 3


def test_pyinfra_keys_are_ignored():
    inv = inventory(
        {"ssh_user": "ops", "ssh_port": 2222, "_sudo": True, "docker_identifier": "x", "winrm_port": 5986},
        {"tier": "hgx", "_su_user": "root"},
    )
    validate_inventory(inv)


def test_valid_inventory_passes():
    validate_inventory(inventory())


# --- host_settings ------------------------------------------------------------------------------


def test_host_settings_merges_tier_group_and_host():
    inv = inventory(
        host_data={"docker_shm_size": "32g"},
        group_data={"tier": "hgx", "docker_shm_size": "16g", "nccl_profile": "roce"},
        all_data={"rollout_batch_size": 3, "nccl_profile": "tcp"},
    )
    s = host_settings(inv.get_host("gpu-a01"))
    assert isinstance(s, Settings)
    assert s.tier == "hgx"
    assert s.docker_shm_size == "32g"  # host beats group
    assert s.nccl_profile == "roce"  # group beats inventory-wide data
    assert s.rollout_batch_size == 3  # inventory-wide data beats the tier
    assert s.cuda_version == "13.0" and s.driver_flavour == "open"  # tier defaults
    assert s["cudnn_version"] == "9.17.0"
    assert set(s.overridden) == {"tier", "docker_shm_size", "nccl_profile", "rollout_batch_size"}


def test_later_group_wins_like_pyinfra():
    inv = Inventory(
        (["a"], {}),
        pod=(["a"], {"tier": "hgx"}),
        canary=(["a"], {"driver_branch": "595"}),
    )
    host = inv.get_host("a")
    assert host_settings(host).driver_branch == "595"
    assert host.data.driver_branch == "595"  # same answer as pyinfra's own lookup


def test_runtime_override_data_is_seen():
    inv = inventory()
    host = inv.get_host("gpu-a01")
    host.data.clock_policy = "default"
    assert host_settings(host).clock_policy == "default"


def test_settings_are_read_only_and_typed():
    s = host_settings(inventory({"firewall_open_ports": [22, "9100/tcp"]}).get_host("gpu-a01"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cuda_version = "12.8"  # type: ignore[misc]
    assert s.firewall_open_ports == ("22/tcp", "9100/tcp")
    assert s.validate_gpu_count == (8, 8)
    assert s.docker_ulimits == {"memlock": -1, "stack": 67108864}
    with pytest.raises(TypeError):
        s.docker_ulimits["memlock"] = 0  # type: ignore[index]


def test_normalisation():
    s = host_settings(inventory({"driver_branch": "R580", "cudnn_version": "9.17"}).get_host("gpu-a01"))
    assert s.driver_branch == "580" and s.cudnn_version == "9.17.0"


def test_host_settings_raises_for_its_host():
    with pytest.raises(InventoryError) as info:
        host_settings(inventory({"tier": "nope"}, {}).get_host("gpu-a01"))
    assert info.value.problems[0].startswith("host gpu-a01: key 'tier': unknown tier 'nope'")


def test_describe_for_plan_view():
    s = host_settings(inventory({"nccl_profile": "roce"}).get_host("gpu-a01"))
    view = s.describe()
    keys = list(view)
    assert keys[:3] == ["host", "tier", "tier_mismatch"]
    assert view["nccl_profile"] == "roce (inventory)"
    assert view["resolved.driver"] == "R580 580.159.04 (open)"
    assert view["resolved.fabricmanager"] == "nvidia-fabricmanager 580.159.04"
    assert keys.index("extra_packages") < keys.index("resolved.source")


def test_plan_is_none_without_expected_models():
    s = host_settings(inventory({"validate_gpu_models": []}).get_host("gpu-a01"))
    assert s.plan is None and "resolved.driver" not in s.describe()


# --- the shipped example inventory -------------------------------------------------------------


def test_example_inventory_is_valid():
    module = runpy.run_path(str(REPO / "inventories" / "cloud.py"))
    groups = {
        name: value
        for name, value in module.items()
        if not name.startswith("_") and isinstance(value, (list, tuple))
    }
    hosts = []
    for value in groups.values():
        members = value[0] if isinstance(value, tuple) else value
        hosts += [h[0] if isinstance(h, tuple) else h for h in members]
    inv = Inventory((sorted(set(hosts)), {}), **groups)
    validate_inventory(inv)
    tiers = {host_settings(h).tier for h in inv}
    assert {"dev", "research", "inference", "render", "hgx", "hgx-cloud"} <= tiers
    assert host_settings(inv.get_host("gpu-a03.example.internal")).driver_branch == "595"
    assert host_settings(inv.get_host("dev-02.example.internal")).plan.driver_version == "550.163.01"
    for host in inv:
        assert host.name.endswith(".example.internal")
    # every multi-node group names its training peers: the example plans without a warning
    from gpufleet.plans.cluster import missing_peers

    assert [h.name for h in inv if missing_peers(host_settings(h))] == []


def test_a_cluster_cidr_refused_in_a_group_names_the_host_the_key_and_the_tier_data():
    """Set per group (the pod's fabric), refused for each of the group's hosts by name."""
    problems = problems_of(inventory({}, {"tier": "research", "firewall_cluster_cidrs": ["10.0.0.0/24", "0.0.0.0/0"]}))
    assert problems == ["host gpu-a01: key 'firewall_cluster_cidrs': '0.0.0.0/0' is every address, the whole internet: "
                        "every TCP port would be open to it; allowed: list of CIDRs such as 10.0.0.0/16 or fd00::/8: "
                        "the networks of the host's training peers (their fabric or cluster network), each at most as "
                        "wide as a /8 (IPv4) or a /16 (IPv6)"], problems


def test_cluster_cidrs_are_per_group_and_normalised():
    inv = inventory({}, {"tier": "research", "firewall_cluster_cidrs": ["10.10.0.0/16", "fd00:1::5"]})
    validate_inventory(inv)
    assert host_settings(inv.get_host("gpu-a01")).firewall_cluster_cidrs == ("10.10.0.0/16", "fd00:1::5/128")


# --- multi-node tiers: training peers or a warning, at planning ------------------------------------

@pytest.mark.parametrize("data, warns", [
    ({"tier": "research"}, "tier research trains across hosts (nccl_profile: roce) but firewall_cluster_cidrs is empty"),
    ({"tier": "hgx", "firewall_cluster_cidrs": []}, "tier hgx trains across hosts (nccl_profile: ib)"),
    ({"tier": "hgx-cloud"}, "tier hgx-cloud trains across hosts (validate_nvswitch: required (an HGX baseboard))"),
    ({"tier": "research", "firewall_cluster_cidrs": ["10.10.0.0/16"]}, None),
    ({"tier": "research", "firewall_trusted_cidrs": ["10.10.0.0/16"]}, None),  # trusted: every port already
    ({"tier": "research", "firewall_enabled": False}, None),  # nothing filtered
    ({"tier": "inference"}, None),  # nccl_profile tcp, no NVSwitch: one host serves alone
    ({"tier": "dev"}, None),
], ids=["research", "hgx-emptied", "hgx-cloud", "research-peers", "research-trusted", "no-firewall", "inference", "dev"])
def test_a_multi_node_tier_without_training_peers_warns(data, warns):
    from gpufleet.plans.cluster import missing_peers

    inv = Inventory(([("gpu-a01", data)], {}))
    validate_inventory(inv)
    found = missing_peers(host_settings(inv.get_host("gpu-a01")))
    if warns is None:
        assert found is None
    else:
        assert found is not None and found.startswith(warns), found
        assert "29500/tcp" in found and "set firewall_cluster_cidrs" in found
