"""The grammar of every setting (gpufleet/config/schema.py), checked through validate_inventory as a run
does: refused values name the host and the key on one line, with what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.api.inventory import Inventory

from gpufleet.catalog.compat import compat_data
from gpufleet.errors import InventoryError
from gpufleet.config.schema import ALLOC_OPTION_VALUES, KEYS, SHELL_METACHARACTERS
from gpufleet.config.settings import host_settings, validate_inventory
from gpufleet.catalog.tiers import common_defaults, tier_defaults

pytestmark = pytest.mark.unit

HOST = "gpu-a01"


def problems(host_data: dict, groups: dict | None = None, source: Path | None = None) -> list[str]:
    """Problem lines for one host `gpu-a01` of tier dev with `host_data` on top."""
    inv = Inventory(([(HOST, {"tier": "dev", **host_data})], {}), **(groups or {}))
    try:
        validate_inventory(inv, source=source)
    except InventoryError as exc:
        return exc.problems
    return []


def refused(key: str, value, fragment: str = "") -> str:
    lines = problems({key: value})
    mine = [line for line in lines if line.startswith(f"host {HOST}: key '{key}': ")]
    assert mine, f"{key}={value!r} was accepted ({lines})"
    line = mine[0]
    assert "\n" not in line and "; allowed: " in line, line
    assert fragment in line, line
    return line


def accepted(key: str, value) -> object:
    assert problems({key: value}) == [], (key, value)
    return host_settings(Inventory(([(HOST, {"tier": "dev", key: value})], {})).get_host(HOST))[key]


# --- injection: every key of tiers.yaml, every injection string --------------------------------

INJECTIONS = {"quote": "'", "double-quote": '"', "command-substitution": "$(id)", "backtick": "`id`",
              "semicolon": "; reboot", "newline": "\nreboot"}


def _with(value, injection: str):
    """`value` (a key's default) with the injection appended to its text."""
    if isinstance(value, dict) or hasattr(value, "items"):
        name, limit = next(iter(value.items())) if value else ("memlock", -1)
        return {name + injection: limit}
    if isinstance(value, (list, tuple)):
        first = str(value[0]) if value else "x"
        return [first + injection, *list(value)[1:]]
    return str(value) + injection


def _every_key():
    defaults = common_defaults()
    return ["tier", *[key for key in defaults if key != "tier"]]


@pytest.mark.parametrize("injection", list(INJECTIONS.values()), ids=list(INJECTIONS))
@pytest.mark.parametrize("key", _every_key())
def test_every_setting_refuses_injection(key, injection):
    default = tier_defaults("dev")[key]
    bad = _with(default, injection)
    line = refused(key, bad)
    assert "shell metacharacter" in line or "control character" in line, line


def test_every_tiers_yaml_key_is_in_the_injection_test():
    # A key added to tiers.yaml (and so to KEYS) is covered by the test above automatically.
    assert set(_every_key()) == set(KEYS)


def test_no_shipped_value_needs_a_metacharacter():
    for tier in ("dev", "research", "inference", "render", "hgx", "hgx-cloud"):
        for key, value in tier_defaults(tier).items():
            KEYS[key].validate(value)
    assert set("'\"`$;") <= set(SHELL_METACHARACTERS)


# --- grammars ------------------------------------------------------------------------------------

BAD = [
    # (key, value, fragment of the refusal)
    ("driver_repo_url", "ftp://mirror.example/cuda", "scheme must be http or https"),
    ("driver_repo_url", "file:///srv/mirror", "scheme must be http or https"),
    ("driver_repo_url", "https://user:secret@mirror.example/cuda", "carries credentials"),
    ("driver_repo_url", "https://mirror.example/cuda?x=1", "query or fragment"),
    ("driver_repo_url", "https://mirror.example/../etc", "contains '..'"),
    ("driver_repo_url", "https://mirror example/cuda", "whitespace"),
    ("driver_repo_url", "https:///cuda", "no valid host name"),
    ("driver_repo_url", "https://mirror.example:99999/cuda", "malformed URL"),
    ("driver_repo_url", "https://mirror.exаmple/cuda", "U+0430 CYRILLIC SMALL LETTER A"),
    ("docker_repo_url", "https://-bad-.example", "no valid host name"),
    ("driver_repo_keyring_url", "https://mirror.example/key.gpg#x", "query or fragment"),
    ("driver_module_signing_key", "/var/lib/shim-signed/../../etc/shadow", "path traversal"),
    ("driver_module_signing_key", "relative/mok.priv", "not an absolute path"),
    ("driver_module_signing_key", "/var/lib/mok dir/mok.priv", "path components may only use"),
    ("driver_module_signing_key", "/var/lib//mok.priv", "empty path component"),
    ("extra_packages", ["Nvtop"], "not a Debian package name"),
    ("extra_packages", ["n"], "not a Debian package name"),
    ("extra_packages", ["-nvtop"], "not a Debian package name"),
    ("extra_packages", ["nvtop=latest"], "not a Debian version"),
    ("extra_packages", ["nvtop=1.0-"], "not a Debian version"),
    ("extra_packages", ["nvtop=1:"], "not a Debian version"),
    ("extra_packages", ["nvtop", "htop", "nvtop"], "listed twice"),
    ("extra_packages", ["nvtop", "nvtop=3.0.1-1"], "listed twice"),
    ("extra_packages", ["nvtоp"], "U+043E CYRILLIC SMALL LETTER O"),
    ("extra_packages", ["--allow-unauthenticated"], "not a Debian package name"),
    ("hardening_extra_kex", ["diffie-hellman-group1-sha1"], "weak key exchange"),
    ("hardening_extra_kex", ["Curve25519_SHA256"], "not an OpenSSH algorithm name"),
    ("hardening_extra_kex", ["ecdh-sha2-nistp256"], "weak key exchange"),
    ("hardening_extra_kex", ["curve25519-sha256,diffie-hellman-group1-sha1"], "not an OpenSSH algorithm name"),
    ("hardening_extra_kex", ["curve25519-sha256", "curve25519-sha256"], "listed twice"),
    ("tuning_pytorch_alloc_conf", "expandable_segments:true", "expandable_segments takes True | False"),
    ("tuning_pytorch_alloc_conf", "max_split_size_mb:20", "MB > 20"),
    ("tuning_pytorch_alloc_conf", "garbage_collection_threshold:1.0", "strictly between 0.0 and 1.0"),
    ("tuning_pytorch_alloc_conf", "roundup_power2_divisions:3", "a power of 2"),
    ("tuning_pytorch_alloc_conf", "backend:cudaMalloc", "native | cudaMallocAsync"),
    ("tuning_pytorch_alloc_conf", "expandable_segments:True,expandable_segments:False", "given twice"),
    ("tuning_pytorch_alloc_conf", "expandable_segments=True", "malformed entry"),
    ("tuning_pytorch_alloc_conf", "pinned_num_register_threads:256", "a power of 2 up to 128"),
    ("tuning_pytorch_alloc_conf", "backend:native>/etc/passwd", "native | cudaMallocAsync"),
    ("tuning_pytorch_alloc_conf", "roundup_power2_divisions:[>:8]>x", "a power of 2"),
    ("tuning_nccl_socket_ifname", "=eth0,eth0", "listed twice"),
    ("tuning_nccl_socket_ifname", "=averyveryverylongname0", "malformed value"),
    ("tuning_nccl_socket_ifname", "=eth0 eth1", "malformed value"),
    ("tuning_nccl_ib_hca", "=mlx5_0:1:2", "malformed value"),
    ("tuning_nccl_ib_hca", "mlx5/0", "malformed value"),
    ("firewall_trusted_cidrs", ["10.0.0.1/8"], "host bits set (did you mean 10.0.0.0/8?)"),
    ("firewall_trusted_cidrs", ["10.0.0.0/33"], "bad network"),
    ("firewall_trusted_cidrs", ["fd00::1/8"], "host bits set (did you mean fd00::/8?)"),
    ("firewall_trusted_cidrs", [167772160], "expected a string"),
    ("firewall_trusted_cidrs", ["10.0.0.0/8", "10.0.0.0/8"], "listed twice"),
    ("firewall_cluster_cidrs", ["10.0.0.1/8"], "host bits set (did you mean 10.0.0.0/8?)"),
    ("firewall_cluster_cidrs", ["10.0.0.0/33"], "bad network"),
    ("firewall_cluster_cidrs", ["10.0.0.0/24", "10.0.0.0/24"], "listed twice"),
    ("firewall_cluster_cidrs", "10.0.0.0/24", "expected a list"),
    ("firewall_cluster_cidrs", ["0.0.0.0/0"], "the whole internet"),
    ("firewall_cluster_cidrs", ["128.0.0.0/1"], "a part of the whole internet"),
    ("firewall_cluster_cidrs", ["fc00::/7"], "spans 2^121 addresses"),
    ("firewall_open_ports", ["6819-6817/tcp"], "second port must be higher"),
    ("firewall_open_ports", [0], "bad port"),
    ("firewall_open_ports", [65536], "bad port"),
    ("firewall_open_ports", [22, "22/tcp"], "listed twice"),
    ("firewall_revert_after", -1, "out of range"),
    ("rollout_batch_size", 10 ** 30, "out of range"),
    ("rollout_batch_size", 0, "out of range"),
    ("validate_min_ram_gb", -5, "out of range"),
    ("validate_min_nic_gbps", 10 ** 6, "out of range"),
    ("tuning_omp_threads", 100000, "out of range"),
    ("validate_gpu_count", 1000, "out of range"),
    ("validate_gpu_count", [4, 2], "bad GPU count"),
    ("clock_policy", {"memory": 10 ** 9, "graphics": 1000}, "integer MHz from 1 to"),
    ("docker_shm_size", "0", "out of range"),
    ("docker_shm_size", "99999999999999999g", "out of range"),
    ("docker_shm_size", "64 g", "malformed size"),
    ("docker_ulimits", {"memlocks": -1}, "unknown ulimit"),
    ("docker_ulimits", {"nofile": 2 ** 64}, "from -1 to 2^63-1"),
    ("docker_smoke_image", "Ubuntu:24.04", "malformed value"),
    ("rollout_snapshot_target", "../vg0/root", "path traversal"),
    ("rollout_snapshot_command", ["cloudctl", "{host.__class__}"], "unknown field"),
    ("rollout_snapshot_command", ["cloudctl", "{hostname}"], "unknown field"),
    ("rollout_snapshot_command", ["cloudctl", ""], "an empty argument"),
    ("hardening_allow_users", ["ops", "ops"], "listed twice"),
    ("validate_gpu_models", ["Tesla T4", "Tesla T4"], "listed twice"),
    ("driver_repo_key_fingerprint", "c95b321b61e88c1809c4f759ddcae044f796ecb0", "malformed value"),
    ("docker_toolkit_version", "1.18.0-1 ", "malformed value"),
    ("driver_repo_url", "https://mirror.example/" + "a" * 2000, "too long (at most 1024 characters)"),
    ("tuning_nccl_socket_ifname", "=eth0\x00", "control character"),
    ("driver_branch", "58０", "U+FF10 FULLWIDTH DIGIT ZERO"),
]


@pytest.mark.parametrize("key, value, fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_values_are_refused_naming_host_and_key(key, value, fragment):
    refused(key, value, fragment)


GOOD = [
    ("driver_repo_url", "http://127.0.0.1:8080/cuda/repos"),
    ("driver_repo_url", "https://[fd00::1]/cuda"),
    ("driver_repo_url", "https://mirror.example.internal./nvidia/cuda/repos/"),
    ("driver_repo_keyring_url", "auto"),
    ("driver_module_signing_key", "/var/lib/shim-signed/mok/MOK.priv"),
    ("extra_packages", ["nvtop", "libstdc++6", "g++-12", "python3.11", "htop=3.2.2-2", "tmux=1:3.3a-3~bpo12+1"]),
    ("hardening_extra_kex", ["curve25519-sha256", "sntrup761x25519-sha512@openssh.com"]),
    ("hardening_extra_kex", []),
    ("hardening_extra_kex", ["no-such-kex@gpufleet.invalid"]),  # well-formed: the host's sshd -t decides
    ("tuning_pytorch_alloc_conf", ""),
    ("tuning_pytorch_alloc_conf", "backend:cudaMallocAsync"),
    ("tuning_pytorch_alloc_conf", "max_split_size_mb:512,garbage_collection_threshold:0.8,expandable_segments:False"),
    ("tuning_pytorch_alloc_conf", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"),
    ("tuning_pytorch_alloc_conf", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"),
    ("tuning_nccl_socket_ifname", "^docker,lo"),
    ("tuning_nccl_socket_ifname", "^=docker0"),
    ("tuning_nccl_ib_hca", "=mlx5_0:1,mlx5_1:1"),
    ("firewall_trusted_cidrs", ["10.0.0.0/8", "fd00::/8", "192.0.2.7", "fd01:0::/16"]),
    ("firewall_cluster_cidrs", ["10.0.0.0/8", "172.16.0.0/12", "fd00::/16", "10.232.7.2/32"]),
    ("firewall_cluster_cidrs", []),
    ("firewall_open_ports", [22, "9400/udp", "6817-6819/tcp"]),
    ("rollout_snapshot_command", ["cloudctl", "snapshot", "{host}", "--name", "{snapshot}", "--name", "x"]),
    ("docker_shm_size", "67108864"),
    ("docker_ulimits", {"memlock": -1, "nofile": 1048576}),
]


@pytest.mark.parametrize("key, value", GOOD, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOOD)])
def test_good_values_pass(key, value):
    accepted(key, value)


def test_cidrs_are_normalised():
    assert accepted("firewall_trusted_cidrs", ["192.0.2.7"]) == ("192.0.2.7/32",)


def test_every_allocator_option_has_a_value_grammar():
    assert set(compat_data().pytorch_alloc_options) <= set(ALLOC_OPTION_VALUES)


# --- look-alikes, long values and odd names stay on one line -----------------------------------


def test_cyrillic_tier_is_named():
    line = problems({"tier": "hgх"})[0]  # the last letter is U+0445
    assert line.startswith(f"host {HOST}: key 'tier': unknown tier 'hgх' (did you mean 'hgx'?)")
    assert "U+0445 CYRILLIC SMALL LETTER HA" in line


def test_cyrillic_key_is_named():
    line = problems({"cuda_vеrsion": "13.0"})[0]  # U+0435
    assert "unknown key (did you mean 'cuda_version'?)" in line and "U+0435 CYRILLIC SMALL LETTER IE" in line


def test_a_key_with_a_newline_stays_on_one_line():
    (line,) = problems({"cuda_version\nx": "13.0"})
    assert "\n" not in line and line.startswith(f"host {HOST}: key 'cuda_version\\nx': unknown key")


def test_a_huge_value_is_shortened_in_the_message():
    line = refused("extra_packages", ["x" * 100_000])
    assert len(line) < 600 and "(100000 characters)" in line


def test_a_huge_list_is_shortened_in_the_message():
    line = refused("validate_gpu_count", list(range(1, 20_000)), "bad GPU count")
    assert len(line) < 600


# --- cross-key and inventory shapes -------------------------------------------------------------


@pytest.mark.parametrize("provider, target, fragment", [
    ("lvm", "/", "does not name a lvm snapshot target"),
    ("btrfs", "vg0/root", "does not name a btrfs snapshot target"),
    ("zfs", "", "does not name a zfs snapshot target"),
])
def test_snapshot_target_matches_its_provider(provider, target, fragment):
    line = [p for p in problems({"rollout_snapshot": provider, "rollout_snapshot_target": target})
            if "'rollout_snapshot_target'" in p][0]
    assert fragment in line


def test_command_snapshot_needs_a_command():
    (line,) = problems({"rollout_snapshot": "command"})
    assert line.startswith(f"host {HOST}: key 'rollout_snapshot_command': rollout_snapshot is command but the command is empty")


def test_empty_inventory_is_refused():
    with pytest.raises(InventoryError) as info:
        validate_inventory(Inventory(([], {})))
    assert info.value.problems == ["inventory: no hosts; allowed: at least one host, each with a tier"]


def test_groups_that_disagree_on_the_tier_are_refused():
    inv = Inventory(([HOST, "gpu-b01"], {}), hgx_pod=([HOST, "gpu-b01"], {"tier": "hgx"}),
                    dev_boxes=([HOST], {"tier": "dev"}))
    with pytest.raises(InventoryError) as info:
        validate_inventory(inv)
    (line,) = info.value.problems
    assert line.startswith(f"host {HOST}: key 'tier': the host's groups set different tiers "
                           "(group hgx_pod: 'hgx', group dev_boxes: 'dev')")


def test_a_host_tier_settles_groups_that_disagree():
    inv = Inventory(([(HOST, {"tier": "dev"})], {}), hgx_pod=([HOST], {"tier": "hgx"}), dev_boxes=([HOST], {"tier": "dev"}))
    validate_inventory(inv)
    assert host_settings(inv.get_host(HOST)).tier == "dev"


def test_groups_that_agree_on_the_tier_pass():
    inv = Inventory(([HOST], {}), pod=([HOST], {"tier": "hgx"}), canary=([HOST], {"tier": "hgx", "driver_branch": "595"}))
    validate_inventory(inv)


def test_top_level_data_the_inventory_file_would_lose(tmp_path):
    source = tmp_path / "inv.py"
    source.write_text('_ssh = {"ssh_user": "ops"}\n'
                      'models = {"t4": "dev"}  # used below: fine\n'
                      'tier = "hgx"\n'
                      'data = {"cuda_version": "12.8"}\n'
                      'POOL = "x"\n'
                      'dev = [("gpu-a01", {**_ssh, "tier": models["t4"]})]\n')
    lines = problems({}, source=source)
    assert [line.split(": top-level")[0] for line in lines] == [
        f"inventory {source}: key 'tier'", f"inventory {source}: key 'data'", f"inventory {source}: key 'POOL'"]
    assert all("allowed: settings in a group's or a host's data" in line for line in lines)


def test_the_inventory_path_is_named_whole_however_deep(tmp_path):
    # the operator looks for the file by this path: a long one is not shortened like a value
    folder = tmp_path / ("fleet-inventories-of-the-lab-" * 4) / "site-a" / "rack-12"
    folder.mkdir(parents=True)
    source = folder / "inventory.py"
    source.write_text('tier = "hgx"\n')
    (line,) = problems({}, source=source)
    assert len(str(source)) > 100 and line.startswith(f"inventory {source}: key 'tier': top-level data")


def test_every_message_is_one_line_with_host_key_and_allowed():
    lines = problems({"tier": "dev", "cuda_verison": "13.0", "extra_packages": ["a\nb"], "driver_repo_url": "x" * 5000})
    assert len(lines) == 3
    for line in lines:
        assert "\n" not in line and line.startswith(f"host {HOST}: key '") and "; allowed: " in line


@pytest.mark.parametrize("name, fragment", [
    ("../../etc/cron.d/x", "a path"),
    ("gpu-a01;reboot", "shell metacharacter ';'"),
    ("gpu-а01", "U+0430 CYRILLIC SMALL LETTER A"),
    ("gpu a01", "whitespace"),
])
def test_host_names_that_would_become_paths_or_shell(name, fragment):
    with pytest.raises(InventoryError) as info:
        validate_inventory(Inventory(([(name, {"tier": "dev"})], {})))
    (line,) = info.value.problems
    assert "key 'host name': " in line and fragment in line and "\n" not in line


@pytest.mark.parametrize("name", ["gpu-a01.example.internal", "10.0.0.7", "fd00::7", "@docker/0123abcd"])
def test_usual_host_names_pass(name):
    validate_inventory(Inventory(([(name, {"tier": "dev"})], {})))
