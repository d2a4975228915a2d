"""SSH hardening, host firewall and security updates, without ever cutting off the operator.

Story of a host, part 5 (last, so that it cannot cut off the steps before it):

1. **SSH** keys only, root by key only, short grace time, no forwarding/X11, the inventory's
   AllowUsers/AllowGroups, and algorithms chosen for the host's OpenSSH version:
   post-quantum hybrids first (mlkem768x25519-sha256 on 9.9+, sntrup761x25519 on 8.5+),
   then the classic curve25519 kex that paramiko 4 (pyinfra, testinfra) still needs,
   encrypt-then-MAC MACs only, Ed25519/RSA host keys only, moduli below 3072 bits removed.
   The drop-in 00-gpufleet-hardening.conf sorts first, so it wins over cloud-init's
   50-cloud-init.conf; the effective result is checked with `sshd -T`.
2. **Lock-out protection**: no key for the connecting user or an allowed user -> the host
   fails before anything changes; `sshd -t` judges the candidate before any reload; after
   the reload a fresh login as the deploy user (paramiko, like pyinfra) must work, or the
   previous drop-in is restored and reloaded and the host fails with a clear message.
3. **Firewall**: /etc/nftables.conf holds only gpufleet's `inet gpufleet` table (inbound
   default-deny except loopback, established, ICMP essentials, SSH and the tier's ports),
   checked with `nft -c`, loaded atomically behind a 60 s dead-man switch that a fresh SSH
   login disarms. Docker's tables and forwarding are left alone. Hosts that cannot load
   rules (containers) get the file written and checked, and are told so.
4. **Security updates**: unattended-upgrades on, GPU packages blacklisted
   (GPU_PACKAGE_BLACKLIST, shared with the driver deploy).
"""
from __future__ import annotations

import ipaddress
import re
from io import StringIO
from pathlib import Path

import jinja2
from pyinfra import host
from pyinfra.api import deploy
from pyinfra.api.exceptions import DeployError
from pyinfra.facts.files import File
from pyinfra.operations import apt, files, systemd

from facts.nftables import TABLE, NftablesCapability
from facts.ssh import SshdEffectiveConfig, SshdVersion
from operations import nftables, ssh
from operations.ssh import connecting_user

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
SSHD_DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
NFTABLES_CONF = "/etc/nftables.conf"
UNATTENDED_CONF = "/etc/apt/apt.conf.d/51gpufleet-unattended-upgrades"
NFTABLES_UNIT_DROPIN = "/etc/systemd/system/nftables.service.d/gpufleet.conf"

# Packages unattended-upgrades must never touch: driver, CUDA, cuDNN, NCCL, Fabric Manager and
# the container toolkit move together, on gpufleet's schedule. Python regular expressions
# matched at the start of the package name (unattended-upgrades' Package-Blacklist).
# The driver deploy imports this list: keep it the only copy.
GPU_PACKAGE_BLACKLIST = (
    "^nvidia-",                   # nvidia-driver, nvidia-kernel-*, nvidia-persistenced, ...
    "^libnvidia-",                # libnvidia-compute, libnvidia-container1, ...
    "^cuda",                      # cuda-toolkit-*, cuda-drivers, cuda-compat-*
    "^libcuda",                   # libcuda1 (Debian), libcudart*
    "^cudnn",                     # cudnn9-cuda-13 metapackages
    "^libcudnn",                  # libcudnn9-cuda-13
    "^libnccl",                   # libnccl2, libnccl-dev
    "^nvidia-fabricmanager",      # Fabric Manager must equal the driver version exactly
    "^nvidia-container-toolkit",  # container toolkit and its base package
    "^firmware-nvidia-",          # Debian's GSP firmware follows the driver
    "^xserver-xorg-video-nvidia", # Debian's X driver follows the driver
)

