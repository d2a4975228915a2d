"""End-to-end: the firewall and the sshd dead-man switch on hosts with a network of their own.

Each host runs in a network namespace the harness made (tools/testhosts up --private-network):
it has CAP_NET_ADMIN there, so nftables really loads, and it is reached from the pool's client
namespace only, as pyinfra is run here (`ip netns exec NETNS pyinfra ...`). Every check is a
real TCP connect or SSH login from that namespace, or the host's own state over SSH.

- converge: after deploys/all.py (a research host with 4 simulated A100s, NVIDIA's
  repositories replaced by the stand-in served on the machine's loopback and forwarded to the
  host's), SSH and the listed port are open, an unlisted port is closed; a second all.py
  changes nothing; after a real reboot the table is loaded from /etc/nftables.conf, the ports
  are as before and a third all.py changes nothing (the applied record is on disk);
- a ruleset that breaks the fresh login (sshd moved to a port only its configuration knows,
  the running daemon still on 22) is reverted live, /etc/nftables.conf and nftables.service
  stay as they were, and after a reboot the host boots the previous rules and lets us in;
  the operator's own table (their /etc/nftables.conf, kept in /etc/nftables.d/) is loaded
  live and at boot throughout;
- rules in /etc/nftables.d that are not what is loaded (never loaded; loaded, then the file
  changed) would boot through no proven login: refused, nothing changed; once loaded, proven;
The other cases run the hardening step the way all.py runs it (tests/e2e/deploys/
hardening_all_path.py: fact cache, prefetch, inventory check), on hosts without GPUs:
- an sshd configuration that refuses the deploy user, whose run is killed before it can
  restore it, is put back by the timer on the host within its timeout, or at boot when the
  host goes down first; a drop-in left pending
  by a run interrupted before its confirmation is verified by the next run, and the timer
  does not revert it afterwards.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time

import pytest

from testing import testhosts
from testing.aptrepo import aptrepo  # noqa: F401  (session fixture)
from testing.inventory import OS_RELEASE, TEST_DRIVER, environment_data, write_inventory
from testing.netns import host_tcp_open
from tests.e2e.pyinfra_cli import PYINFRA, REPO, changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_all_path.py"
DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
PENDING = "var/lib/gpufleet/sshd.pending"
LISTENER = (
    "import selectors,socket\n"
    "sel=selectors.DefaultSelector()\n"
    "for p in (9400,8080):\n"
    "    s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    "    s.bind(('0.0.0.0',p)); s.listen(16); sel.register(s,selectors.EVENT_READ)\n"
    "while True:\n"
    "    for k,_ in sel.select():\n"
    "        c,_=k.fileobj.accept(); c.close()\n"
)


def start_listener(host) -> None:
    """TCP listeners on 9400 (listed) and 8080 (not listed) inside the host."""
    testhosts.ssh(host, "systemd-run --unit=gf-test-listen /usr/bin/python3 -c " + shlex.quote(LISTENER))
    deadline = time.monotonic() + 10
    while testhosts.ssh(host, "ss -ltn | grep -q ':8080 '", check=False).returncode:
        assert time.monotonic() < deadline, "the test listener did not start"
        time.sleep(0.2)


def gpufleet_table(host) -> str:
    return testhosts.ssh(host, "nft list table inet gpufleet").stdout


def boot_state(host) -> str:
    """The boot configuration: /etc/nftables.conf and whether nftables.service loads it."""
    return testhosts.ssh(host, "sha256sum /etc/nftables.conf; systemctl is-enabled nftables.service",
                         check=False).stdout


def inventory(tmp_path, host, **data):
    base = {"tier": "dev", "validate_os_release": OS_RELEASE[host.release],
            "firewall_open_ports": ["9400/tcp"]}
    return write_inventory(tmp_path / f"{host.name}.py", [host], data={host.name: {**base, **data}})


@pytest.fixture(scope="module")
def hosts(hostpool):
    hosts = hostpool.get("firewall-private", 2, private_network=True)
    for host in hosts:
        assert host.netns and not host.address.startswith("127.")
    return hosts


@pytest.mark.gpusim
def test_converged_firewall_survives_a_real_reboot_as_a_no_op(hostpool, aptrepo, tmp_path):  # noqa: F811
    host, = hostpool.get("firewall-private-gpu", 1, gpu=f"a100x4@{TEST_DRIVER}", private_network=True,
                         forward=(aptrepo.port,))
    inv = write_inventory(tmp_path / "inventory.py", [host], data={host.name: {
        **environment_data(host, "research", aptrepo), "firewall_open_ports": ["9400/tcp"],
        # the test's own listener holds 9400 (tests/e2e/test_monitoring.py covers the exporters)
        "monitoring_node_exporter": False, "monitoring_dcgm_exporter": False}})
    start_listener(host)
    assert host_tcp_open(host, 8080) and host_tcp_open(host, 9400)  # nothing filters yet

    first = pyinfra(inv, netns=host.netns)
    assert first.returncode == 0, first.output
    assert "saved to /etc/nftables.conf for the next boot" in first.output
    assert host_tcp_open(host, 22) and host_tcp_open(host, 9400)
    assert not host_tcp_open(host, 8080), "a port not in the tier's list is open"
    table = gpufleet_table(host)
    assert "tcp dport 9400 accept" in table
    assert testhosts.ssh(host, "systemctl is-active gpufleet-nft-revert.timer", check=False).stdout.strip() \
        != "active", "the revert timer is still armed after the confirmation"

    second = pyinfra(inv, netns=host.netns)
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output

    # Debian's untouched stock /etc/nftables.conf (flush ruleset, an accept-all table) holds
    # nobody's tables: replaced, not kept.
    assert testhosts.ssh(host, "ls /etc/nftables.d 2>/dev/null", check=False).stdout == ""

    testhosts.reboot(host)
    assert testhosts.ssh(host, "cat /proc/1/comm").stdout.strip() == "systemd"
    assert gpufleet_table(host) == table  # loaded at boot by nftables.service
    assert "table inet filter" not in testhosts.ssh(host, "nft list tables").stdout
    start_listener(host)
    assert host_tcp_open(host, 22) and host_tcp_open(host, 9400)
    assert not host_tcp_open(host, 8080)

    third = pyinfra(inv, netns=host.netns)
    assert third.returncode == 0, third.output
    assert changed_operations(third) == [], third.output


OPERATOR_RULES = """#!/usr/sbin/nft -f
flush ruleset
table inet operator {
	chain input {
		type filter hook input priority 10; policy accept;
		tcp dport 7777 counter
	}
}
"""


def test_ruleset_that_breaks_the_login_is_reverted_live_and_at_boot(hosts, tmp_path):
    host = hosts[0]
    # The operator's own firewall, loaded and in /etc/nftables.conf: it must stay, live and at boot.
    testhosts.ssh(host, "apt-get install -y -qq nftables >/dev/null 2>&1 && cat > /etc/nftables.conf <<'EOF'\n"
                        + OPERATOR_RULES + "EOF\nnft -f /etc/nftables.conf", timeout=300)
    inv = inventory(tmp_path, host, firewall_revert_after=600)  # this run reverts, not the timer
    first = pyinfra(inv, DEPLOY, netns=host.netns)
    assert first.returncode == 0, first.output
    table, boot = gpufleet_table(host), boot_state(host)
    assert "tcp dport 22 accept" in table and "enabled" in boot
    assert "table inet operator" in testhosts.ssh(host, "nft list tables").stdout
    assert testhosts.ssh(host, "cat /etc/nftables.d/00-before-gpufleet.nft").stdout == OPERATOR_RULES

    # sshd's configuration moves it to 2222; the running daemon has not been restarted yet,
    # so the rules built from `sshd -T` shut out the port every login really uses.
    testhosts.ssh(host, "printf 'Port 2222\\n' > /etc/ssh/sshd_config.d/01-moved.conf")
    broken = pyinfra(inv, DEPLOY, netns=host.netns)
    assert broken.returncode != 0, broken.output
    assert f"[{host.name}] failed (firewall): a fresh SSH login failed with the new firewall rules" in broken.output
    assert "the previous rules were restored" in broken.output
    assert gpufleet_table(host) == table  # live: as before
    assert boot_state(host) == boot  # boot configuration: as before
    assert host_tcp_open(host, 22)

    testhosts.ssh(host, "rm /etc/ssh/sshd_config.d/01-moved.conf")
    testhosts.reboot(host)  # waits for a login through whatever the boot loaded
    assert gpufleet_table(host) == table
    assert "2222" not in table
    assert "table inet operator" in testhosts.ssh(host, "nft list tables").stdout  # the operator's, at boot

    again = pyinfra(inv, DEPLOY, netns=host.netns)
    assert again.returncode == 0, again.output
    assert changed_operations(again) == [], again.output


LAB_RULES = """table inet lab {
	chain input {
		type filter hook input priority 5; policy accept;
		tcp dport 22 drop comment "a rule nobody ever loaded: it would shut SSH out at the next boot"
	}
}
"""


def test_rules_that_would_boot_unproven_are_refused_before_anything_changes(hosts, tmp_path):
    """An operator's file in /etc/nftables.d that is not what is loaded would be loaded at the
    next boot, through no proven login: refused (not loaded, then loaded but changed), with
    nothing changed; once it is what is loaded, the run goes on and boots it."""
    host = hosts[0]  # after the test above: the operator's kept table is loaded and boots first
    lab = "/etc/nftables.d/50-lab.nft"
    testhosts.ssh(host, f"mkdir -p /etc/nftables.d && cat > {lab} <<'EOF'\n{LAB_RULES}EOF")
    inv = inventory(tmp_path, host, firewall_open_ports=["9400/tcp", "9401/tcp"])  # a change to load
    live, boot = testhosts.ssh(host, "nft -s list ruleset").stdout, boot_state(host)
    try:
        never_loaded = pyinfra(inv, DEPLOY, netns=host.netns)
        assert never_loaded.returncode != 0, never_loaded.output
        assert f"table inet lab ({lab}) is not loaded now" in never_loaded.output, never_loaded.output
        refusal = next(line for line in never_loaded.output.splitlines() if "no login was ever proven" in line)
        assert "inet operator" not in refusal  # the operator's kept table is loaded as it boots: proven
        assert testhosts.ssh(host, "nft -s list ruleset").stdout == live and boot_state(host) == boot
        assert testhosts.ssh(host, "systemctl is-active gpufleet-nft-revert.timer", check=False).stdout.strip() != "active"
        assert _root_login(host) and host_tcp_open(host, 22)

        # loaded now without the rule that drops SSH; the file still has it: not what boots
        testhosts.ssh(host, f"grep -v 'dport 22' {lab} | nft -f -")
        changed = pyinfra(inv, DEPLOY, netns=host.netns)
        assert changed.returncode != 0, changed.output
        assert f"table inet lab ({lab}) is loaded now, but not as it boots" in changed.output, changed.output
        assert "9401" not in gpufleet_table(host) and boot_state(host) == boot

        # what boots is what is loaded: the proof covers it, the run goes on
        testhosts.ssh(host, f"sed -i '/dport 22/d' {lab} && nft delete table inet lab && nft -f {lab}")
        proven = pyinfra(inv, DEPLOY, netns=host.netns)
        assert proven.returncode == 0, proven.output
        assert "tcp dport 9401 accept" in gpufleet_table(host)
        assert "enabled" in boot_state(host) and boot_state(host) != boot
        assert _root_login(host)
    finally:
        testhosts.ssh(host, f"rm -f {lab}; nft delete table inet lab", check=False)


def _popen_pyinfra(inv, host) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", host.netns, str(PYINFRA), "-y", str(inv), DEPLOY],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200"),
    )


def _wait_for(predicate, timeout: float, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


def _root_login(host) -> bool:
    """A fresh login as the deploy user (the host's SSH user) works, and sudo to root."""
    return testhosts.ssh(host, "true", check=False, timeout=15).returncode == 0


def _console(host, script: str) -> subprocess.CompletedProcess:
    """Run `script` as root on the host's console, without SSH (which the test may have shut out):
    in all its namespaces (systemctl needs its PID namespace as well as its mounts)."""
    from testing.netns import container_pid

    return subprocess.run(["nsenter", "-t", str(container_pid(host)), "-a", "--", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30)


def _run_cut_off_with_a_refusing_config(host, tmp_path, revert_after: int) -> float:
    """A run installs an AllowUsers that shuts the deploy user out, and is cut off once that is
    live, before its login proof could restore anything. Returns when it was cut off.
    The deploy user is listed only from an address the controller never has (192.0.2.1, TEST-NET-1):
    planning judges only the user part of USER@HOST (gpufleet/catalog/sshd_policy.py), so this lock-out
    gets past it, as an operator's wrong address would; a list without the deploy user would be
    refused at planning (tests/e2e/test_hardening_lockout.py).
    The run is frozen the moment its drop-in is pending (the install script on the host goes on
    and arms the timer; the run sends nothing more), killed, and sshd is told of the new
    configuration from the console exactly as the run's next command would have (RELOAD_SSHD_SCRIPT).
    Waiting instead for the login to fail raced the run's own proof: it gives up after about 5 s
    and restores the previous configuration itself, which a slow test noticed too late."""
    from gpufleet.operations.ssh import RELOAD_SSHD_SCRIPT, REVERT_UNIT

    testhosts.ssh(host, "id alice >/dev/null 2>&1 || { useradd -m -s /bin/bash alice && mkdir -m 700 ~alice/.ssh && "
                        "cp /root/.ssh/authorized_keys ~alice/.ssh/ && chown -R alice: ~alice/.ssh; }")
    user = host.pyinfra_data()["ssh_user"]
    inv = inventory(tmp_path, host, hardening_allow_users=["alice", user + "@192.0.2.1"],
                    hardening_sshd_revert_after=revert_after)
    pending = host.root / PENDING
    run = _popen_pyinfra(inv, host)
    try:
        assert _wait_for(pending.exists, 300), "the run never installed the drop-in"
        os.killpg(run.pid, signal.SIGSTOP)
        cut_at = time.monotonic()
        os.killpg(run.pid, signal.SIGKILL)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert _wait_for(lambda: _console(host, f"systemctl is-active --quiet {REVERT_UNIT}.timer").returncode == 0,
                     10, step=0.1), "the revert timer was never armed"
    told = _console(host, RELOAD_SSHD_SCRIPT)
    assert told.returncode == 0, told.stderr
    assert _wait_for(lambda: not _root_login(host), 20, step=0), "the drop-in never took effect"
    assert (host.root / DROPIN.lstrip("/")).exists() and pending.exists()
    return cut_at


def test_sshd_config_refusing_the_login_is_reverted_by_the_host_alone(hosts, tmp_path):
    host = hosts[1]
    before = testhosts.ssh(host, "sshd -T").stdout
    revert_after = 20
    cut_at = _run_cut_off_with_a_refusing_config(host, tmp_path, revert_after)
    pending = host.root / PENDING
    # No operator action: the host's own timer puts the previous configuration back.
    assert _wait_for(lambda: _root_login(host), revert_after + 30, step=1), "still locked out"
    print(f"\nlogins back {time.monotonic() - cut_at:.1f} s after the run was cut off "
          f"(hardening_sshd_revert_after: {revert_after})")
    assert not (host.root / DROPIN.lstrip("/")).exists() and not pending.exists()
    assert testhosts.ssh(host, "sshd -T").stdout == before


def test_unconfirmed_sshd_config_is_put_back_at_boot(hosts, tmp_path):
    host = hosts[1]
    before = testhosts.ssh(host, "sshd -T").stdout
    _run_cut_off_with_a_refusing_config(host, tmp_path, revert_after=3600)
    # The host goes down before the timer (a transient unit) could fire: the boot puts the
    # previous configuration back before sshd starts. reboot() waits for a root login.
    testhosts.reboot(host, console=True)
    assert not (host.root / DROPIN.lstrip("/")).exists() and not (host.root / PENDING).exists()
    assert testhosts.ssh(host, "sshd -T").stdout == before


def test_drop_in_left_pending_by_an_interrupted_run_is_verified_by_the_next(hosts, tmp_path):
    host = hosts[1]
    revert_after = 40
    inv = inventory(tmp_path, host, hardening_sshd_revert_after=revert_after)
    pending = host.root / PENDING
    run = _popen_pyinfra(inv, host)
    try:
        assert _wait_for(pending.exists, 300), "the run never installed the drop-in"
        os.killpg(run.pid, signal.SIGSTOP)  # frozen right after the install: not confirmed
        stopped_at = time.monotonic()
        assert pending.exists(), "the run confirmed the drop-in before it could be interrupted"
        os.killpg(run.pid, signal.SIGKILL)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert testhosts.ssh(host, "systemctl is-active gpufleet-sshd-revert.timer", check=False).stdout.strip() == "active"
    dropin = (host.root / DROPIN.lstrip("/")).read_bytes()

    nxt = pyinfra(inv, DEPLOY, netns=host.netns)
    assert nxt.returncode == 0, nxt.output
    assert time.monotonic() - stopped_at < revert_after, "too slow to prove anything: the timer could have run"
    assert f"[{host.name}] a fresh SSH login with the new sshd configuration works" in nxt.output
    assert not pending.exists()
    assert testhosts.ssh(host, "systemctl is-active gpufleet-sshd-revert.timer", check=False).stdout.strip() != "active"
    # Past the timeout: the confirmed drop-in is still in force.
    time.sleep(max(0.0, revert_after + 5 - (time.monotonic() - stopped_at)))
    assert (host.root / DROPIN.lstrip("/")).read_bytes() == dropin
    assert "passwordauthentication no" in testhosts.ssh(host, "sshd -T").stdout

    last = pyinfra(inv, DEPLOY, netns=host.netns)
    assert last.returncode == 0, last.output
    assert changed_operations(last) == [], last.output
