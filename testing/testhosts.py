"""Disposable Debian test hosts: overlay root filesystems booted with systemd-nspawn.

Test infrastructure, not production code. Each host is a real Debian system (systemd as PID 1,
its own sshd on its own loopback address, real apt) made from a cached debootstrapped base:

    base (read-only, cached per recipe)  --overlay-->  host root  --systemd-nspawn --boot-->

Hosts belong to a *pool* (default ``default``; pytest uses its own) so that parallel users do
not collide: a pool owns one loopback /24 (127.0.<net>.0) and a set of cgroups. Everything a
pool starts lives inside its cgroups, so ``down`` can always find and stop it, also after a
killed run. With ``private_network`` a host gets a network namespace of its own instead of a
loopback address (see "Private networks" below). Facts behind the traps handled here: ../shared/reference/testhosts.md, kept in
tests/README.md.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import shlex
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STATE_ROOT = Path(os.environ.get("GPUFLEET_TESTHOSTS_DIR", "/var/lib/gpufleet-testhosts"))
CACHE_ROOT = Path(os.environ.get("GPUFLEET_TESTHOSTS_CACHE", "/var/cache/gpufleet-testhosts"))
DEFAULT_POOL = os.environ.get("GPUFLEET_TESTHOSTS_POOL", "default")
MIRROR = os.environ.get("GPUFLEET_DEBIAN_MIRROR", "http://deb.debian.org/debian")
RELEASES = ("bookworm", "trixie")
CGROUP_HIERARCHIES = (Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup/unified"))
NSPAWN_RUNTIME = Path("/run/systemd/nspawn")
NSPAWN_RUNTIME_MARK = STATE_ROOT / ".nspawn-runtime-mounted"
# A real site's shape: hosts are reached as an unprivileged deploy user made as a site makes one
# (`useradd` with its defaults: login shell /bin/sh, dash) whose sudo asks for its password, as
# inventories/cloud.py describes; `up(..., ssh_user="root")` keeps root's login for the tests
# that prove both work. LAB_USER is a second user a research host allows to log in; LOCAL_USER
# an ordinary shell account (a student's) for the tests of what a local user can see of a run.
SSH_USER = "gpufleet"
LAB_USER = "lab-admin"
LOCAL_USER = "student"
TEST_USERS = (SSH_USER, LAB_USER, LOCAL_USER)
# nspawn exits with 133 when the container asked for a reboot (systemctl reboot).
NSPAWN_REBOOT_EXIT = 133

# The recipe of a base root filesystem: changing it changes the cache key, so a stale base
# is never reused.
BASE_PACKAGES = (
    "openssh-server", "python3", "sudo", "systemd", "systemd-sysv", "dbus", "iproute2",
    "ca-certificates", "gnupg", "kmod", "procps", "apt-utils",
)
BASE_RECIPE_VERSION = 4

# What runc needs to start a container inside a host (`up(..., containers=True)`), measured on
# this kind of machine (hybrid cgroups, systemd-nspawn 252), one failure after the other:
# - "unable to apply cgroup configuration: mkdir /sys/fs/cgroup/cpuset/docker: read-only file
#   system": nspawn mounts the v1 controllers read-only. A pure cgroup v2 tree inside the host
#   (nspawn's environment switch below) is writable below the host's own cgroup; it has no
#   controllers, so containers run without resource limits (`docker info` warns).
# - "unable to join session keyring: unable to create session key: operation not permitted":
#   nspawn's seccomp filter refuses the keyring calls (@keyring).
# - "bpf_prog_query(BPF_CGROUP_DEVICE) failed: operation not permitted": cgroup v2 device rules
#   are eBPF programs (bpf).
# - "error during container init: operation not permitted" (netlink: bringing the container's
#   loopback up) and "failed to create default sandbox" (--network host): CAP_NET_ADMIN, which a
#   host gets only in a network namespace of its own (private_network).
# - (not fixable here) "error setting rlimits for ready process: error setting rlimit type 8:
#   operation not permitted": a container's memlock above dockerd's hard limit (the tiers'
#   default-ulimits memlock -1) needs CAP_SYS_RESOURCE, which even root lacks on this machine
#   (CapBnd without it; hard RLIMIT_MEMLOCK 8 MiB): tests give such hosts a memlock within it.
CONTAINER_NSPAWN_ENV = {"SYSTEMD_NSPAWN_UNIFIED_HIERARCHY": "1"}
CONTAINER_NSPAWN = ("--system-call-filter=@keyring bpf",)

# /etc/docker/daemon.json every test host starts with (see _personalise).
TEST_HOST_DOCKER_CONFIG = {
    "bridge": "none", "iptables": False, "ip6tables": False, "ip-forward": False,
    "ip-masq": False, "storage-driver": "vfs",
}


def log(msg: str) -> None:
    print(f"testhosts: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


# --------------------------------------------------------------------------------------------
# Base root filesystem, built once per (release, recipe)
# --------------------------------------------------------------------------------------------

def recipe_key(release: str) -> str:
    recipe = json.dumps(
        {"release": release, "packages": BASE_PACKAGES, "v": BASE_RECIPE_VERSION, "mirror": MIRROR},
        sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def base_dir(release: str) -> Path:
    return CACHE_ROOT / f"base-{release}-{recipe_key(release)}"


def ensure_base(release: str) -> Path:
    """Return the cached base root filesystem for `release`, debootstrapping it only once."""
    if release not in RELEASES:
        raise ValueError(f"unknown release {release!r}; known: {', '.join(RELEASES)}")
    base = base_dir(release)
    if (base / ".gpufleet-base-complete").exists():
        return base
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    lock = CACHE_ROOT / f".lock-{release}"
    with _flock(lock):
        if (base / ".gpufleet-base-complete").exists():
            return base
        tmp = base.with_name(base.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"debootstrapping {release} base (once per recipe) into {base}")
        t0 = time.monotonic()
        run([
            "debootstrap", "--variant=minbase", "--include=" + ",".join(BASE_PACKAGES),
            release, str(tmp), MIRROR,
        ], stdout=subprocess.DEVNULL)
        _configure_base(tmp, release)
        (tmp / ".gpufleet-base-complete").write_text(recipe_key(release) + "\n")
        tmp.rename(base)
        log(f"{release} base ready in {time.monotonic() - t0:.0f} s")
    return base


def _configure_base(root: Path, release: str) -> None:
    components = "main contrib non-free non-free-firmware"
    (root / "etc/apt/sources.list").write_text(
        f"deb {MIRROR} {release} {components}\n"
        f"deb {MIRROR} {release}-updates {components}\n"
        f"deb http://deb.debian.org/debian-security {release}-security {components}\n"
    )
    # Without generated caches every overlay host writes ~78 MB of pkgcache on its first apt call.
    chroot = ["chroot", str(root)]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C")
    run(chroot + ["apt-get", "update", "-qq"], env=env, stdout=subprocess.DEVNULL)
    run(chroot + ["apt-get", "clean"], env=env)
    run(chroot + ["apt-cache", "gencaches"], env=env, stdout=subprocess.DEVNULL)
    # Every clone shares these host keys; tests connect without host-key checking.
    run(chroot + ["ssh-keygen", "-A"], stdout=subprocess.DEVNULL)
    # A container has no consoles to log in on, and these units only fail there.
    for unit in ("getty@tty1.service", "console-getty.service"):
        with contextlib.suppress(FileNotFoundError):
            (root / "etc/systemd/system/getty.target.wants" / unit).unlink()
    for unit in ("systemd-networkd-wait-online.service", "apt-daily.timer", "apt-daily-upgrade.timer"):
        (root / "etc/systemd/system" / unit).unlink(missing_ok=True)
        (root / "etc/systemd/system" / unit).symlink_to("/dev/null")
    (root / "etc/machine-id").write_text("")  # each boot gets its own transient machine id
    # The deploy user as a real site makes one: useradd's defaults (SHELL=/bin/sh), in group sudo
    # (Debian's sudoers: ALL, with the user's password). The password is set per run (_set_password).
    run(chroot + ["useradd", "--create-home", "--groups", "sudo", SSH_USER])
    for user in (LAB_USER, LOCAL_USER):
        run(chroot + ["useradd", "--create-home", "--shell", "/bin/bash", user])


@contextlib.contextmanager
def _flock(path: Path):
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


# --------------------------------------------------------------------------------------------
# Pools and hosts
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Host:
    name: str
    address: str
    release: str
    gpu: str | None
    pool: str
    ssh_key: str
    ssh_user: str = SSH_USER
    pid: int | None = None
    # --private-network hosts: the client namespace to reach them from (`ip netns exec NETNS ssh
    # ...`); their address exists only there and in the host's own namespace.
    netns: str | None = None
    forward: list[int] = dataclasses.field(default_factory=list)  # machine ports the host reaches
    containers: bool = False  # booted so that dockerd can start containers (CONTAINER_NSPAWN)
    # block devices of the machine bound into the host (loop devices a test made, standing in
    # for drives): only these nodes, nothing else of the machine's, appear in its /dev
    devices: list[str] = dataclasses.field(default_factory=list)
    # Where ssh() keeps an OpenSSH master connection per login user (None: a new connection per
    # command). For VM hosts (testing/vmhost.py): under emulation each SSH handshake costs the
    # guest seconds, paid again by every command a test runs there.
    control_path: str | None = None

    @property
    def host_netns(self) -> str | None:
        """The host's own network namespace (None: the machine's network, loopback address)."""
        return _host_netns(self.pool, self.name) if self.netns else None

    @property
    def dir(self) -> Path:
        return pool_dir(self.pool) / "hosts" / self.name

    @property
    def root(self) -> Path:
        return self.dir / "root"

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        if not self.netns:  # a loopback host records what harnesses without private networks read
            del data["netns"], data["forward"]
        return data

    def written_files(self) -> dict[str, tuple]:
        """Every file the host has written since boot (its overlay upper layer), minus logs:
        relative path -> (mode, size, mtime_ns). Equal before and after = the host was not changed."""
        upper = self.dir / "upper"
        state = {}
        for path in upper.rglob("*"):
            rel = path.relative_to(upper).as_posix()
            if rel.startswith(("var/log", "var/lib/systemd/timers", "var/lib/systemd/random-seed")):
                continue
            st = path.lstat()
            state[rel] = (st.st_mode, st.st_size, st.st_mtime_ns)
        return state

    def command_prefix(self) -> list[str]:
        """What runs a command in the place this host is reachable from."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def pyinfra_data(self) -> dict:
        """Host data a pyinfra inventory needs to reach this host (through sudo unless root)."""
        data = {
            "ssh_hostname": self.address,
            "ssh_user": self.ssh_user,
            "ssh_key": self.ssh_key,
            "ssh_known_hosts_file": "/dev/null",
            "ssh_strict_host_key_checking": "no",
        }
        if self.ssh_user != "root":
            data["_sudo"] = True
            data["_sudo_password"] = sudo_password()
        return data