DEFAULTS = {
    # sshd PermitRootLogin: root may log in with a key only (the deploy often connects as root).
    "hardening_permit_root_login": "prohibit-password",
    # Password and keyboard-interactive logins: off, keys only (brute force has nothing to try).
    "hardening_password_auth": False,
    # sshd AllowUsers: only these users may log in (empty: no restriction). Each needs a key.
    "hardening_allow_users": [],
    # sshd AllowGroups: only members of these groups may log in (empty: no restriction).
    "hardening_allow_groups": [],
    # sshd MaxAuthTries: 3 keys/attempts per connection is plenty for an agent with few keys.
    "hardening_max_auth_tries": 3,
    # sshd LoginGraceTime: 30 s to authenticate, so half-open logins do not pile up.
    "hardening_login_grace_time": 30,
    # Classic (non post-quantum) kex kept after the PQ hybrids, for clients without them:
    # paramiko 4 (pyinfra, testinfra) speaks only curve25519-sha256@libssh.org. [] = PQ only,
    # which locks pyinfra out (the post-reload login check then restores the old config).
    "hardening_extra_kex": ["curve25519-sha256", "curve25519-sha256@libssh.org"],
    # sshd AllowTcpForwarding: off; tunnels to Jupyter/TensorBoard need it on per tier.
    "hardening_tcp_forwarding": False,
    # sshd AllowAgentForwarding: off, a compromised host cannot use the operator's agent.
    "hardening_agent_forwarding": False,
    # sshd X11Forwarding: off, GPU servers are headless.
    "hardening_x11_forwarding": False,
    # Diffie-Hellman moduli below this size are removed from /etc/ssh/moduli (NIST: 3072).
    "hardening_moduli_min_bits": 3072,
    # Manage a host firewall (nftables) at all.
    "firewall_enabled": True,
    # Inbound ports open to everyone besides SSH (always open): ints, "9400", "9400/tcp",
    # "6817-6819/tcp" or {port, proto, comment}; tiers add DCGM 9400, node exporter 9100,
    # Slurm 6817-6819...
    "firewall_open_ports": [],
    # Peers allowed on every port (NCCL/torchrun use ephemeral ports between nodes).
    "firewall_trusted_cidrs": [],
    # Seconds before a loaded ruleset reverts itself unless a fresh SSH login confirmed it.
    "firewall_revert_after": 60,
    # Turn unattended security upgrades on.
    "hardening_unattended_upgrades": True,
    # Package patterns unattended-upgrades must never upgrade (the GPU stack).
    "hardening_unattended_blacklist": list(GPU_PACKAGE_BLACKLIST),
}

# Algorithm choices by OpenSSH version --------------------------------------------------------

CIPHERS = [
    "chacha20-poly1305@openssh.com", "aes256-gcm@openssh.com", "aes128-gcm@openssh.com",
    "aes256-ctr", "aes192-ctr", "aes128-ctr",
]
MACS = ["hmac-sha2-512-etm@openssh.com", "hmac-sha2-256-etm@openssh.com", "umac-128-etm@openssh.com"]
HOST_KEY_ALGORITHMS = ["ssh-ed25519", "rsa-sha2-512", "rsa-sha2-256"]
HOST_KEY_FILES = ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key"]


def pq_kex(version) -> list[str]:
    """Post-quantum hybrid key exchanges this OpenSSH server has, best first."""
    kex = []
    if version is not None and version.at_least(9, 9):
        kex += ["mlkem768x25519-sha256", "sntrup761x25519-sha512"]
    if version is not None and version.at_least(8, 5):
        kex += ["sntrup761x25519-sha512@openssh.com"]
    return kex


def kex_algorithms(version, extra: list[str]) -> list[str]:
    return list(dict.fromkeys([*pq_kex(version), *extra]))


# Firewall ports --------------------------------------------------------------------------------

_PORT = re.compile(r"^(\d{1,5})(?:-(\d{1,5}))?(?:/(tcp|udp))?$")


def parse_open_ports(items) -> list[dict]:
    """Normalise firewall_open_ports to [{port: "9400" | "6817-6819", proto, comment}]."""
    rules = []
    for item in items or []:
        comment = ""
        proto = None
        if isinstance(item, dict):
            comment = str(item.get("comment", ""))
            proto = item.get("proto")
            item = item.get("port")
        text = str(item).strip() if isinstance(item, (int, str)) and not isinstance(item, bool) else ""
        match = _PORT.match(text)
        if not match:
            raise DeployError(f"firewall_open_ports: bad port {item!r} (use 9400, '9400/udp', "
                              "'6817-6819' or {port, proto, comment})")
        low, high = int(match[1]), int(match[2] or match[1])
        if not (1 <= low <= high <= 65535):
            raise DeployError(f"firewall_open_ports: port out of range in {item!r}")
        proto = proto or match[3] or "tcp"
        if proto not in ("tcp", "udp"):
            raise DeployError(f"firewall_open_ports: protocol must be tcp or udp, not {proto!r}")
        if '"' in comment:
            raise DeployError(f"firewall_open_ports: no double quotes in comments ({comment!r})")
        rule = {"port": str(low) if low == high else f"{low}-{high}", "proto": proto, "comment": comment}
        if rule not in rules and not any(r["port"] == rule["port"] and r["proto"] == proto for r in rules):
            rules.append(rule)
    return rules


