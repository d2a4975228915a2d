"""End-to-end: SSH hardening on a socket-activated sshd (ssh.socket, Ubuntu 22.10+'s default),
on real Debian 13 test hosts switched to it the way Debian's README.Debian says (ssh.service
disabled, ssh.socket enabled, its ListenStream on the host's own address). Ubuntu hosts cannot
be built here; Debian 13 (OpenSSH 10.0p2, systemd 257) uses the same `Accept=no` socket
passing as Ubuntu 24.04.

Proves:
- the hardening converges in one run and the second changes nothing; `sshd -T` is hardened;
- the socket path is taken: a running ssh.service is restarted, never sent SIGHUP (a SIGHUP
  reload makes a socket-activated sshd exit with "Cannot bind any address"), ssh.socket keeps
  listening on the same address the whole time, ssh.service ends active, not failed, and an
  SSH session opened before the run is still alive after it;
- the fresh-login proof still guards it: a configuration pyinfra cannot log in with (PQ-only
  kex) is restored and new logins work, ssh.socket untouched;
- the dead-man switch still works there: the host's own revert timer puts back an unconfirmed
  drop-in on a socket-activated host and leaves sshd serving logins (ssh.service not failed);
- the host comes back after a reboot (the boot-time revert unit closed an ordering cycle with
  ssh.socket before: systemd dropped the socket and the host had no SSH), and that unit puts
  back an unconfirmed drop-in before ssh.socket listens.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_only.py"
DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
SOCKET_STATE = "systemctl show ssh.socket -p ActiveState -p UnitFileState -p Listen -p NAccepted"


def to_socket_activation(host) -> None:
    """README.Debian's recipe, with the socket on the host's own address (the machine's network
    is shared: never 0.0.0.0:22)."""
    testhosts.ssh(host, (
        "mkdir -p /etc/systemd/system/ssh.socket.d && "
        f"printf '[Socket]\\nListenStream=\\nListenStream={host.address}:22\\n' "
        "> /etc/systemd/system/ssh.socket.d/listen.conf && systemctl daemon-reload && "
        "systemctl disable --now ssh.service && systemctl enable --now ssh.socket"))
    for _ in range(50):
        if testhosts.ssh(host, "systemctl is-active ssh.socket", check=False).stdout.strip() == "active":
            return
        time.sleep(0.2)
    raise AssertionError(f"{host.name}: ssh.socket did not start")


def reboot(host) -> None:
    """testhosts.reboot, and proof that the host really rebooted (/run is emptied) and takes
    logins again. testhosts.reboot can read its boots file while the supervisor rewrites it
    (ValueError on ''): then the login wait below still decides."""
    testhosts.ssh(host, "touch /run/gpufleet-test-not-rebooted")
    try:
        testhosts.reboot(host)
    except ValueError:
        pass
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if testhosts.ssh(host, "test ! -e /run/gpufleet-test-not-rebooted", check=False, timeout=15).returncode == 0:
            return
        time.sleep(1)
    raise AssertionError(f"{host.name}: no login after the reboot")


def journal(host) -> str:
    return testhosts.ssh(host, "journalctl -u ssh.service -u ssh.socket --no-pager -o cat", check=False).stdout


def service_state(host) -> str:
    return testhosts.ssh(host, "systemctl show ssh.service -p ActiveState -p Result -p UnitFileState",
                         check=False).stdout


@pytest.fixture(scope="module")
def socket_hosts(hostpool, tmp_path_factory):
    good, pq_only = hostpool.get("hardening-socket-trixie", 2, release="trixie")
    for host in (good, pq_only):
        to_socket_activation(host)
    before = {h.name: {"socket": testhosts.ssh(h, SOCKET_STATE).stdout,
                       "etc_ssh": testhosts.ssh(h, "find /etc/ssh -type f | sort | xargs sha256sum").stdout}
              for h in (good, pq_only)}
    # a session held open across the run: restarting the socket-activated sshd must keep it
    session = subprocess.Popen([
        *good.command_prefix(), "ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null", "-i", good.ssh_key, f"{good.ssh_user}@{good.address}",
        "sleep 600 & echo $! > /tmp/gpufleet-test-session.pid; wait"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.5)
    data = {good.name: {}, pq_only.name: {"hardening_extra_kex": []}}
    for host in (good, pq_only):
        data[host.name] = {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], **data[host.name]}
    inv = write_inventory(tmp_path_factory.mktemp("socket") / "inventory.py", [good, pq_only], data=data)
    first = pyinfra(inv, DEPLOY)
    session_alive = session.poll() is None
    good_inv = write_inventory(tmp_path_factory.mktemp("socket2") / "inventory.py", [good],
                               data={good.name: data[good.name]})
    second = pyinfra(good_inv, DEPLOY)
    session.kill()
    session.wait()
    return {"good": good, "pq_only": pq_only, "first": first, "second": second, "before": before,
            "session_alive": session_alive}


def test_socket_activated_host_is_hardened_by_the_socket_path(socket_hosts):
    good, first = socket_hosts["good"], socket_hosts["first"]
    assert f"[{good.name}] Success" in first.output or "a fresh SSH login with the new sshd configuration works" in first.output, first.output
    assert "Install the hardened sshd drop-in (restart, keep ssh.socket)" in first.output, first.output
    effective = testhosts.ssh(good, "sshd -T").stdout
    assert "passwordauthentication no" in effective
    assert "kexalgorithms mlkem768x25519-sha256," in effective  # OpenSSH 10.0: PQ hybrids first
    assert testhosts.ssh(good, f"test -s {DROPIN} && ! test -e /var/lib/gpufleet/sshd.pending", check=False).returncode == 0
    log = journal(good)
    assert "Cannot bind any address" not in log and "Received SIGHUP" not in log, log[-2000:]
    state = service_state(good)
    assert "ActiveState=active" in state and "Result=success" in state, state
    assert "UnitFileState=disabled" in state  # gpufleet did not switch the host back to a daemon
    socket = testhosts.ssh(good, SOCKET_STATE).stdout
    assert "ActiveState=active" in socket and f"Listen={good.address}:22 (Stream)" in socket, socket
    assert socket_hosts["session_alive"], "the SSH session open during the run was cut"
    assert testhosts.ssh(good, "true", check=False).returncode == 0


def test_second_run_changes_nothing_on_the_socket_host(socket_hosts):
    second = socket_hosts["second"]
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output
    assert "restart a running socket-activated sshd" not in " ".join(changed_operations(second))


def test_lockout_proof_restores_on_a_socket_activated_host(socket_hosts):
    host, first, before = socket_hosts["pq_only"], socket_hosts["first"], socket_hosts["before"]
    assert "gpufleet did not keep the hardened sshd configuration" in first.output, first.output
    assert "The previous configuration was restored and sshd reloaded; new logins work again" in first.output
    after = testhosts.ssh(host, "find /etc/ssh -type f | sort | xargs sha256sum").stdout
    assert after == before[host.name]["etc_ssh"]
    socket = testhosts.ssh(host, SOCKET_STATE).stdout
    assert "ActiveState=active" in socket and f"Listen={host.address}:22 (Stream)" in socket
    assert "Result=success" in service_state(host) and "Cannot bind any address" not in journal(host)
    assert testhosts.ssh(host, "true", check=False).returncode == 0


def test_revert_timer_puts_back_an_unconfirmed_dropin_on_a_socket_host(socket_hosts):
    """What a run cut off after the restart leaves: a new drop-in in force, the previous one in
    the backup, the pending marker and the host's own timer (armed exactly as the install
    script arms it, with the script it wrote). The timer must put the previous one back and
    sshd must go on serving logins through the socket."""
    host = socket_hosts["good"]
    backup = "/var/lib/gpufleet/backup" + DROPIN + ".previous"
    testhosts.ssh(host, (
        f"set -e; rm -f {backup}.absent; cp -p {DROPIN} {backup}; sed -i 's/^MaxAuthTries .*/MaxAuthTries 5/' {DROPIN}; "
        f"echo {DROPIN} > /var/lib/gpufleet/sshd.pending; sshd -t; systemctl try-restart ssh.service; "
        "sshd -T | grep -qx 'maxauthtries 5'; "
        "systemd-run --quiet --unit=gpufleet-sshd-revert --on-active=2s --timer-property=AccuracySec=1s "
        f"/bin/sh /var/lib/gpufleet/sshd-revert.sh {DROPIN} {backup} /var/lib/gpufleet/sshd.pending"
    ))
    # the timer fired once the marker is gone and its unit is done (the revert restarts sshd
    # after removing the marker: a login in between is refused, 255, and proves nothing)
    for _ in range(120):
        time.sleep(0.5)
        r = testhosts.ssh(host, "test -e /var/lib/gpufleet/sshd.pending || "
                                "systemctl is-active --quiet gpufleet-sshd-revert.service", check=False)
        if r.returncode == 1 or (r.returncode not in (0, 255)):
            break
    assert testhosts.ssh(host, f"cmp {backup} {DROPIN}", check=False).returncode == 0
    assert "maxauthtries 2" in testhosts.ssh(host, "sshd -T").stdout
    time.sleep(1)
    state = service_state(host)
    assert "ActiveState=active" in state and "Result=success" in state, state + journal(host)[-2000:]
    assert "Cannot bind any address" not in journal(host)
    assert testhosts.ssh(host, "true", check=False).returncode == 0


def test_socket_host_comes_back_after_a_reboot(socket_hosts):
    """The boot-time revert unit gpufleet installs is ordered before ssh.socket without an
    ordering cycle (with default dependencies it was after basic.target, itself after
    sockets.target: systemd dropped ssh.socket's start and the host had no SSH after a reboot)."""
    host = socket_hosts["good"]
    verify = testhosts.ssh(host, "systemd-analyze verify --man=no multi-user.target 2>&1; true").stdout
    assert "ordering cycle" not in verify, verify
    reboot(host)  # waits for a login through ssh.socket
    assert testhosts.ssh(host, "systemctl is-active ssh.socket").stdout.strip() == "active"
    assert "ordering cycle" not in testhosts.ssh(host, "journalctl -b --no-pager", check=False).stdout


def test_boot_revert_restores_before_ssh_socket_listens(socket_hosts):
    """What a run cut off by a reboot leaves (an unconfirmed drop-in, its marker; the transient
    timer is gone with the reboot): put back before ssh.socket starts listening."""
    host = socket_hosts["good"]
    backup = "/var/lib/gpufleet/backup" + DROPIN + ".previous"
    testhosts.ssh(host, (
        f"set -e; rm -f {backup}.absent; cp -p {DROPIN} {backup}; sed -i 's/^MaxAuthTries .*/MaxAuthTries 5/' {DROPIN}; "
        f"echo {DROPIN} > /var/lib/gpufleet/sshd.pending; sshd -T | grep -qx 'maxauthtries 5'"
    ))
    reboot(host)
    assert testhosts.ssh(host, "test -e /var/lib/gpufleet/sshd.pending", check=False).returncode != 0
    assert "maxauthtries 2" in testhosts.ssh(host, "sshd -T").stdout
    order = testhosts.ssh(host, "journalctl -b -o cat --no-pager | grep -n -E "
                                "'^(Finished gpufleet-sshd-revert-at-boot|Listening on ssh.socket)'").stdout
    lines = order.splitlines()
    assert len(lines) == 2 and "gpufleet" in lines[0] and "ssh.socket" in lines[1], order