# --------------------------------------------------------------------------------------------
# The deploy user's sudo password: made at random by the process that uses a pool (a pytest
# worker, a tools/sandbox run), set on its hosts through chpasswd's stdin, kept in that
# process's environment (PASSWORD_ENV, inherited by the pyinfra runs and tools it starts) and
# never written to a file: inventories name the variable (SudoPassword's repr), not the value.
# --------------------------------------------------------------------------------------------

PASSWORD_ENV = "GPUFLEET_TESTHOSTS_SUDO_PASSWORD"


class SudoPassword(str):
    """The password, whose repr is the expression that reads it from the environment: an
    inventory written with repr or pprint (testing/inventory.py) holds the variable's name."""

    def __repr__(self) -> str:
        return f"__import__('os').environ[{PASSWORD_ENV!r}]"


def sudo_password() -> SudoPassword:
    """This process's deploy-user password (made on first use; its children inherit it)."""
    value = os.environ.get(PASSWORD_ENV)
    if not value:
        import secrets
        value = os.environ[PASSWORD_ENV] = "gf-" + secrets.token_urlsafe(18)
    return SudoPassword(value)


def _set_password(root: Path) -> None:
    run(["chroot", str(root), "chpasswd"], input=f"{SSH_USER}:{sudo_password()}\n", text=True)