# Rendering -----------------------------------------------------------------------------------

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
)


def render(template: str, **context) -> str:
    return _ENV.get_template(template).render(**context)


_NAME = re.compile(r"^[A-Za-z0-9._*?!@%-][A-Za-z0-9._*?!@%/-]*$")


def _names(key: str) -> list[str]:
    value = host.data.get(key) or []
    if isinstance(value, str):
        value = value.split()
    for name in value:
        if not isinstance(name, str) or not _NAME.match(name):
            raise DeployError(f"{key}: bad name {name!r}")
    return list(value)


def sshd_context(version, existing_host_keys: list[str]) -> dict:
    permit = host.data.hardening_permit_root_login
    if permit not in ("no", "prohibit-password", "forced-commands-only", "yes"):
        raise DeployError(f"hardening_permit_root_login: unknown value {permit!r}")
    extra = host.data.hardening_extra_kex or []
    if isinstance(extra, str):
        extra = [extra]
    return {
        "openssh_version": str(version) if version else "unknown",
        "password_auth": bool(host.data.hardening_password_auth),
        "permit_root_login": permit,
        "max_auth_tries": int(host.data.hardening_max_auth_tries),
        "login_grace_time": int(host.data.hardening_login_grace_time),
        "allow_users": _names("hardening_allow_users"),
        "allow_groups": _names("hardening_allow_groups"),
        "x11_forwarding": bool(host.data.hardening_x11_forwarding),
        "tcp_forwarding": bool(host.data.hardening_tcp_forwarding),
        "agent_forwarding": bool(host.data.hardening_agent_forwarding),
        "host_keys": existing_host_keys,
        "host_key_algorithms": HOST_KEY_ALGORITHMS,
        "kex": kex_algorithms(version, list(extra)),
        "ciphers": CIPHERS,
        "macs": MACS,
    }


def expected_effective(ctx: dict) -> dict[str, str]:
    """What `sshd -T` must print once the drop-in is in force."""
    yes_no = lambda flag: "yes" if flag else "no"  # noqa: E731
    expected = {
        "passwordauthentication": yes_no(ctx["password_auth"]),
        "kbdinteractiveauthentication": yes_no(ctx["password_auth"]),
        "permitemptypasswords": "no",
        "pubkeyauthentication": "yes",
        "permitrootlogin": ctx["permit_root_login"],
        "maxauthtries": str(ctx["max_auth_tries"]),
        "logingracetime": str(ctx["login_grace_time"]),
        "x11forwarding": yes_no(ctx["x11_forwarding"]),
        "allowtcpforwarding": yes_no(ctx["tcp_forwarding"]),
        "allowagentforwarding": yes_no(ctx["agent_forwarding"]),
        "kexalgorithms": ",".join(ctx["kex"]),
        "ciphers": ",".join(ctx["ciphers"]),
        "macs": ",".join(ctx["macs"]),
        "hostkeyalgorithms": ",".join(ctx["host_key_algorithms"]),
    }
    if ctx["allow_users"]:
        expected["allowusers"] = " ".join(ctx["allow_users"])
    if ctx["allow_groups"]:
        expected["allowgroups"] = " ".join(ctx["allow_groups"])
    return expected


def nftables_context(ssh_ports: list[int]) -> dict:
    cidrs = host.data.firewall_trusted_cidrs or []
    try:
        cidrs = [str(ipaddress.ip_network(c, strict=False)) for c in cidrs]
    except ValueError as error:
        raise DeployError(f"firewall_trusted_cidrs: {error}") from error
    open_ports = [r for r in parse_open_ports(host.data.firewall_open_ports)
                  if not (r["proto"] == "tcp" and r["port"] in {str(p) for p in ssh_ports})]
    return {"table": TABLE, "ssh_ports": ssh_ports or [22], "open_ports": open_ports,
            "trusted_cidrs": cidrs}


