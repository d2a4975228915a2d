"""End-to-end: bad input is refused with one line naming the host (or file) and the key, the
command exits non-zero, and the host is byte-for-byte unchanged.

One test host for the whole module. A marker file is written on it once, before the first case;
after every case `find /etc /usr /var/lib/dpkg -newer MARKER` must print nothing (checked over
SSH, on the host itself). Each case is its own run of the real pyinfra CLI (or of a tool) against
its own inventory. Most are refused when deploys/all.py validates the inventory, before any
operation is planned; the malformed daemon.json is refused at planning time from the host's
facts (deploys/docker.py), which must leave the host alone too.

The GPU is SIMULATED (testing/gpusim, a test double): one T4, tier dev.
The grammar of every key is unit-tested in tests/unit/test_schema_grammar.py; this module proves
a refusal from the command line really leaves the host alone.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from testing import testhosts
from testing.inventory import environment_data, inventory_source
from tests.e2e.pyinfra_cli import PYINFRA, REPO, pyinfra

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]

MARKER = "/root/gpufleet-bad-input.marker"
WATCHED = "/etc /usr /var/lib/dpkg"
MALFORMED_DAEMON_JSON = '{\n  "log-driver": "json-file",\n}\n'


@pytest.fixture(scope="module")
def host(hostpool):
    (h,) = hostpool.get("bad-input", 1, release="bookworm", gpu="t4")
    # The malformed daemon.json is there for the daemon.json case; every other case is refused
    # before the docker deploy reads it. Then the marker: nothing under WATCHED may be newer.
    testhosts.ssh(h, "mkdir -p /etc/docker && printf '%s' '" + MALFORMED_DAEMON_JSON + "' > /etc/docker/daemon.json"
                  f" && sleep 1 && touch {MARKER} && sleep 1")
    assert _changed(h) == [], "the test host changes files by itself"
    return h


def _changed(host) -> list[str]:
    out = testhosts.ssh(host, f"find {WATCHED} -newer {MARKER} 2>/dev/null || true").stdout
    return out.split()


def _inventory(host, tmp_path: Path, overrides: dict, text: str | None = None) -> Path:
    path = tmp_path / "inventory.py"
    data = {**environment_data(host, "dev"), **overrides}
    path.write_text(text if text is not None else inventory_source([host], data={host.name: data}))
    return path


def _one_line(output: str, prefix: str, fragment: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip().startswith(prefix)]
    assert lines, f"no line starting {prefix!r}:\n{output[-3000:]}"
    assert any(fragment in line for line in lines), f"{fragment!r} not in {lines}"
    return lines[0]


# --- refused when the inventory is validated (one pyinfra run each) -------------------------------

CYR_E, CYR_O = "\u0435", "\u043e"  # Cyrillic е and о, look-alikes of Latin e and o

CASES = [
    # (id, overrides, key, fragment of the refusal)
    # typos
    ("typo-tier", {"tier": "dve"}, "tier", "unknown tier 'dve' (did you mean 'dev'?)"),
    ("typo-key", {"cuda_verison": "13.0"}, "cuda_verison", "did you mean 'cuda_version'?"),
    ("typo-key-2", {"driver_reboot_forse": True}, "driver_reboot_forse", "did you mean 'driver_reboot_force'?"),
    ("typo-enum", {"driver_reboot": "if_idle"}, "driver_reboot", "unknown value 'if_idle'"),
    ("typo-docker-source", {"docker_source": "dockre"}, "docker_source", "allowed: docker | distro"),
    # wrong types
    ("type-str-for-int", {"rollout_batch_size": "2"}, "rollout_batch_size", "expected an integer, got str"),
    ("type-str-for-bool", {"driver_hold": "yes"}, "driver_hold", "expected a boolean"),
    ("type-float-cuda", {"cuda_version": 12.8}, "cuda_version", "quote it"),
    ("type-str-for-list", {"extra_packages": "nvtop"}, "extra_packages", "expected a list, got str"),
    ("type-list-for-policy", {"clock_policy": ["max"]}, "clock_policy", "expected a policy name or a clock pair"),
    ("type-list-for-mapping", {"docker_ulimits": [["memlock", -1]]}, "docker_ulimits", "expected a mapping"),
    # negative and huge numbers
    ("negative-revert", {"firewall_revert_after": -1}, "firewall_revert_after", "out of range"),
    ("huge-batch", {"rollout_batch_size": 10 ** 30}, "rollout_batch_size", "out of range"),
    ("negative-ram", {"validate_min_ram_gb": -5}, "validate_min_ram_gb", "out of range"),
    ("zero-auth-tries", {"hardening_max_auth_tries": 0}, "hardening_max_auth_tries", "out of range"),
    ("huge-omp", {"tuning_omp_threads": 10 ** 9}, "tuning_omp_threads", "out of range"),
    ("huge-ulimit", {"docker_ulimits": {"nofile": 2 ** 64}}, "docker_ulimits", "from -1 to 2^63-1"),
    ("small-moduli", {"hardening_moduli_min_bits": 1024}, "hardening_moduli_min_bits", "out of range"),
    ("negative-clock", {"clock_policy": {"memory": -1, "graphics": 1000}}, "clock_policy", "integer MHz"),
    ("huge-shm", {"docker_shm_size": "99999999999999999g"}, "docker_shm_size", "out of range"),
    # shell metacharacters
    ("meta-url-substitution", {"driver_repo_url": "https://mirror.example/$(reboot)"}, "driver_repo_url", "shell metacharacter '$'"),
    ("meta-url-backtick", {"docker_repo_url": "https://mirror.example/`id`"}, "docker_repo_url", "shell metacharacter '`'"),
    ("meta-url-quote", {"docker_toolkit_repo_url": "https://mirror.example/';reboot;'"}, "docker_toolkit_repo_url", "shell metacharacter \"'\""),
    ("meta-url-newline", {"driver_repo_keyring_url": "https://mirror.example/k.gpg\nreboot"}, "driver_repo_keyring_url", "control character '\\n'"),
    ("meta-signing-key", {"driver_module_signing_key": "/root/mok.priv; rm -rf /"}, "driver_module_signing_key", "shell metacharacter ';'"),
    ("meta-alloc-conf", {"tuning_pytorch_alloc_conf": "expandable_segments:True$(reboot)"}, "tuning_pytorch_alloc_conf", "shell metacharacter '$'"),
    ("meta-kex", {"hardening_extra_kex": ["curve25519-sha256;reboot"]}, "hardening_extra_kex", "shell metacharacter ';'"),
    ("meta-package", {"extra_packages": ["nvtop", "htop && reboot"]}, "extra_packages", "shell metacharacter '&'"),
    ("meta-ifname", {"tuning_nccl_socket_ifname": "=eth0`id`"}, "tuning_nccl_socket_ifname", "shell metacharacter '`'"),
    ("meta-hca", {"tuning_nccl_ib_hca": "=mlx5_0|reboot"}, "tuning_nccl_ib_hca", "shell metacharacter '|'"),
    ("meta-user", {"hardening_allow_users": ['ops"x']}, "hardening_allow_users", "shell metacharacter '\"'"),
    ("meta-snapshot-command", {"rollout_snapshot_command": ["cloudctl", "$(reboot)"]}, "rollout_snapshot_command", "shell metacharacter '$'"),
    ("meta-image", {"docker_smoke_image": "ubuntu:24.04;reboot"}, "docker_smoke_image", "shell metacharacter ';'"),
    ("meta-snapshot-target", {"rollout_snapshot_target": "vg0/root>x"}, "rollout_snapshot_target", "shell metacharacter '>'"),
    ("meta-shm-size", {"docker_shm_size": "1g'"}, "docker_shm_size", "shell metacharacter \"'\""),
    # path traversal
    ("traversal-signing-key", {"driver_module_signing_key": "/var/lib/shim-signed/../../../etc/shadow"}, "driver_module_signing_key", "path traversal"),
    ("traversal-snapshot-target", {"rollout_snapshot_target": "../../etc"}, "rollout_snapshot_target", "path traversal"),
    ("traversal-url", {"driver_repo_url": "https://mirror.example/../../etc"}, "driver_repo_url", "the path contains '..'"),
    # unicode look-alikes
    ("lookalike-tier", {"tier": f"d{CYR_E}v"}, "tier", "U+0435 CYRILLIC SMALL LETTER IE"),
    ("lookalike-package", {"extra_packages": [f"nvt{CYR_O}p"]}, "extra_packages", "U+043E CYRILLIC SMALL LETTER O"),
    ("lookalike-enum", {"driver_flavour": f"{CYR_O}pen"}, "driver_flavour", "U+043E CYRILLIC SMALL LETTER O"),
    ("lookalike-digits", {"cuda_version": "\uff11\uff13.\uff10"}, "cuda_version", "U+FF11 FULLWIDTH DIGIT ONE"),
    ("lookalike-key", {f"cuda_v{CYR_E}rsion": "13.0"}, f"cuda_v{CYR_E}rsion", "U+0435 CYRILLIC SMALL LETTER IE"),
    # very long strings
    ("long-url", {"driver_repo_url": "https://mirror.example/" + "a" * 5000}, "driver_repo_url", "too long (at most 1024 characters)"),
    ("long-package", {"extra_packages": ["a" * 300]}, "extra_packages", "not a Debian package name"),
    ("long-user", {"hardening_allow_users": ["u" * 2000]}, "hardening_allow_users", "too long"),
    # each key's own grammar
    ("package-uppercase", {"extra_packages": ["Nvtop"]}, "extra_packages", "not a Debian package name"),
    ("package-version", {"extra_packages": ["nvtop=latest"]}, "extra_packages", "not a Debian version"),
    ("kex-weak", {"hardening_extra_kex": ["diffie-hellman-group1-sha1"]}, "hardening_extra_kex", "weak key exchange"),
    ("alloc-conf-value", {"tuning_pytorch_alloc_conf": "garbage_collection_threshold:1.5"}, "tuning_pytorch_alloc_conf", "strictly between 0.0 and 1.0"),
    ("cidr-host-bits", {"firewall_trusted_cidrs": ["10.0.0.1/8"]}, "firewall_trusted_cidrs", "did you mean 10.0.0.0/8?"),
    ("port-range", {"firewall_open_ports": ["6819-6817/tcp"]}, "firewall_open_ports", "second port must be higher"),
    ("port-twice", {"firewall_open_ports": [22, "22/tcp"]}, "firewall_open_ports", "listed twice"),
    ("url-credentials", {"driver_repo_url": "https://user:token@mirror.example/cuda"}, "driver_repo_url", "carries credentials"),
    ("url-scheme", {"driver_repo_url": "file:///srv/mirror"}, "driver_repo_url", "scheme must be http or https"),
    ("ifname-too-long", {"tuning_nccl_socket_ifname": "=averyveryverylongname0"}, "tuning_nccl_socket_ifname", "malformed value"),
    # conflicting overrides
    ("conflict-pin-without-branch", {"driver_source": "nvidia", "driver_branch": "auto", "driver_version": "580.126.09",
                                     "validate_gpu_models": []}, "driver_version", "needs an explicit driver_branch"),
    ("conflict-rdma-profile", {"nccl_profile": "ib", "validate_rdma": "absent"}, "nccl_profile", "needs RDMA but validate_rdma is absent"),
    ("conflict-snapshot-target", {"rollout_snapshot": "lvm", "rollout_snapshot_target": "/"}, "rollout_snapshot_target", "does not name a lvm snapshot target"),
    ("conflict-snapshot-command", {"rollout_snapshot": "command"}, "rollout_snapshot_command", "the command is empty"),
]


@pytest.mark.parametrize("overrides, key, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_at_planning_time(host, tmp_path, overrides, key, fragment):
    run = pyinfra(_inventory(host, tmp_path, overrides), "deploys/all.py")
    assert run.returncode != 0, run.output[-3000:]
    _one_line(run.output, f"host {host.name}: key '{key}': ", fragment)
    assert "--> Beginning operation run" not in run.output and "Traceback" not in run.output
    assert _changed(host) == []


INJECTIONS = {"quote": "'", "double-quote": '"', "command-substitution": "$(reboot)", "backtick": "`reboot`",
              "semicolon": ";reboot", "newline": "\nreboot"}


@pytest.mark.parametrize("injection", list(INJECTIONS.values()), ids=list(INJECTIONS))
def test_every_setting_refuses_the_injection_from_the_command_line(host, tmp_path, injection):
    # Every key of tiers.yaml at once, each its dev default with the injection appended (in a
    # list: to the first item; in a mapping: to the first name), then the tier on its own (a bad
    # tier stops a host's validation before its other keys).
    from gpufleet.config.schema import KEYS
    from gpufleet.catalog.tiers import tier_defaults

    def injected(value):
        if hasattr(value, "items"):
            name, limit = next(iter(value.items()))
            return {name + injection: limit}
        if isinstance(value, (list, tuple)):
            return [f"{value[0] if value else 'x'}{injection}", *list(value)[1:]]
        return f"{value}{injection}"

    keys = [key for key in KEYS if key != "tier"]
    run = pyinfra(_inventory(host, tmp_path, {key: injected(tier_defaults("dev")[key]) for key in keys}), "deploys/all.py")
    assert run.returncode != 0
    for key in keys:
        _one_line(run.output, f"host {host.name}: key '{key}': ", "shell metacharacter" if injection != "\nreboot"
                  else "control character")
    run = pyinfra(_inventory(host, tmp_path, {"tier": injected("dev")}), "deploys/all.py")
    assert run.returncode != 0
    _one_line(run.output, f"host {host.name}: key 'tier': ", "unknown tier")
    assert _changed(host) == []


def test_groups_that_disagree_on_the_tier(host, tmp_path):
    data = {k: v for k, v in environment_data(host, "dev").items() if k != "tier"}
    text = (f"pod = ([({host.name!r}, {{**{host.pyinfra_data()!r}, **{data!r}}})], {{'tier': 'hgx'}})\n"
            f"dev_boxes = ([{host.name!r}], {{'tier': 'dev'}})\n")
    run = pyinfra(_inventory(host, tmp_path, {}, text), "deploys/all.py")
    assert run.returncode != 0
    _one_line(run.output, f"host {host.name}: key 'tier': ", "groups set different tiers (group pod: 'hgx', group dev_boxes: 'dev')")
    assert _changed(host) == []


def test_host_name_that_would_become_a_controller_path(host, tmp_path):
    data = {**host.pyinfra_data(), **environment_data(host, "dev")}
    text = f"test_hosts = [('../../etc/cron.d/gpufleet', {data!r})]\n"
    run = pyinfra(_inventory(host, tmp_path, {}, text), "deploys/all.py")
    assert run.returncode != 0
    _one_line(run.output, "host ../../etc/cron.d/gpufleet: key 'host name': ", "a path: '/' only in pyinfra connector names")
    assert _changed(host) == []


def test_top_level_data_pyinfra_would_ignore(host, tmp_path):
    inventory = _inventory(host, tmp_path, {})
    inventory.write_text(inventory.read_text() + '\ncuda_version = "12.8"  # meant for every host\n')
    run = pyinfra(inventory, "deploys/all.py")
    assert run.returncode != 0
    _one_line(run.output, f"inventory {inventory}: key 'cuda_version': ", "top-level data that pyinfra ignores")
    assert _changed(host) == []


# --- refused from the host's facts: deploys/docker.py at planning time -----------------------------


def test_malformed_daemon_json_stops_the_host_unchanged(host, tmp_path):
    run = pyinfra(_inventory(host, tmp_path, {}), "deploys/all.py")
    assert run.returncode != 0
    _one_line(run.output, f"[{host.name}] refused (docker daemon.json): ",
              "/etc/docker/daemon.json is malformed: invalid JSON at line 3")
    _one_line(run.output, f"[{host.name}] refused (docker daemon.json): ", "Fix: fix or remove the file, then re-run")
    assert "--> Beginning operation run" not in run.output
    assert testhosts.ssh(host, "cat /etc/docker/daemon.json").stdout == MALFORMED_DAEMON_JSON
    assert _changed(host) == []


# --- the tools' arguments ---------------------------------------------------------------------------

TOOL_CASES = [
    # (id, tool, arguments ({inv} = a valid inventory), fragment of the refusal)
    ("rollout-mistyped-inventory", "rollout", ["inventories/clod.py", "--driver-version", "580.126.09", "--dry-run"],
     "argument inventory: no such inventory file: inventories/clod.py"),
    ("rollout-negative-canary", "rollout", ["{inv}", "--driver-version", "580.126.09", "--canary", "-1", "--dry-run"],
     "argument --canary: -1 out of range"),
    ("rollout-zero-batch", "rollout", ["{inv}", "--driver-version", "580.126.09", "--batch-size", "0", "--dry-run"],
     "argument --batch-size: 0 out of range"),
    ("rollout-max-fail", "rollout", ["{inv}", "--driver-version", "580.126.09", "--max-fail", "200%", "--dry-run"],
     "argument --max-fail"),
    ("rollback-mistyped-inventory", "rollback", ["inventories/clod.py", "gpu-a01", "--dry-run"],
     "argument inventory: no such inventory file: inventories/clod.py"),
    ("fleet-report-mistyped-inventory", "fleet-report", ["inventories/clod.py", "--no-drift"],
     "no such inventory file: inventories/clod.py"),
    ("fleet-report-zero-workers", "fleet-report", ["{inv}", "--workers", "0"], "argument --workers: 0 out of range"),
    ("rollout-empty-inventory", "rollout", ["{empty}", "--dry-run"], "has no hosts: nothing to roll out"),
]


@pytest.mark.parametrize("tool, args, fragment", [c[1:] for c in TOOL_CASES], ids=[c[0] for c in TOOL_CASES])
def test_tool_arguments_are_refused(host, tmp_path, tool, args, fragment):
    inventory = _inventory(host, tmp_path, {})
    empty = tmp_path / "empty.py"
    empty.write_text("gpu_hosts = []  # a group with no hosts\n")
    given = {"{inv}": str(inventory), "{empty}": str(empty)}
    argv = [str(REPO / "tools" / tool), *[given.get(a, a) for a in args]]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    # argparse refuses on stderr; the rollout's own checks print in its progress log (stdout)
    line = [ln for ln in (proc.stderr + proc.stdout).splitlines() if fragment in ln]
    assert line, proc.stdout + proc.stderr
    assert _changed(host) == []


# --- last: the check above can fail ----------------------------------------------------------------


def test_zz_a_real_change_is_seen_by_the_check(host, tmp_path):
    # Runs last (pytest keeps file order): it changes the host on purpose, through pyinfra.
    inventory = _inventory(host, tmp_path, {})
    proc = subprocess.run([str(PYINFRA), "-y", str(inventory), "exec", "--",
                           "touch", "/etc/gpufleet-bad-input-control"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "/etc/gpufleet-bad-input-control" in _changed(host)