def set_sudo_password(hosts: list[Host]) -> None:
    """Give running container hosts this process's password (a pool booted by another process:
    its password was never kept)."""
    for host in hosts:
        if host.ssh_user != "root":
            _set_password(host.root)


def _host_from_meta(meta: Path) -> Host:
    """The host a meta.json describes; fields another version of the harness added (a pool of
    another checkout) are ignored."""
    known = {f.name for f in dataclasses.fields(Host)}
    return Host(**{k: v for k, v in json.loads(meta.read_text()).items() if k in known})


def pool_dir(pool: str) -> Path:
    return STATE_ROOT / "pools" / pool


def _pool_net(pool: str) -> int:
    """The third octet of the pool's loopback /24, allocated once per pool."""
    pdir = pool_dir(pool)
    pdir.mkdir(parents=True, exist_ok=True)
    net_file = pdir / "net"
    with _flock(STATE_ROOT / ".lock-nets"):
        if net_file.exists():
            return int(net_file.read_text())
        used = set()
        for other in (STATE_ROOT / "pools").glob("*/net"):
            with contextlib.suppress(ValueError):
                used.add(int(other.read_text()))
        net = 0 if pool == "default" and 0 not in used else min(set(range(1, 250)) - used)
        net_file.write_text(f"{net}\n")
        return net


def ssh_key() -> Path:
    key = STATE_ROOT / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpufleet-testhosts", "-f", str(key)])
    return key


def _host_from_meta(meta: Path) -> Host:
    # Pools made by another version of this harness (other worktrees share STATE_ROOT) may
    # record fields this one does not know: keep the ones it does.
    fields = {f.name for f in dataclasses.fields(Host)}
    return Host(**{k: v for k, v in json.loads(meta.read_text()).items() if k in fields})


def list_hosts(pool: str | None = DEFAULT_POOL) -> list[Host]:
    """Hosts of `pool` (all pools when None) whose launcher is alive."""
    pools = [pool] if pool else sorted(p.name for p in (STATE_ROOT / "pools").glob("*") if p.is_dir())
    hosts = []
    for p in pools:
        for meta in sorted((pool_dir(p) / "hosts").glob("*/meta.json"), key=_natural):
            host = _host_from_meta(meta)
            if host.pid and _alive(host.pid):
                hosts.append(host)
    return hosts