# The deploy ----------------------------------------------------------------------------------

@deploy("SSH hardening and firewall", data_defaults=DEFAULTS)
def hardening():
    version = host.get_fact(SshdVersion)
    if version is None:
        raise DeployError(f"{host.name}: OpenSSH server not found (sshd -V); nothing to harden")
    existing_keys = [path for path in HOST_KEY_FILES if host.get_fact(File, path=path)]
    if not existing_keys:
        raise DeployError(f"{host.name}: neither an Ed25519 nor an RSA host key exists")
    ctx = sshd_context(version, existing_keys)

    # 1. Lock-out protection first: on failure the host stops here, nothing changed.
    if not ctx["password_auth"]:
        ssh.require_authorized_keys(
            name="Refuse to go on unless the deploy user and every allowed user have an SSH key",
            users=[connecting_user() or "root", *ctx["allow_users"]],
            groups=ctx["allow_groups"],
        )

    apt.packages(
        name="Install nftables and unattended-upgrades",
        packages=["nftables", "unattended-upgrades"],
        update=True,
        cache_time=int(host.data.get("base_apt_cache_time") or 86400),
        no_recommends=True,
    )

    # 2. SSH: candidate checked by sshd -t, reloaded, proven by a fresh login, else restored.
    dropin = ssh.sshd_dropin(
        name="Install the hardened sshd drop-in that sorts first, if sshd -t accepts it",
        dest=SSHD_DROPIN,
        content=render("etc/ssh/sshd_config.d/00-gpufleet-hardening.conf.j2", **ctx),
    )
    systemd.service(
        name="Reload sshd so that new logins get the hardened configuration",
        service="ssh.service",
        reloaded=True,
        _if=dropin.did_change,
    )
    ssh.verify_login_or_restore(
        name="Prove a fresh SSH login as the deploy user works, else restore the previous sshd configuration",
        dest=SSHD_DROPIN,
        _if=dropin.did_change,
    )
    ssh.expect_effective(
        name="Check with sshd -T that the hardened settings are the effective ones",
        expected=expected_effective(ctx),
    )
    # sshd reads /etc/ssh/moduli at each group-exchange kex: no reload needed. After the
    # login check, so that a refused configuration leaves /etc/ssh exactly as it was.
    ssh.prune_moduli(
        name=f"Remove Diffie-Hellman moduli below {int(host.data.hardening_moduli_min_bits)} bits",
        min_bits=int(host.data.hardening_moduli_min_bits),
    )

    # 3. Firewall.
    if host.data.firewall_enabled:
        sshd_config = host.get_fact(SshdEffectiveConfig)
        rules = render("etc/nftables.conf.j2", **nftables_context(sshd_config.ports))
        nftables.ruleset(
            name=f"Write the firewall ruleset to {NFTABLES_CONF}, if nft -c accepts it",
            dest=NFTABLES_CONF,
            content=rules,
        )
        unit = files.put(
            name="Make stopping nftables.service remove only gpufleet's table, never Docker's",
            src=_as_file(render("etc/systemd/system/nftables.service.d/gpufleet.conf.j2")),
            dest=NFTABLES_UNIT_DROPIN,
            mode="644",
        )
        systemd.daemon_reload(
            name="Let systemd read the nftables.service drop-in",
            _if=unit.did_change,
        )
        if host.get_fact(NftablesCapability).can_load:
            systemd.service(
                name="Load the firewall at every boot",
                service="nftables.service",
                enabled=True,
            )
        nftables.apply(
            name="Load the firewall atomically, reverted in "
                 f"{int(host.data.firewall_revert_after)} s unless a fresh SSH login works",
            path=NFTABLES_CONF,
            content=rules,
            revert_after=int(host.data.firewall_revert_after),
        )

    # 4. Security updates.
    if host.data.hardening_unattended_upgrades:
        files.put(
            name="Turn on unattended security upgrades, never for GPU packages",
            src=_as_file(render("etc/apt/apt.conf.d/51gpufleet-unattended-upgrades.j2",
                                blacklist=list(host.data.hardening_unattended_blacklist))),
            dest=UNATTENDED_CONF,
            mode="644",
        )


def _as_file(text: str) -> StringIO:
    return StringIO(text)
