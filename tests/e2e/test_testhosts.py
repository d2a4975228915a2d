"""The test-host harness itself: real hosts come up, reboot for real, and leave nothing behind,
also when the run that started them was killed."""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testing import testhosts

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
POOL = "pytest-harness"


def _tool(*args: str) -> subprocess.CompletedProcess:
    testhosts.sudo_password()  # made here, in this process's environment: the tool sets it on the hosts
    return subprocess.run([sys.executable, str(REPO / "tools/testhosts"), "--pool", POOL, *args],
                          capture_output=True, text=True, timeout=300)


def _pool_leftovers() -> list[str]:
    return testhosts.leftovers(POOL)


@pytest.fixture
def clean_pool(hostpool):  # hostpool: skips or fails when this machine cannot run hosts
    testhosts.down(POOL)
    yield
    testhosts.down(POOL)
    assert _pool_leftovers() == []


def test_cli_up_list_down(clean_pool):
    up = _tool("up", "2")
    assert up.returncode == 0, up.stderr
    assert "debootstrapping" not in up.stderr  # the cached base is reused
    listed = json.loads(_tool("list", "--json").stdout)
    assert [h["name"] for h in listed] == [f"gf-{POOL}-1", f"gf-{POOL}-2"]
    for h in listed:
        assert set(h) >= {"name", "address", "release", "gpu", "ssh_user", "ssh_key"}
        assert h["address"].startswith("127.")
        # a real site's shape: an unprivileged login user (useradd's /bin/sh) whose sudo asks
        # for the password the tool set (this process's: the tool inherited it), read from stdin
        assert h["ssh_user"] == testhosts.SSH_USER != "root"
        res = subprocess.run(["ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                              "-o", "UserKnownHostsFile=/dev/null", "-i", h["ssh_key"],
                              f"{h['ssh_user']}@{h['address']}",
                              "hostname; cat /proc/1/comm; id -u; getent passwd $(id -u) | cut -d: -f7; "
                              "sudo -n true 2>/dev/null || echo asks; sudo -S -k -p '' id -u"],
                             input=f"{testhosts.sudo_password()}\n", capture_output=True, text=True, timeout=30)
        assert res.stdout.split() == [h["name"], "systemd", "1000", "/bin/sh", "asks", "0"], res.stdout + res.stderr
    plain = _tool("list").stdout.splitlines()
    assert plain[0].split("\t") == [f"gf-{POOL}-1", listed[0]["address"], "bookworm", "-"]
    down = _tool("down")
    assert down.returncode == 0, down.stderr
    assert _tool("list", "--json").stdout.strip() == "[]"
    assert _pool_leftovers() == []


def test_killed_run_is_cleaned_up_by_the_next(clean_pool):
    host, = testhosts.up(1, pool=POOL)
    # A test run killed with SIGKILL leaves its launcher's children running: simulate that.
    os.kill(host.pid, signal.SIGKILL)
    time.sleep(0.5)
    assert _pool_leftovers(), "the container should still be running"
    assert testhosts.down(POOL) == 1
    assert _pool_leftovers() == []
    assert not host.dir.exists()


def test_reboot_is_real(clean_pool):
    host, = testhosts.up(1, pool=POOL)
    testhosts.ssh(host, "echo volatile > /run/marker; echo kept > /root/marker")
    testhosts.reboot(host)
    out = testhosts.ssh(host, "cat /root/marker; test -e /run/marker && echo run-survived; "
                              "systemctl is-system-running").stdout.split()
    assert out[0] == "kept"
    assert "run-survived" not in out
    assert out[-1] == "running"
    assert (host.dir / "boots").read_text() == "1"  # the first boot ended: one reboot seen


def test_private_network_hosts_live_in_namespaces_only(clean_pool):
    machine_before = subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout
    up = _tool("up", "2", "--private-network")
    assert up.returncode == 0, up.stderr
    listed = json.loads(_tool("list", "--json").stdout)
    netns = {h["netns"] for h in listed}
    assert netns == {f"gft.{POOL}.client"}
    ssh = ["ssh", "-q", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
           "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=5"]
    for h in listed:
        assert not h["address"].startswith("127.")
        login = [*ssh, "-i", h["ssh_key"], f"{h['ssh_user']}@{h['address']}"]
        # not reachable from the machine's own network, only from the client namespace
        assert subprocess.run([*login, "true"], capture_output=True, timeout=30).returncode != 0
        res = subprocess.run(["ip", "netns", "exec", h["netns"], *login,
                              "hostname; ip -br addr show host0; sudo -S -k -p '' sh -c "
                              + shlex.quote("apt-get install -y -qq nftables >/dev/null "
                                            "&& nft add table inet operator && nft list tables")],
                             input=f"{testhosts.sudo_password()}\n", capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        name, addr_line, *tables = res.stdout.splitlines()
        assert name == h["name"] and h["address"] + "/24" in addr_line
        assert tables == ["table inet operator"]  # CAP_NET_ADMIN in its own namespace
    # the machine's network is as it was: no address, no interface added
    assert subprocess.run(["ip", "-br", "addr"], capture_output=True, text=True).stdout == machine_before
    host = next(h for h in testhosts.list_hosts(POOL) if h.name == listed[0]["name"])
    testhosts.reboot(host)  # a real boot starts with no rules loaded
    assert testhosts.ssh(host, "nft list tables").stdout == ""
    # a killed run leaves namespaces behind: leftovers says so, down removes them
    os.kill(host.pid, signal.SIGKILL)
    assert any(item.startswith("netns gft.") for item in _pool_leftovers())
    assert _tool("down").returncode == 0
    assert _pool_leftovers() == []
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                if n.startswith(f"gft.{POOL}.")]
