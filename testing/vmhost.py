"""Disposable Debian test hosts as qemu virtual machines: for what a container cannot show.

Test infrastructure, not production code. A systemd-nspawn test host (testing/testhosts.py)
shares this machine's kernel, which has no md and no device-mapper; a VM test host runs
Debian's own kernel, so md RAID0, XFS and udev's incremental assembly are real. The VM is a
test double only for the hardware: qemu emulates the NVMe controllers (the guest sees
/dev/nvme0n1 ... with TRAN nvme, as on an HGX) and the machine.

    base (testhosts.ensure_base)  --copy + native chroot apt-->  rootfs with a kernel, mdadm,
    xfsprogs, udev and a SMALL initramfs made here (MODULES=list)  --mkfs.ext4 -d-->  root.img
    (cached per recipe)  --sparse copy per VM-->  qemu -kernel/-initrd, root on virtio

The guest never runs update-initramfs (under software emulation it takes many minutes): the
initramfs is made natively while the image is built. It looks to gpufleet like the other test
hosts: the same users, sudo rule and SSH key (baked into the image, whose cache key includes
the key), reached on a loopback address of the pool's /24 that qemu forwards to the guest's
port 22 (user-mode networking: the guest's own network is qemu's private one, and it reaches
Debian's archive through qemu's NAT). A VM is started and stopped by its qemu PID; its files
live in <pool>/vms/<name> and go with it.

Acceleration: GPUFLEET_VM_ACCEL=kvm|tcg, default tcg. Nested KVM on this kind of machine hung
a Debian kernel at early boot (helper-5, measured again here); TCG (software emulation) boots
it in ~30 s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from testing import testhosts
from testing.testhosts import CACHE_ROOT, Host, log, run

RELEASE = "bookworm"
# What the image adds to the base; changing it (or the version) changes the cache key.
# nfs-kernel-server: a real NFS export the guest mounts from itself, standing for a site's NFS
# (tests/e2e/test_storage_raid.py); off at boot, started by the test that needs it.
VM_PACKAGES = ("linux-image-amd64", "mdadm", "xfsprogs", "udev", "libnss-myhostname", "e2fsprogs", "lvm2",
               "nfs-kernel-server")
# MODULES=list: only what finds the root (virtio block on PCI, ext4) goes into the initramfs,
# plus what its hooks add (mdadm's adds md and raid0). A few MB instead of ~30.
INITRAMFS_MODULES = ("virtio_pci", "virtio_blk", "virtio_net", "ext4", "crc32c_generic", "nvme")
VM_RECIPE_VERSION = 2
ROOT_SIZE = "2G"
MEMORY_MIB = 1536
ACCEL = os.environ.get("GPUFLEET_VM_ACCEL", "tcg")
QEMU = "qemu-system-x86_64"


def image_key(release: str = RELEASE) -> str:
    pub = testhosts.ssh_key().with_suffix(".pub").read_text()
    recipe = json.dumps({"base": testhosts.recipe_key(release), "packages": VM_PACKAGES,
                         "modules": INITRAMFS_MODULES, "v": VM_RECIPE_VERSION, "size": ROOT_SIZE,
                         "key": pub}, sort_keys=True)
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def image_dir(release: str = RELEASE) -> Path:
    return CACHE_ROOT / f"vm-{release}-{image_key(release)}"


def ensure_image(release: str = RELEASE) -> Path:
    """The cached VM image folder (vmlinuz, initrd.img, root.img), built once per recipe."""
    image = image_dir(release)
    if (image / ".gpufleet-vm-complete").exists():
        return image
    base = testhosts.ensure_base(release)
    with testhosts._flock(CACHE_ROOT / f".lock-vm-{release}"):
        if (image / ".gpufleet-vm-complete").exists():
            return image
        t0 = time.monotonic()
        log(f"building the {release} VM image (once per recipe) into {image}")
        tmp = image.with_name(image.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        rootfs = tmp / "rootfs"
        run(["cp", "-a", str(base), str(rootfs)])
        (rootfs / ".gpufleet-base-complete").unlink(missing_ok=True)
        _install(rootfs)
        boot = rootfs / "boot"
        kernel = sorted(boot.glob("vmlinuz-*"))[-1]
        version = kernel.name.removeprefix("vmlinuz-")
        _chroot(rootfs, "mkinitramfs", "-o", f"/boot/initrd.img-{version}", version)
        shutil.copy(kernel, tmp / "vmlinuz")
        shutil.copy(boot / f"initrd.img-{version}", tmp / "initrd.img")
        run(["mkfs.ext4", "-q", "-F", "-L", "gf-vm-root", "-d", str(rootfs), str(tmp / "root.img"), ROOT_SIZE])
        shutil.rmtree(rootfs)
        (tmp / ".gpufleet-vm-complete").write_text(image_key(release) + "\n")
        tmp.rename(image)
        log(f"{release} VM image ready in {time.monotonic() - t0:.0f} s")
    return image


def _chroot(rootfs: Path, *command: str) -> None:
    # /proc for the maintainer scripts, in a mount namespace of its own: it goes when the
    # command ends, whatever happens, so no mount is ever left behind on the machine.
    script = 'mount -t proc proc "$1/proc" && root=$1 && shift && exec chroot "$root" "$@"'
    run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(rootfs), *command],
        env=dict(os.environ, DEBIAN_FRONTEND="noninteractive", LC_ALL="C"), stdout=subprocess.DEVNULL)


def _install(rootfs: Path) -> None:
    etc = rootfs / "etc"
    # No service starts in the chroot; update-initramfs (each package's trigger) does nothing:
    # one small initramfs is made at the end (ensure_image).
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    (etc / "initramfs-tools/conf.d").mkdir(parents=True, exist_ok=True)
    (etc / "initramfs-tools/conf.d/gpufleet-vm").write_text("MODULES=list\nCOMPRESS=gzip\n")
    (etc / "initramfs-tools/modules").write_text("".join(m + "\n" for m in INITRAMFS_MODULES))
    _chroot(rootfs, "dpkg-divert", "--local", "--rename", "--add", "/usr/sbin/update-initramfs")
    (rootfs / "usr/sbin/update-initramfs").symlink_to("/bin/true")
    _chroot(rootfs, "apt-get", "update", "-qq")
    _chroot(rootfs, "apt-get", "install", "-y", "-qq", "--no-install-recommends",
            "-o", "Dpkg::Options::=--force-confold", *VM_PACKAGES)
    _chroot(rootfs, "apt-get", "clean")
    (rootfs / "usr/sbin/update-initramfs").unlink()
    _chroot(rootfs, "dpkg-divert", "--local", "--rename", "--remove", "/usr/sbin/update-initramfs")
    policy.unlink()
    # A machine, not a container: root on the virtio disk, DHCP from qemu, its DNS.
    (etc / "fstab").write_text("/dev/vda / ext4 rw,errors=remount-ro 0 1\n")
    (etc / "systemd/network").mkdir(parents=True, exist_ok=True)
    (etc / "systemd/network/10-qemu.network").write_text("[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n")
    _chroot(rootfs, "systemctl", "enable", "systemd-networkd.service")
    # the NFS server and rpcbind start only when a test starts them: no boot pays for them
    _chroot(rootfs, "systemctl", "disable", "nfs-server.service", "rpcbind.service", "rpcbind.socket")
    with contextlib.suppress(FileNotFoundError):
        (etc / "resolv.conf").unlink()
    (etc / "resolv.conf").write_text("nameserver 10.0.2.3\n")  # qemu's user-mode DNS
    (etc / "hosts").write_text("127.0.0.1 localhost\n")  # the VM's own name: nss-myhostname
    (etc / "apt/apt.conf.d/99gpufleet-vm").write_text('Acquire::Retries "3";\n')
    # The test key logs every test user in, as on the container test hosts (_personalise).
    key = testhosts.ssh_key().with_suffix(".pub").read_text()
    for user, (uid, gid, home) in testhosts._passwd_ids(rootfs).items():
        if user not in ("root", *testhosts.TEST_USERS):
            continue
        ssh_dir = rootfs / home.lstrip("/") / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(key)
        (ssh_dir / "authorized_keys").chmod(0o600)
        for path in (ssh_dir, ssh_dir / "authorized_keys"):
            os.chown(path, uid, gid)


# --------------------------------------------------------------------------------------------
# VMs: up, reboot, stop
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Drive:
    """An emulated NVMe drive: a raw image file on this machine, its serial in the guest."""
    image: Path
    serial: str


def vms_dir(pool: str) -> Path:
    return testhosts.pool_dir(pool) / "vms"


def vm_dir(host: Host) -> Path:
    return vms_dir(host.pool) / host.name


def up(pool: str, drives: list[Drive], name: str = "vm1", timeout: float = 300,
       release: str = RELEASE) -> Host:
    """Boot a VM test host in `pool` with `drives` as NVMe drives; wait until systemd runs."""
    image = ensure_image(release)
    net = testhosts._pool_net(pool)
    taken = {int(h.address.rsplit(".", 1)[1]) for h in testhosts.list_hosts(pool) + list_vms(pool)}
    last = next(n for n in range(200, 255) if n not in taken)
    host = Host(name=f"gf-{pool}-{name}", address=f"127.0.{net}.{last}", release=release, gpu=None,
                pool=pool, ssh_key=str(testhosts.ssh_key()))
    hdir = vm_dir(host)
    if hdir.exists():
        stop(host)
    hdir.mkdir(parents=True)
    # the tests' commands share one SSH connection per user: a handshake costs the emulated
    # guest seconds (testhosts.ssh)
    host.control_path = str(hdir / "ssh")
    run(["cp", "--sparse=always", str(image / "root.img"), str(hdir / "root.img")])
    _start(host, image, drives, timeout)
    return host


def _start(host: Host, image: Path, drives: list[Drive], timeout: float) -> None:
    """Start qemu for `host` (its root.img in its folder, `drives` as NVMe) and wait for it."""
    hdir = vm_dir(host)
    accel = ACCEL if ACCEL in ("kvm", "tcg") else "tcg"
    qemu = [
        QEMU, "-name", host.name, "-accel", accel, *(["-cpu", "host"] if accel == "kvm" else []),
        "-m", str(MEMORY_MIB), "-smp", "2", "-nodefaults", "-display", "none", "-no-user-config",
        "-monitor", "none", "-serial", f"file:{hdir / 'console.log'}",
        "-kernel", str(image / "vmlinuz"), "-initrd", str(image / "initrd.img"),
        "-append", f"root=/dev/vda rw console=ttyS0 systemd.hostname={host.name} net.ifnames=0 quiet",
        "-drive", f"file={hdir / 'root.img'},if=virtio,format=raw,cache=unsafe",
        "-netdev", f"user,id=n0,hostfwd=tcp:{host.address}:22-:22", "-device", "virtio-net-pci,netdev=n0,romfile=",  # no iPXE ROM: -kernel boots
    ]
    for i, drive in enumerate(drives):
        qemu += ["-drive", f"file={drive.image},if=none,id=nvm{i},format=raw",
                 "-device", f"nvme,serial={drive.serial},drive=nvm{i}"]
    with open(hdir / "qemu.log", "ab") as logf:
        proc = subprocess.Popen(qemu, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    host.pid = proc.pid
    _STARTED[proc.pid] = proc
    (hdir / "meta.json").write_text(json.dumps(host.as_dict(), indent=1))
    try:
        _wait_ready(host, timeout)
    except BaseException:
        log(f"{host.name}: console:\n" + _tail(hdir / "console.log"))
        stop(host)
        raise


def power_cycle(host: Host, drives: list[Drive], while_off: Callable[[], None], timeout: float = 300,
                release: str = RELEASE) -> None:
    """Power the VM off (`systemctl poweroff` in the guest, as a cloud's stop does; qemu exits),
    call `while_off` (a cloud blanks its instance-store drives here: the test rewrites their image
    files), then start it again on the same root disk and drives and wait until it runs."""
    proc = _STARTED.get(host.pid or 0)
    if proc is None:
        raise RuntimeError(f"{host.name}: not started by this process: cannot power-cycle it")
    testhosts.ssh(host, "sync; systemctl poweroff", check=False, timeout=15)
    testhosts.ssh_mux_exit(host)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{host.name}: did not power off\n" + _tail(vm_dir(host) / "console.log")) from None
    _STARTED.pop(proc.pid, None)
    while_off()
    _start(host, ensure_image(release), drives, timeout)


@contextlib.contextmanager
def running(pool: str, drives: list[Drive], name: str = "vm1"):
    """A VM test host (up()) for the with-block, stopped by its qemu PID after it, whatever
    happens; a clear error first where qemu is not installed."""
    if not shutil.which(QEMU):
        raise RuntimeError(f"{QEMU} is missing: run tools/bootstrap (it installs qemu-system-x86)")
    t0 = time.monotonic()
    host = up(pool, drives, name)
    log(f"{host.name}: VM up in {time.monotonic() - t0:.1f} s")
    try:
        yield host
    finally:
        stop(host)


def _wait_ready(host: Host, timeout: float) -> None:
    """Wait for the guest's sshd, then for systemd (testhosts.wait_ready). qemu accepts on the
    forwarded port before the guest listens, so a connection proves nothing: log in."""
    deadline = time.monotonic() + timeout
    direct = _direct(host)
    while True:
        if not _alive(host):
            proc = _STARTED.get(host.pid or 0)
            status = proc.returncode if proc else "?"
            raise RuntimeError(f"{host.name}: qemu exited (status {status}): {_tail(vm_dir(host) / 'qemu.log')}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            # logged in as root (before any hardening): the deploy user's sudo password of this
            # process, on chpasswd's stdin, as the container hosts get it (testhosts._set_password)
            if testhosts.ssh(direct, "chpasswd", user="root", check=False, timeout=10,
                             input=f"{testhosts.SSH_USER}:{testhosts.sudo_password()}\n").returncode == 0:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{host.name}: no SSH login within {timeout:.0f} s")
        time.sleep(1)
    testhosts.wait_ready(host, max(10, deadline - time.monotonic()))


def _direct(host: Host) -> Host:
    """The host reached without its master connection: to poll a guest that is not up yet (a
    master would first wait for a login that cannot happen) or whose connection a reboot ends."""
    return dataclasses.replace(host, control_path=None)


def _tail(path: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def boot_id(host: Host) -> str:
    return testhosts.ssh(host, "cat /proc/sys/kernel/random/boot_id").stdout.strip()


def reboot(host: Host, timeout: float = 300) -> None:
    """A real reboot: `systemctl reboot` in the guest; qemu resets the machine and stays, the
    disks are the same files. Done when the guest answers with another boot id."""
    before = boot_id(host)
    testhosts.ssh(host, "systemctl reboot", check=False, timeout=15)
    testhosts.ssh_mux_exit(host)  # or the first polls still reach the old boot through it
    deadline = time.monotonic() + timeout
    while True:
        if not _alive(host):
            raise RuntimeError(f"{host.name}: qemu exited during the reboot; see {vm_dir(host) / 'console.log'}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            res = testhosts.ssh(_direct(host), "cat /proc/sys/kernel/random/boot_id", check=False, timeout=10)
            if res.returncode == 0 and res.stdout.strip() not in ("", before):
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{host.name}: did not come back from the reboot\n" + _tail(vm_dir(host) / "console.log"))
        time.sleep(1)
    _wait_ready(host, max(10, deadline - time.monotonic()))


def _is_our_qemu(pid: int, hdir: Path) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return cmd.startswith(QEMU.encode()) and str(hdir).encode() in cmd


#: qemu processes this process started, by PID. Popen, not /proc/PID/cmdline, says whether
#: they run: right after Popen returns, exec may not have set the new command line up yet
#: (an empty cmdline made a booting VM look dead, twice in ten runs), and Popen reaps them.
_STARTED: dict[int, subprocess.Popen] = {}


def _alive(host: Host) -> bool:
    proc = _STARTED.get(host.pid or 0)
    if proc is not None:
        return proc.poll() is None
    return bool(host.pid) and _is_our_qemu(host.pid or 0, vm_dir(host))


def stop(host: Host, timeout: float = 10) -> None:
    """Stop the VM by its qemu PID (the guest's disks are files: nothing to flush for a test
    that throws them away) and remove its files."""
    hdir = vm_dir(host)
    pid = host.pid or 0
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        testhosts.ssh_mux_exit(host)  # before qemu goes: its master ssh process ends now, not later
    proc = _STARTED.pop(pid, None)

    def running() -> bool:
        # started here: Popen knows (and reaps it); else the PID must still be this VM's qemu
        return proc.poll() is None if proc is not None else _is_our_qemu(pid, hdir)

    if pid and running():
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout
            while running() and time.monotonic() < deadline:
                time.sleep(0.05)
            if not running():
                break
    shutil.rmtree(hdir, ignore_errors=True)


def list_vms(pool: str) -> list[Host]:
    hosts = []
    for meta in sorted(vms_dir(pool).glob("*/meta.json")):
        host = testhosts._host_from_meta(meta)
        if _alive(host):
            hosts.append(host)
    return hosts


def down(pool: str | None) -> int:
    """Stop every VM of `pool` (every pool when None), also after a killed run."""
    pools = [pool] if pool else [p.name for p in (testhosts.STATE_ROOT / "pools").glob("*") if p.is_dir()]
    count = 0
    for p in pools:
        for hdir in sorted(vms_dir(p).glob("*")):
            meta = hdir / "meta.json"
            host = testhosts._host_from_meta(meta) if meta.exists() else \
                Host(name=hdir.name, address="", release="", gpu=None, pool=p, ssh_key="")
            stop(host)
            count += 1
        with contextlib.suppress(OSError):
            vms_dir(p).rmdir()
    return count


def leftovers() -> list[str]:
    """qemu processes of the harness still running (any pool), and SSH master connections to
    its VMs (testhosts.ssh's, whose sockets live in a VM's folder)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes()
            ours = str(testhosts.STATE_ROOT).encode() in cmd
            if ours and (cmd.startswith(QEMU.encode()) or (cmd.startswith(b"ssh\0") and b"\0-M\0" in cmd)):
                shown = cmd.replace(b"\0", b" ").decode(errors="replace")[:100]
                found.append(f"process {proc.name} {shown}")
    return found
