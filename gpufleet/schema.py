"""Per-key value checks for gpufleet settings.

Each check takes the raw value from tiers.yaml or the inventory and returns the normalised value,
or raises BadValue with the problem and the allowed values. Version keys are checked against
compat.yaml, so no version literal lives here.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping

from .compat import compat_data
from .gpus import model_names
from .tiers import tier_names
from .versions import is_version, normalise_branch, parse

NONE = "none"
AUTO = "auto"


class BadValue(ValueError):
    def __init__(self, problem: str, allowed: str):
        super().__init__(problem)
        self.problem = problem
        self.allowed = allowed


Check = Callable[[Any], Any]


@dataclass(frozen=True)
class KeySpec:
    check: Check
    allowed: Callable[[], str]  # lazily computed (some lists come from the YAML data)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _enum(*choices: str) -> KeySpec:
    allowed = " | ".join(choices)

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise BadValue(f"expected one of the strings, got {_type_name(value)} {value!r}", allowed)
        if value not in choices:
            raise BadValue(f"unknown value {value!r}", allowed)
        return value

    return KeySpec(check, lambda: allowed)


def _bool() -> KeySpec:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise BadValue(f"expected a boolean, got {_type_name(value)} {value!r}", "true | false")
        return value

    return KeySpec(check, lambda: "true | false")


def _int(minimum: int, maximum: int | None = None) -> KeySpec:
    allowed = f"integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else "")

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadValue(f"expected an integer, got {_type_name(value)} {value!r}", allowed)
        if value < minimum or (maximum is not None and value > maximum):
            raise BadValue(f"{value} out of range", allowed)
        return value

    return KeySpec(check, lambda: allowed)


def _str_list(item_check: Callable[[Any], Any] | None = None, allowed: str = "list of strings") -> KeySpec:
    def check(value: Any) -> tuple[Any, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise BadValue(f"expected a list, got {_type_name(value)} {value!r}", allowed)
        out = []
        for item in value:
            if not isinstance(item, str) and item_check is None:
                raise BadValue(f"list item {item!r} is a {_type_name(item)}, not a string", allowed)
            out.append(item_check(item) if item_check else item)
        return tuple(out)

    return KeySpec(check, lambda: allowed)


def _text(pattern: str, allowed: str) -> KeySpec:
    regex = re.compile(pattern)

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise BadValue(f"expected a string, got {_type_name(value)} {value!r}", allowed)
        if not regex.fullmatch(value):
            raise BadValue(f"malformed value {value!r}", allowed)
        return value

    return KeySpec(check, lambda: allowed)


# --- keys whose allowed values come from compat.yaml / tiers.yaml ---------------------------


def _check_tier(value: Any) -> str:
    names = tier_names()
    if not isinstance(value, str) or value not in names:
        raise BadValue(f"unknown tier {value!r}", ", ".join(names))
    return value


def _branches_allowed() -> str:
    return "auto, " + ", ".join(sorted(compat_data().usable_branches, key=int))


def _check_branch(value: Any) -> str:
    if value == AUTO:
        return AUTO
    branch = normalise_branch(value)
    data = compat_data()
    if branch is None:
        raise BadValue(f"expected a branch such as \"580\" or auto, got {_type_name(value)} {value!r}", _branches_allowed())
    info = data.driver_branches.get(branch)
    if info is None:
        raise BadValue(f"driver branch R{branch} is not in the compatibility data", _branches_allowed())
    if not info.usable:
        raise BadValue(f"driver branch R{branch} has unverified data ({info.note})", _branches_allowed())
    return branch


def _check_driver_version(value: Any) -> str:
    if value == AUTO:
        return AUTO
    if not is_version(value) or value.count(".") < 1:
        raise BadValue(f"expected a full driver version such as \"580.95.05\" or auto, got {value!r}", "auto | a version listed in compat.yaml")
    return value  # that it is listed for the branch is a cross-key check (settings.py)


def _cuda_allowed() -> str:
    return "none, " + ", ".join(sorted(compat_data().cuda_releases, key=parse, reverse=True))


def _check_cuda(value: Any) -> str:
    if value == NONE:
        return NONE
    if isinstance(value, float):
        raise BadValue(f"CUDA version given as a number {value!r}; quote it (\"{value}\")", _cuda_allowed())
    if not isinstance(value, str) or value not in compat_data().cuda_releases:
        raise BadValue(f"CUDA {value!r} is not in the compatibility data", _cuda_allowed())
    return value


def _cudnn_allowed() -> str:
    return "none, " + ", ".join(compat_data().cudnn_versions)


def _check_cudnn(value: Any) -> str:
    if value == NONE:
        return NONE
    if not is_version(value):
        raise BadValue(f"expected a quoted cuDNN version, got {_type_name(value)} {value!r}", _cudnn_allowed())
    known = compat_data().cudnn_versions
    if value in known:
        return value
    # "9.17" means the newest 9.17.x release in the data
    matches = [v for v in known if v.startswith(value + ".")]
    if matches:
        return matches[0]
    raise BadValue(f"cuDNN {value!r} is not in the compatibility data", _cudnn_allowed())


_CLOCK_ALLOWED = "max | default | unmanaged | {memory: MHz, graphics: MHz}"


def _check_clock(value: Any) -> Any:
    if isinstance(value, str):
        if value in ("max", "default", "unmanaged"):
            return value
        raise BadValue(f"unknown clock policy {value!r}", _CLOCK_ALLOWED)
    if isinstance(value, Mapping):
        if set(value) != {"memory", "graphics"}:
            raise BadValue(f"clock pair needs exactly the keys memory and graphics, got {sorted(value)}", _CLOCK_ALLOWED)
        for part in ("memory", "graphics"):
            item = value[part]
            if isinstance(item, bool) or not isinstance(item, int) or item <= 0:
                raise BadValue(f"clock {part} must be a positive integer MHz, got {item!r}", _CLOCK_ALLOWED)
        return MappingProxyType({"memory": value["memory"], "graphics": value["graphics"]})
    raise BadValue(f"expected a policy name or a clock pair, got {_type_name(value)} {value!r}", _CLOCK_ALLOWED)


def _nccl_allowed() -> str:
    return " | ".join(compat_data().nccl_profiles)


def _check_nccl(value: Any) -> str:
    if not isinstance(value, str) or value not in compat_data().nccl_profiles:
        raise BadValue(f"unknown NCCL profile {value!r}", _nccl_allowed())
    return value


def _check_omp(value: Any) -> Any:
    allowed = "auto | integer >= 1"
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadValue(f"expected auto or an integer, got {_type_name(value)} {value!r}", allowed)
    if value < 1:
        raise BadValue(f"{value} out of range", allowed)
    return value


def _check_alloc_conf(value: Any) -> str:
    options = compat_data().pytorch_alloc_options
    allowed = "empty, or option:value[,option:value] with options " + ", ".join(options)
    if not isinstance(value, str):
        raise BadValue(f"expected a string, got {_type_name(value)} {value!r}", allowed)
    if value == "":
        return value
    # roundup_power2_divisions may carry a bracketed list with commas: split outside brackets only
    parts = re.split(r",(?![^\[]*\])", value)
    for part in parts:
        name, sep, setting = part.partition(":")
        if not sep or not setting:
            raise BadValue(f"malformed entry {part!r}", allowed)
        if name.strip() not in options:
            raise BadValue(f"unknown PyTorch allocator option {name.strip()!r}", allowed)
    return value


def _check_ulimits(value: Any) -> Mapping[str, int]:
    allowed = "mapping of ulimit name to integer (-1 = unlimited), e.g. {memlock: -1, stack: 67108864}"
    if not isinstance(value, Mapping):
        raise BadValue(f"expected a mapping, got {_type_name(value)} {value!r}", allowed)
    for name, limit in value.items():
        if not isinstance(name, str) or not re.fullmatch(r"[a-z]+", name):
            raise BadValue(f"bad ulimit name {name!r}", allowed)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < -1:
            raise BadValue(f"ulimit {name} must be an integer >= -1, got {limit!r}", allowed)
    return MappingProxyType(dict(value))


def _check_port(item: Any) -> str:
    allowed = "list of \"port/proto\" strings (proto tcp or udp) or integers 1-65535"
    if isinstance(item, int) and not isinstance(item, bool):
        item = f"{item}/tcp"
    if not isinstance(item, str):
        raise BadValue(f"bad port {item!r}", allowed)
    match = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?/(tcp|udp)", item)
    if not match or not all(1 <= int(p) <= 65535 for p in match.groups()[:2] if p):
        raise BadValue(f"bad port {item!r}", allowed)
    return item


def _check_login_name(item: Any) -> str:
    # sshd AllowUsers/AllowGroups patterns: names with ? and * wildcards, optional @host
    if not isinstance(item, str) or not re.fullmatch(r"[A-Za-z0-9._*?!%-][A-Za-z0-9._*?!@%/-]*", item):
        raise BadValue(f"bad name {item!r}", "user or group names (sshd patterns)")
    return item


def _check_cidr(item: Any) -> str:
    try:
        return str(ipaddress.ip_network(item, strict=False))
    except (TypeError, ValueError):
        raise BadValue(f"bad network {item!r}", "list of CIDRs such as 10.0.0.0/16") from None


def _check_gpu_model(item: Any) -> str:
    if not isinstance(item, str) or item not in model_names():
        raise BadValue(f"unknown GPU model {item!r}", "nvidia-smi names from compat.yaml: " + ", ".join(model_names()))
    return item


def _check_gpu_count(value: Any) -> tuple[int, int]:
    allowed = "an integer >= 1, or [min, max]"
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise BadValue(f"{value} out of range", allowed)
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        low, high = value
        if 1 <= low <= high:
            return (low, high)
    raise BadValue(f"bad GPU count {value!r}", allowed)


def _os_allowed() -> str:
    data = compat_data()
    return ", ".join(sorted(set(data.nvidia_repo["os_dirs"]) | set(data.distro_offers)))


def _check_os(value: Any) -> str:
    data = compat_data()
    if not isinstance(value, str) or (value not in data.nvidia_repo["os_dirs"] and value not in data.distro_offers):
        raise BadValue(f"unknown OS release {value!r}", _os_allowed())
    return value


_URL = _text(r"(https?|file)://\S+", "an http(s):// or file:// URL")
_PRESENCE = _enum("required", "absent", "any")

#: Every gpufleet setting, in the order plan views print them.
KEYS: Mapping[str, KeySpec] = MappingProxyType(
    {
        "tier": KeySpec(_check_tier, lambda: ", ".join(tier_names())),
        "tier_mismatch": _enum("warn", "fail"),
        "driver_source": _enum("nvidia", "distro"),
        "driver_branch": KeySpec(_check_branch, _branches_allowed),
        "driver_version": KeySpec(_check_driver_version, lambda: "auto | a version listed in compat.yaml"),
        "driver_flavour": _enum("open", "proprietary", "auto"),
        "driver_reboot": _enum("never", "if-idle", "allowed"),
        "driver_repo_url": _URL,
        "driver_persistence": _enum("daemon", "legacy", "off"),
        "driver_hold": _bool(),
        "driver_repo_keyring_url": _text(r"auto|(https?|file)://\S+", "auto or an http(s):// or file:// URL"),
        "driver_repo_key_fingerprint": _text(r"auto|[0-9A-F]{40}", "auto or a 40-digit upper-case hex OpenPGP fingerprint"),
        "driver_kernel_headers": _enum("require", "skip"),
        "driver_module_signing_key": _text(r"none|/\S+", "none or the absolute path of the MOK private key on the host"),
        "driver_reboot_force": _bool(),
        "driver_dcgm": _bool(),
        "cuda_version": KeySpec(_check_cuda, _cuda_allowed),
        "cuda_driver_compat": _enum("toolkit", "minor"),
        "cudnn_version": KeySpec(_check_cudnn, _cudnn_allowed),
        "clock_policy": KeySpec(_check_clock, lambda: _CLOCK_ALLOWED),
        "nccl_profile": KeySpec(_check_nccl, _nccl_allowed),
        "docker_source": _enum("docker", "distro"),
        "docker_default_runtime": _enum("nvidia", "runc"),
        "docker_cdi": _bool(),
        "docker_shm_size": _text(r"\d+[bkmg]?", "size such as 64m, 1g, 64g"),
        "docker_ulimits": KeySpec(_check_ulimits, lambda: "mapping such as {memlock: -1, stack: 67108864}"),
        "docker_repo_url": _URL,
        "docker_repo_fingerprint": _text(r"[0-9A-F]{40}", "40 upper-case hex digits (OpenPGP fingerprint, no spaces)"),
        "docker_toolkit_repo_url": _URL,
        "docker_toolkit_repo_fingerprint": _text(r"[0-9A-F]{40}", "40 upper-case hex digits (OpenPGP fingerprint, no spaces)"),
        "docker_toolkit_version": _text(r"\d+\.\d+\.\d+(-\d+)?", "a container toolkit package version such as 1.18.0-1"),
        "docker_smoke_image": _text(r"none|[a-z0-9][\w.\-/:@]*", "none, or an image reference such as ubuntu:24.04"),
        "docker_live_restore": _bool(),
        "docker_restart_with_gpu_containers": _enum("never", "live-restore", "always"),
        "tuning_omp_threads": KeySpec(_check_omp, lambda: "auto | integer >= 1"),
        "tuning_pytorch_alloc_conf": KeySpec(_check_alloc_conf, lambda: "option:value[,option:value]"),
        "tuning_nccl_debug_vars": _bool(),
        "tuning_nccl_socket_ifname": _text(r"auto|[=^]?[\w.\-]+(,[\w.\-]+)*", "auto or an NCCL interface list such as =eth0"),
        "tuning_nccl_ib_hca": _text(r"auto|[=^]?[\w\-]+(:\d+)*(,[\w\-]+(:\d+)*)*", "auto or an HCA list such as =mlx5_0,mlx5_1"),
        "tuning_cpu_governor": _enum("performance", "schedutil", "ondemand", "unmanaged"),
        "hardening_permit_root_login": _enum("no", "prohibit-password"),
        "hardening_password_auth": _bool(),
        "hardening_allow_users": _str_list(_check_login_name, "list of user names"),
        "hardening_allow_groups": _str_list(_check_login_name, "list of group names"),
        "hardening_max_auth_tries": _int(1, 10),
        "hardening_login_grace_time": _int(5, 600),
        "hardening_extra_kex": _str_list(allowed="list of OpenSSH KexAlgorithms names"),
        "hardening_tcp_forwarding": _bool(),
        "hardening_agent_forwarding": _bool(),
        "hardening_x11_forwarding": _bool(),
        "hardening_moduli_min_bits": _int(2048, 8192),
        "hardening_unattended_upgrades": _bool(),
        "firewall_enabled": _bool(),
        "firewall_open_ports": _str_list(_check_port, "list of \"port/proto\" strings or integers"),
        "firewall_trusted_cidrs": _str_list(_check_cidr, "list of CIDRs"),
        "firewall_revert_after": _int(10, 3600),
        "hardening_sshd_revert_after": _int(10, 3600),
        "rollout_batch_size": _int(1),
        "rollout_require_idle": _bool(),
        "rollout_snapshot": _enum("none", "lvm", "btrfs", "zfs", "command"),
        "rollout_snapshot_target": _text(r"|[\w./@:\-]+", "empty, or an LVM vg/lv, a btrfs subvolume path or a ZFS dataset"),
        "rollout_snapshot_size": _text(r"\d+[KMGTkmgt]?", "LVM snapshot size such as 10G"),
        "rollout_snapshot_command": _str_list(allowed="argv list run on the controller; {host} {address} {snapshot} {tier} are filled in"),
        "validate_os_release": KeySpec(_check_os, _os_allowed),
        "validate_gpu_models": _str_list(_check_gpu_model, "list of nvidia-smi names from compat.yaml"),
        "validate_gpu_count": KeySpec(_check_gpu_count, lambda: "an integer >= 1, or [min, max]"),
        "validate_nvswitch": _PRESENCE,
        "validate_nvlink": _PRESENCE,
        "validate_rdma": _PRESENCE,
        "validate_min_ram_gb": _int(0),
        "validate_min_nic_gbps": _int(0),
        "extra_packages": _str_list(allowed="list of package names"),
    }
)