def _natural(path: Path):
    name = path.parent.name
    digits = "".join(c for c in name if c.isdigit())
    return (name.rstrip("0123456789"), int(digits or 0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def up(count: int, release: str = "bookworm", gpu: str | None = None, pool: str = DEFAULT_POOL,
       names: list[str] | None = None, timeout: float = 120, private_network: bool = False,
       forward: list[int] | tuple[int, ...] = (), containers: bool = False,
       ssh_user: str = SSH_USER, devices: list[str] | tuple[str, ...] = ()) -> list[Host]:
    """Boot `count` new hosts in `pool` and wait until systemd reports them running.

    `ssh_user`: who tests and deploys log in as (SSH_USER, through sudo; or "root").

    `private_network`: each host in a network namespace of its own (CAP_NET_ADMIN there, so
    nftables loads for real), joined by veth to the pool's client namespace (see
    _private_network); `forward`: ports of the machine's 127.0.0.1 (a stand-in apt repository)
    the host reaches on its own 127.0.0.1; `containers`: boot them so that Docker can start
    containers inside (CONTAINER_NSPAWN; needs `private_network`)."""
    if containers and not private_network:
        raise ValueError("containers=True needs private_network=True (runc brings up the container's "
                         "loopback: CAP_NET_ADMIN, which a host gets only in a network of its own)")
    base = ensure_base(release)
    if gpu:
        from testing import gpusim
        gpusim.parse_spec(gpu)  # a bad spec fails before anything starts
    key = ssh_key()
    net = _pool_net(pool)
    _prepare_machine()
    existing = {p.name for p in (pool_dir(pool) / "hosts").glob("*")}
    taken = {int(h.address.rsplit(".", 1)[1]) for h in list_hosts(pool)}
    hosts = []
    names = list(names or [])
    index = 1
    for i in range(count):
        if i < len(names):
            name = names[i]
        else:
            while f"{_pool_prefix(pool)}{index}" in existing:
                index += 1
            name = f"{_pool_prefix(pool)}{index}"
        existing.add(name)
        last = next(n for n in range(10, 255) if n not in taken)
        taken.add(last)
        if private_network:
            hosts.append(Host(name=name, address=f"{PRIVATE_NET_PREFIX}.{net}.{last}", release=release,
                              gpu=gpu, pool=pool, ssh_key=str(key), ssh_user=ssh_user,
                              netns=_client_netns(pool), forward=[int(p) for p in forward],
                              containers=containers, devices=list(devices)))
        else:
            hosts.append(Host(name=name, address=f"127.0.{net}.{last}", release=release, gpu=gpu,
                              pool=pool, ssh_key=str(key), ssh_user=ssh_user, devices=list(devices)))
    for host in hosts:
        _boot(host, base)
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as ex:
        list(ex.map(lambda h: wait_ready(h, timeout), hosts))
    return hosts


def _pool_prefix(pool: str) -> str:
    return "gf" if pool == "default" else f"gf-{pool}-"


def _prepare_machine() -> None:
    """Machine-wide prerequisites measured in testhosts.md."""
    # Without this tmpfs nspawn fails here with "Failed to open system bus".
    NSPAWN_RUNTIME.mkdir(parents=True, exist_ok=True)
    if not _is_mountpoint(NSPAWN_RUNTIME):
        run(["mount", "-t", "tmpfs", "tmpfs", str(NSPAWN_RUNTIME)])
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        NSPAWN_RUNTIME_MARK.write_text("mounted by the gpufleet test-host harness\n")
    # Each container's systemd takes inotify instances; the default of 128 stops at ~25 hosts.
    for knob, value in (("max_user_instances", 8192), ("max_user_watches", 1048576)):
        path = Path("/proc/sys/fs/inotify") / knob
        with contextlib.suppress(OSError, ValueError):
            if int(path.read_text()) < value:
                path.write_text(str(value))


def _is_mountpoint(path: Path) -> bool:
    target = str(path)
    return any(line.split()[1] == target for line in Path("/proc/mounts").read_text().splitlines())


# --------------------------------------------------------------------------------------------
# Private networks: each host in a network namespace of its own, joined by a veth pair to the
# pool's client namespace (a bridge with PRIVATE_NET_PREFIX.<net>.1/24), from which tests and
# pyinfra reach it (`ip netns exec NETNS ...`). Nothing is added to the machine's own network:
# both ends of every veth live in namespaces the harness made, and `down` deletes them. The
# host reaches Debian's archive (and `forward` ports of the machine's 127.0.0.1) through relays
# its launcher runs: sockets listening on the host's own loopback, connecting out from the
# machine, so the host needs no route and its firewall sees only loopback traffic.
# --------------------------------------------------------------------------------------------

PRIVATE_NET_PREFIX = "10.232"
NETNS_PREFIX = "gft."
NETNS_DIR = Path("/run/netns")
CLIENT_BRIDGE = "br0"
HOST_IFACE = "host0"
CLONE_NEWNET = 0x40000000


def _client_netns(pool: str) -> str:
    return f"{NETNS_PREFIX}{pool}.client"


def _host_netns(pool: str, name: str) -> str:
    return f"{NETNS_PREFIX}{pool}.{name}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return run(["ip", *args], check=check, capture_output=True, text=True)


def _netns_names() -> list[str]:
    return sorted(p.name for p in NETNS_DIR.glob(NETNS_PREFIX + "*")) if NETNS_DIR.is_dir() else []


@contextlib.contextmanager
def in_netns(name: str):
    """Run the calling thread (only it) in network namespace `name`: sockets made meanwhile
    stay in that namespace, connect and serve there after the thread is back."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into network namespace {name} failed")
        finally:
            os.close(target)
        try:
            yield
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back into the machine's network failed")
    finally:
        os.close(own)


def _ensure_client_netns(pool: str, net: int) -> str:
    ns = _client_netns(pool)
    with _flock(STATE_ROOT / ".lock-netns"):
        if not (NETNS_DIR / ns).exists():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", CLIENT_BRIDGE, "type", "bridge")
            _ip("-n", ns, "addr", "add", f"{PRIVATE_NET_PREFIX}.{net}.1/24", "dev", CLIENT_BRIDGE)
            _ip("-n", ns, "link", "set", CLIENT_BRIDGE, "up")
    return ns


def _make_host_network(host: Host) -> None:
    net, last = host.address.split(".")[2:]
    _ensure_client_netns(host.pool, int(net))
    ns, peer = host.host_netns, f"vh{last}"
    _ip("netns", "del", ns, check=False)
    _ip("-n", host.netns, "link", "del", peer, check=False)
    _ip("netns", "add", ns)
    _ip("-n", ns, "link", "set", "lo", "up")
    # Made inside the host's namespace, its peer moved straight into the client's.
    _ip("-n", ns, "link", "add", HOST_IFACE, "type", "veth", "peer", "name", peer, "netns", host.netns)
    _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE)
    _ip("-n", ns, "link", "set", HOST_IFACE, "up")
    _ip("-n", host.netns, "link", "set", peer, "master", CLIENT_BRIDGE, "up")
    if host.containers:
        # dockerd turns IP forwarding on for its published ports (DNAT through the forward
        # hook); inside nspawn /proc/sys is read-only, so the harness does it, at every boot.
        run(["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.ip_forward=1"], capture_output=True)


def _archive_hosts() -> list[tuple[str, int]]:
    """(name, port) of the Debian archive the hosts' sources.list points at."""
    url = urllib.parse.urlsplit(MIRROR)
    found = [(url.hostname or "deb.debian.org", url.port or 80), ("deb.debian.org", 80)]
    return list(dict.fromkeys(found))


def _relays(host: Host) -> list[list]:
    """[listen address, port, target host, port] inside the private host's namespace."""
    relays = [[f"127.0.2.{i}", port, name, port] for i, (name, port) in enumerate(_archive_hosts(), start=1)]
    relays += [["127.0.0.1", port, "127.0.0.1", port] for port in host.forward]
    return relays


def _start_relays(netns: str, relays: list[list]) -> None:
    for listen_addr, listen_port, target, target_port in relays:
        with in_netns(netns):
            server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((listen_addr, listen_port))
        server.listen(64)
        threading.Thread(target=_relay_accept, args=(server, target, target_port), daemon=True).start()


def _relay_accept(server: socket.socket, target: str, port: int) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_relay_pair, args=(conn, target, port), daemon=True).start()


def _relay_pair(conn: socket.socket, target: str, port: int) -> None:
    try:
        upstream = socket.create_connection((target, port), timeout=30)
    except OSError:
        conn.close()
        return
    upstream.settimeout(None)

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    back = threading.Thread(target=pump, args=(upstream, conn), daemon=True)
    back.start()
    pump(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def _connect(host: Host, port: int, timeout: float) -> socket.socket:
    """A TCP connection to the host, from the place it is reachable from."""
    if not host.netns:
        return socket.create_connection((host.address, port), timeout=timeout)
    with in_netns(host.netns):
        sock = socket.socket()
    sock.settimeout(timeout)
    try:
        sock.connect((host.address, port))
    except OSError:
        sock.close()
        raise
    return sock


def _cgroup_dirs(host: Host) -> list[Path]:
    return [h / "gpufleet-testhosts" / host.pool / host.name for h in CGROUP_HIERARCHIES if h.is_dir()]


def _boot(host: Host, base: Path) -> None:
    hdir = host.dir
    if hdir.exists():
        _destroy(host)
    for sub in ("upper", "work", "root"):
        (hdir / sub).mkdir(parents=True)
    run(["mount", "-t", "overlay", "overlay", "-o",
         f"lowerdir={base},upperdir={hdir / 'upper'},workdir={hdir / 'work'}", str(host.root)])
    _personalise(host)
    extra: list[str] = []
    if host.gpu:
        from testing import gpusim
        extra = gpusim.install(host.root, host.gpu, hdir / "gpusim")
    if host.netns:
        _make_host_network(host)
        # The host owns its namespace: CAP_NET_ADMIN there touches nothing of the machine's.
        extra += [f"--network-namespace-path={NETNS_DIR / host.host_netns}", "--capability=CAP_NET_ADMIN"]
        (hdir / "network.json").write_text(json.dumps({"netns": host.host_netns, "relays": _relays(host)}))
    for device in host.devices:
        if not re.fullmatch(r"/dev/loop[0-9]+", device):
            raise ValueError(f"only loop devices stand in for a test host's drives, not {device!r}")
        extra.append(f"--bind={device}")
    nspawn = [
        "systemd-nspawn", "--quiet", "--register=no", "--keep-unit", f"--machine={host.name}",
        "--console=read-only", "-D", str(host.root), *extra,
        *(CONTAINER_NSPAWN if host.containers else ()), "--boot",
    ]
    (hdir / "nspawn.json").write_text(json.dumps(nspawn))
    cgroups = _cgroup_dirs(host)
    for cg in cgroups:
        cg.mkdir(parents=True, exist_ok=True)
    logf = open(hdir / "console.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "testing.testhosts", "_supervise", str(hdir)],
        stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
        cwd=str(Path(__file__).resolve().parent.parent),
        env={**os.environ, **(CONTAINER_NSPAWN_ENV if host.containers else {})},
    )
    host.pid = proc.pid
    (hdir / "meta.json").write_text(json.dumps(host.as_dict(), indent=1))


def _passwd_ids(root: Path) -> dict[str, tuple[int, int, str]]:
    """user -> (uid, gid, home) from the host's own /etc/passwd (its ids, not the machine's)."""
    ids = {}
    for line in (root / "etc/passwd").read_text().splitlines():
        f = line.split(":")
        if len(f) >= 6:
            ids[f[0]] = (int(f[2]), int(f[3]), f[5])
    return ids


def _personalise(host: Host) -> None:
    root = host.root
    key = Path(host.ssh_key + ".pub").read_text()
    ids = _passwd_ids(root)
    # The test key logs every test user in (hardening's AllowUsers decides who may).
    for user in ("root", *TEST_USERS):
        uid, gid, home = ids[user]
        ssh_dir = root / home.lstrip("/") / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        auth = ssh_dir / "authorized_keys"
        auth.write_text(key)
        auth.chmod(0o600)
        for path in (ssh_dir, auth):
            os.chown(path, uid, gid)
    _set_password(root)
    (root / "etc/hostname").write_text(host.name + "\n")
    hosts = f"127.0.0.1 localhost\n{host.address} {host.name}\n"
    if host.netns:  # the archive through the launcher's relays (see _relays)
        hosts += "".join(f"{addr} {name}\n" for addr, _, name, _ in _relays(host)[:len(_archive_hosts())])
    (root / "etc/hosts").write_text(hosts)
    # Without it sshd binds 0.0.0.0:22 on the network all hosts share.
    (root / "etc/ssh/sshd_config.d/00-listen.conf").write_text(
        f"# written by the gpufleet test-host harness\nListenAddress {host.address}\n"
    )
    # What an operator of such a container would configure for Docker: dockerd cannot set up
    # iptables, forwarding or overlay mounts inside systemd-nspawn (no CAP_NET_ADMIN, read-only
    # /proc/sys), but starts with these. gpufleet must merge into it, as into any operator file.
    docker = root / "etc/docker"
    docker.mkdir(parents=True, exist_ok=True)
    (docker / "daemon.json").write_text(json.dumps(TEST_HOST_DOCKER_CONFIG, indent=4, sort_keys=True) + "\n")


def supervise(hdir: Path) -> int:
    """Runs as the host's launcher: joins the host's cgroups, boots it, boots it again after a
    reboot request (exit 133), and stops it on SIGTERM."""
    nspawn = json.loads((hdir / "nspawn.json").read_text())
    name = nspawn[nspawn.index("--keep-unit") + 1].split("=", 1)[1]
    pool = hdir.parent.parent.name
    for h in CGROUP_HIERARCHIES:
        cg = h / "gpufleet-testhosts" / pool / name
        if cg.is_dir():
            (cg / "cgroup.procs").write_text(str(os.getpid()))
    stopping = False
    child: subprocess.Popen | None = None
    network = json.loads((hdir / "network.json").read_text()) if (hdir / "network.json").exists() else None
    if network:
        _start_relays(network["netns"], network["relays"])

    def on_term(signum, frame):
        nonlocal stopping
        stopping = True
        if child and child.poll() is None:
            child.send_signal(signal.SIGTERM)  # nspawn turns it into a clean halt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    while True:
        if network:  # a machine boots with no rules loaded; the namespace outlives the boot
            run(["ip", "netns", "exec", network["netns"], "nft", "flush", "ruleset"], check=False)
        child = subprocess.Popen(nspawn, stdin=subprocess.DEVNULL)
        rc = child.wait()
        boots = hdir / "boots"
        # replaced in one step: a reader (reboot(), tests) never sees it empty, half-written
        partial = hdir / "boots.partial"
        partial.write_text(str(int(boots.read_text()) + 1 if boots.exists() else 1))
        partial.replace(boots)
        if stopping or rc != NSPAWN_REBOOT_EXIT:
            return rc
        print(f"testhosts: {name} rebooting", flush=True)


def wait_ready(host: Host, timeout: float = 120) -> None:
    """Wait for sshd, then for systemd to finish booting (`running` or `degraded`)."""
    deadline = time.monotonic() + timeout
    while True:
        if host.pid and not _alive(host.pid):
            raise RuntimeError(f"{host.name}: launcher died; see {host.dir / 'console.log'}")
        try:
            with _connect(host, 22, timeout=1):
                break
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{host.name}: sshd did not answer on {host.address}:22") from None
            time.sleep(0.1)
    state = ""
    while time.monotonic() < deadline:
        res = ssh(host, "systemctl is-system-running --wait", check=False, timeout=max(1, deadline - time.monotonic()))
        state = res.stdout.strip()
        if state in ("running", "degraded"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{host.name}: systemd state {state!r} after {timeout} s")


def as_root(host: Host, command: str) -> str:
    """`command` as the shell text that runs it as root once logged in as the host's SSH user:
    through sudo (in root's home, as a root login would be) unless that user is root. sudo reads
    the password as the first line of stdin (sudo_stdin), one byte at a time: the rest is the
    command's."""
    if host.ssh_user == "root":
        return command
    return "sudo -S -k -p '' -H -- sh -c " + shlex.quote("cd /root || exit 125\n" + command)


def sudo_stdin(host: Host, stdin: str | None) -> str | None:
    """What to send as_root's command on stdin: the password's line first, through sudo."""
    if host.ssh_user == "root":
        return stdin
    return f"{sudo_password()}\n{stdin or ''}"


def ssh(host: Host, command: str, check: bool = True, timeout: float = 60, user: str | None = None,
        input: str | None = None) -> subprocess.CompletedProcess:
    """Run `command` on `host` through the real OpenSSH client: as root (logged in as the host's
    SSH user, through sudo where that is not root), or logged in and run as `user`."""
    remote = command if user else as_root(host, command)
    if not user:
        input = sudo_stdin(host, input)
    login = f"{user or host.ssh_user}@{host.address}"
    return run([
        *host.command_prefix(), "ssh", *_SSH_OPTIONS, *_multiplexed(host, login, min(timeout, 30)), login, remote,
    ], check=check, capture_output=True, text=True, timeout=timeout, input=input)


_SSH_OPTIONS = ("-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "ConnectTimeout=5")


def _multiplexed(host: Host, login: str, timeout: float) -> list[str]:
    """ssh's options that run a command through the master connection of `login` on a host with
    a control_path, started here when there is none (or it died: a reboot closes it); [] for the
    other hosts. A master that cannot start (the host is down) leaves the command to connect on
    its own (ControlMaster=no falls back to a direct connection), as without one."""
    if not host.control_path:
        return [*("-i", host.ssh_key)]
    sock = f"{host.control_path}-{login.split('@', 1)[0]}"
    mux = ["-i", host.ssh_key, "-S", sock]
    check = subprocess.run([*host.command_prefix(), "ssh", *_SSH_OPTIONS, *mux, "-O", "check", login],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    if check.returncode != 0:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(sock)  # a master killed without cleaning up leaves its socket
        # -f: backgrounded once logged in; its stdio on /dev/null so that no pipe of ours stays
        # open; ControlPersist and ServerAlive: it ends a minute after its last command, or when
        # the host stops answering (ssh_mux_exit stops it at once)
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run([*host.command_prefix(), "ssh", *_SSH_OPTIONS, *mux, "-f", "-N", "-M",
                            "-o", "ControlPersist=60", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
                            login], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=timeout)
    return [*mux, "-o", "ControlMaster=no"]


def ssh_mux_exit(host: Host) -> None:
    """Stop the host's master connections (ssh -O exit, through their sockets), if it has any."""
    if not host.control_path:
        return
    prefix = Path(host.control_path).name + "-"
    for sock in Path(host.control_path).parent.glob(prefix + "*"):
        user = sock.name.removeprefix(prefix)
        subprocess.run([*host.command_prefix(), "ssh", *_SSH_OPTIONS, "-S", str(sock), "-O", "exit",
                        f"{user}@{host.address}"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10)


def reboot(host: Host, timeout: float = 120, console: bool = False) -> None:
    """Reboot a host for real (systemd goes down and comes back; /run and GPU state are lost).
    `console`: without logging in (a host that refuses SSH): ctrl-alt-del, i.e. SIGINT to its
    systemd."""
    boots_file = host.dir / "boots"
    before = int(boots_file.read_text()) if boots_file.exists() else 0
    if console:
        from testing.netns import container_pid
        os.kill(container_pid(host), signal.SIGINT)
    else:
        ssh(host, "systemctl reboot", check=False, timeout=10)
    deadline = time.monotonic() + timeout
    while (int(boots_file.read_text()) if boots_file.exists() else 0) == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{host.name}: did not go down for reboot")
        time.sleep(0.1)
    wait_ready(host, timeout)


# --------------------------------------------------------------------------------------------
# Teardown: find everything through the pool's cgroups and directories, also after a crash
# --------------------------------------------------------------------------------------------

def down(pool: str | None = DEFAULT_POOL) -> int:
    """Stop every host of `pool` (every pool when None); returns how many were torn down."""
    pools = [pool] if pool else [p.name for p in (STATE_ROOT / "pools").glob("*") if p.is_dir()]
    hosts = []
    for p in pools:
        for meta in (pool_dir(p) / "hosts").glob("*/meta.json"):
            hosts.append(_host_from_meta(meta))
        # Half-made hosts (no meta.json yet) are still cleaned below.
        for hdir in (pool_dir(p) / "hosts").glob("*"):
            if not (hdir / "meta.json").exists():
                hosts.append(Host(name=hdir.name, address="", release="", gpu=None, pool=p, ssh_key=""))
    # VM test hosts (testing/vmhost.py) of the same pools: stopped by their qemu PIDs.
    from testing import vmhost
    vms = sum(vmhost.down(p) for p in pools)
    # Ask all to halt at once (each takes ~2 s), then make sure.
    for host in hosts:
        if host.pid and _alive(host.pid) and _is_launcher(host.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(host.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for host in hosts:
        while host.pid and _alive(host.pid) and _is_launcher(host.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    for host in hosts:
        _destroy(host)
    for p in pools:
        # The hosts' namespaces (with their veths), then the client's.
        for ns in sorted(_netns_names(), key=lambda n: n == _client_netns(p)):
            if ns.startswith(f"{NETNS_PREFIX}{p}."):
                _ip("netns", "del", ns, check=False)
        for h in CGROUP_HIERARCHIES:
            for cg in (h / "gpufleet-testhosts" / p, h / "gpufleet-testhosts"):
                with contextlib.suppress(OSError):
                    cg.rmdir()  # only once empty: another pool may still be running
    # The tmpfs is ours only if we mounted it; it goes with the last host (what nspawn left in
    # it belongs to containers that are gone).
    if NSPAWN_RUNTIME_MARK.exists() and not list_hosts(None) and _is_mountpoint(NSPAWN_RUNTIME):
        if run(["umount", str(NSPAWN_RUNTIME)], check=False).returncode == 0:
            NSPAWN_RUNTIME_MARK.unlink(missing_ok=True)
    return len(hosts) + vms


def stop(host: Host, timeout: float = 15) -> None:
    """Stop one host (a clean halt, then whatever is left is killed) and remove it: for a test
    that booted a host of its own (devices bound in) and must release them before it ends."""
    if host.pid and _alive(host.pid) and _is_launcher(host.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(host.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(host.pid) and _is_launcher(host.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    _destroy(host)


def _is_launcher(pid: int) -> bool:
    try:
        return b"testing.testhosts" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _destroy(host: Host) -> None:
    """Kill whatever still runs in the host's cgroups, unmount its root, remove its files."""
    for _ in range(50):
        pids = _cgroup_pids(host)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    hdir = host.dir
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mnt in sorted((m for m in mounts if m == str(hdir) or m.startswith(str(hdir) + "/")), reverse=True):
        run(["umount", "-l", mnt], check=False)
    for cg in _cgroup_dirs(host):
        for sub in sorted((p for p in cg.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            cg.rmdir()
    shutil.rmtree(hdir, ignore_errors=True)


def _cgroup_pids(host: Host) -> list[int]:
    pids = set()
    for cg in _cgroup_dirs(host):
        if not cg.is_dir():
            continue
        for procs in [cg / "cgroup.procs", *cg.rglob("cgroup.procs")]:
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in procs.read_text().split())
    return sorted(pids)


def leftovers(pool: str | None = None) -> list[str]:
    """What the harness left on the machine (of `pool`, or of every pool): nspawn processes,
    overlay mounts, cgroups."""
    found = _leftovers()
    if pool:
        found = [item for item in found if f"/{pool}/" in item or item.endswith(f"/{pool}")
                 or item.startswith(f"netns {NETNS_PREFIX}{pool}.")]
    return found


def _leftovers() -> list[str]:
    found = []
    for line in Path("/proc/mounts").read_text().splitlines():
        if str(STATE_ROOT) in line.split()[1]:
            found.append("mount " + line.split()[1])
    if NSPAWN_RUNTIME_MARK.exists() and _is_mountpoint(NSPAWN_RUNTIME) and not list_hosts(None):
        found.append(f"mount {NSPAWN_RUNTIME} (the harness's tmpfs, no host left)")
    found += [f"netns {ns}" for ns in _netns_names()]
    for h in CGROUP_HIERARCHIES:
        top = h / "gpufleet-testhosts"
        if top.is_dir():
            found += [f"cgroup {p}" for p in top.rglob("*") if p.is_dir()]
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes()
            if cmd.startswith(b"systemd-nspawn") and str(STATE_ROOT).encode() in cmd:
                shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:80]
                found.append(f"process {proc.name} {shown}")
    from testing import vmhost
    return found + vmhost.leftovers()


# --------------------------------------------------------------------------------------------
# Command line: tools/testhosts
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="testhosts", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool", default=DEFAULT_POOL, help="host pool (default: %(default)s)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="boot N new hosts")
    p_up.add_argument("count", type=int)
    p_up.add_argument("--release", choices=RELEASES, default="bookworm")
    p_up.add_argument("--gpu", metavar="SPEC", help="simulated GPUs (test double), e.g. h200x2, t4, h100x8")
    p_up.add_argument("--private-network", action="store_true",
                      help="each host in a network namespace of its own, reached from the pool's "
                           "client namespace (list --json: netns)")
    p_up.add_argument("--forward", metavar="PORT", type=int, action="append", default=[],
                      help="with --private-network: a port of the machine's 127.0.0.1 the hosts reach on theirs")
    p_up.add_argument("--containers", action="store_true",
                      help="with --private-network: boot so that Docker can start containers inside")
    p_up.add_argument("--ssh-user", default=SSH_USER,
                      help="who logs in: %(default)s (sudo with a password made per run, a real site's "
                           "shape) or root")
    p_list = sub.add_parser("list", help="running hosts")
    p_list.add_argument("--json", action="store_true")
    p_list.add_argument("--all", action="store_true", help="every pool")
    p_down = sub.add_parser("down", help="stop hosts and clean up")
    p_down.add_argument("--all", action="store_true", help="every pool")
    p_reboot = sub.add_parser("reboot", help="reboot a host for real")
    p_reboot.add_argument("name")
    p_shell = sub.add_parser("shell", help="a root shell in a container host, without SSH or sudo")
    p_shell.add_argument("name")
    sub.add_parser("base", help="build the cached base root filesystems").add_argument(
        "--release", choices=RELEASES, action="append")
    sub.add_parser("leftovers", help="list processes, mounts and cgroups left behind").add_argument(
        "--all", action="store_true", help="every pool")
    p_sup = sub.add_parser("_supervise")
    p_sup.add_argument("hostdir")
    args = parser.parse_args(argv)

    if args.cmd == "_supervise":
        return supervise(Path(args.hostdir))
    if os.geteuid() != 0 and args.cmd != "list":
        parser.error("test hosts need root (mounts, systemd-nspawn)")
    if args.cmd == "up":
        t0 = time.monotonic()
        hosts = up(args.count, args.release, args.gpu, args.pool, private_network=args.private_network,
                   forward=args.forward, containers=args.containers, ssh_user=args.ssh_user)
        log(f"{len(hosts)} host(s) up in {time.monotonic() - t0:.1f} s")
        _print_hosts(hosts, as_json=False)
    elif args.cmd == "list":
        _print_hosts(list_hosts(None if args.all else args.pool), as_json=args.json)
    elif args.cmd == "down":
        t0 = time.monotonic()
        n = down(None if args.all else args.pool)
        log(f"{n} host(s) down in {time.monotonic() - t0:.1f} s")
    elif args.cmd == "reboot":
        host = next((h for h in list_hosts(args.pool) if h.name == args.name), None)
        if not host:
            parser.error(f"no running host {args.name!r} in pool {args.pool!r}")
        reboot(host)
    elif args.cmd == "shell":
        host = next((h for h in list_hosts(args.pool) if h.name == args.name), None)
        if not host:
            parser.error(f"no running host {args.name!r} in pool {args.pool!r}")
        from testing.netns import container_pid
        os.execvp("nsenter", ["nsenter", "--target", str(container_pid(host)), "--all", "--", "/bin/bash", "-l"])
    elif args.cmd == "base":
        for release in args.release or RELEASES:
            print(ensure_base(release))
    elif args.cmd == "leftovers":
        found = leftovers(None if args.all else args.pool)
        print("\n".join(found) or "nothing left behind")
        return 1 if found else 0
    return 0


def _print_hosts(hosts: list[Host], as_json: bool) -> None:
    if as_json:
        print(json.dumps([
            {k: v for k, v in h.as_dict().items() if k != "pid"} for h in hosts
        ], indent=1))
        return
    for h in hosts:
        print(f"{h.name}\t{h.address}\t{h.release}\t{h.gpu or '-'}" + (f"\t{h.netns}" if h.netns else ""))


if __name__ == "__main__":
    sys.exit(main())
