"""End-to-end: the SSH hardening cannot lock the operator out.

Four real test hosts, one pyinfra run of the hardening deploy, each host set up to hit one
lock-out case; every host must end with sshd's configuration byte-for-byte unchanged (every
file under /etc/ssh, and `sshd -T`), still reachable over SSH (OpenSSH and paramiko), and the
run must say clearly why that host was refused:

- deploy user without an authorized key (pyinfra logs in as `bob` with a password + sudo):
  refused before anything changes;
- a setting that makes `sshd -t` fail (an unknown kex name): candidate taken back, no reload;
- a login that fails after the reload: a post-quantum-only kex list (paramiko 4 has no PQ kex,
  so pyinfra itself could not come back): previous configuration restored and reloaded, new
  logins work again;
- an AllowUsers that excludes the deploy user, PermitRootLogin no while deployed as root, and a
  trusted CIDR of /0: refused at planning (gpufleet/config/settings.py, as deploys/all.py plans),
  naming host and key, in runs of their own (a bad inventory stops the whole run), before any
  host changes.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import pyinfra
from tests.e2e.remote import remote

pytestmark = pytest.mark.e2e

DROPIN = "/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf"
SNAPSHOT = "find /etc/ssh -type f | sort | xargs sha256sum; sshd -T"
PASSWORD = "gpufleet-lockout-test"




@pytest.fixture(scope="module")
def lockout(hostpool, tmp_path_factory):
    nokey, sshd_t = hostpool.get("hardening-lockout-bookworm", 2, release="bookworm")
    pq_only, allow = hostpool.get("hardening-lockout-trixie", 2, release="trixie")
    hosts = {"nokey": nokey, "sshd_t": sshd_t, "pq_only": pq_only, "allow": allow}
    runtime = {case: h for case, h in hosts.items() if case != "allow"}
    # bob: password and passwordless sudo, no authorized key (a fresh cloud host's operator)
    testhosts.ssh(nokey, f"useradd -m -s /bin/bash bob && echo 'bob:{PASSWORD}' | chpasswd && "
                         "echo 'bob ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/bob")
    # alice: has a key, so the key check would pass; but AllowUsers alice shuts the deploy user out
    testhosts.ssh(allow, "useradd -m -s /bin/bash alice && mkdir -m 700 ~alice/.ssh && "
                         "cp /root/.ssh/authorized_keys ~alice/.ssh/ && chown -R alice: ~alice/.ssh")
    before = {case: testhosts.ssh(h, SNAPSHOT).stdout for case, h in hosts.items()}
    data = {
        nokey.name: {"ssh_user": "bob", "ssh_password": PASSWORD, "ssh_key": "", "ssh_look_for_keys": False,
                     "ssh_allow_agent": False, "_sudo": True},
        sshd_t.name: {"hardening_extra_kex": ["curve25519-sha256@libssh.org", "no-such-kex@gpufleet.invalid"]},
        pq_only.name: {"hardening_extra_kex": []},
        allow.name: {"hardening_allow_users": ["alice"]},
    }
    for h in hosts.values():
        data[h.name] = {"tier": "dev", "validate_os_release": OS_RELEASE[h.release], **data[h.name]}
    tmp = tmp_path_factory.mktemp("lockout")
    inv = write_inventory(tmp / "inventory.py", list(runtime.values()), data=data)
    deploy = tmp / "hardening_only.py"
    deploy.write_text("from deploys.hardening import hardening\n\nhardening()\n")
    run = pyinfra(inv, str(deploy))
    # pyinfra pads "[host]" to the longest name: gf-P-9 and gf-P-10 in one run get "[gf-P-9]  ..."
    run = dataclasses.replace(run, output=re.sub(r"(\[[^\]\n]+\]) {2,}", r"\1 ", run.output))
    # the other two lock-out shapes planning refuses, on the same host: root login off (refused
    # only when the deploy user is root) in the same run; a firewall that trusts the whole
    # internet in a run of its own (a bad value: the schema says so before any cross-check)
    refused = {**data[allow.name], "hardening_permit_root_login": "no"}
    allow_inv = write_inventory(tmp / "allow.py", [allow], data={allow.name: refused})
    planning = pyinfra(allow_inv, "tests/e2e/deploys/hardening_only.py")
    internet = {**data[allow.name], "hardening_allow_users": [], "firewall_trusted_cidrs": ["10.0.0.0/8", "::/0"]}
    internet_inv = write_inventory(tmp / "internet.py", [allow], data={allow.name: internet})
    trusted = pyinfra(internet_inv, "tests/e2e/deploys/hardening_only.py")
    planning = dataclasses.replace(planning, returncode=min(planning.returncode, trusted.returncode),
                                   output=planning.output + "\n" + trusted.output)
    after = {case: testhosts.ssh(h, SNAPSHOT).stdout for case, h in hosts.items()}
    return hosts, (run, planning), before, after


def test_every_case_fails_its_host(lockout):
    hosts, (run, _), _, _ = lockout
    assert run.returncode != 0, run.output
    for case, host in hosts.items():
        if case != "allow":
            assert f"[{host.name}] Error" in run.output, run.output


def test_lockouts_are_refused_at_planning_naming_host_and_key(lockout):
    hosts, (_, planning), _, _ = lockout
    host = hosts["allow"]
    user = host.pyinfra_data()["ssh_user"]
    assert planning.returncode != 0, planning.output  # neither run exited 0 (the smaller exit code)
    assert (f"host {host.name}: key 'hardening_allow_users': [alice] does not allow the deploy user {user} "
            "(ssh_user): its next login would be refused; allowed: a list that includes "
            f"{user} (or a pattern matching it), e.g. [{user}, alice]") in planning.output, planning.output
    assert (f"host {host.name}: key 'firewall_trusted_cidrs': '::/0' trusts every address, the whole internet, "
            "on every port; allowed: ") in planning.output, planning.output
    root_off = (f"host {host.name}: key 'hardening_permit_root_login': \"no\" turns root login off, and this host "
                "is deployed as root (ssh_user): its next login would be refused; allowed: prohibit-password")
    assert (root_off in planning.output) == (user == "root"), planning.output
    # refused before planning: no operation ran, not even the hardening deploy's packages
    assert "Grand total" not in planning.output, planning.output
    assert not remote(host).package("nftables").is_installed


@pytest.mark.parametrize("case", ["nokey", "sshd_t", "pq_only", "allow"])
def test_sshd_configuration_unchanged_and_host_reachable(lockout, case):
    hosts, runs, before, after = lockout
    host = hosts[case]
    assert after[case] == before[case], runs[1 if case == "allow" else 0].output
    assert "passwordauthentication yes" in after[case]
    assert testhosts.ssh(host, "test ! -e " + DROPIN).returncode == 0
    # a new login through paramiko, as pyinfra and testinfra make them
    assert remote(host).check_output("echo reachable") == "reachable"


def test_deploy_user_without_key_is_refused_before_any_change(lockout):
    hosts, (run, _), _, _ = lockout
    host = hosts["nokey"]
    assert (f"[{host.name}] failed (hardening_password_auth): SSH passwords would be turned off, and these users "
            "have no authorized key and would be locked out: bob (no key in /home/bob/.ssh/authorized_keys") in run.output
    assert ("nothing was changed. Fix: add a key for each (or set hardening_password_auth: true) and run again"
            in run.output)
    # refused first: not even the packages of the hardening deploy were installed
    assert not remote(host).package("nftables").is_installed


def test_candidate_rejected_by_sshd_t_is_taken_back(lockout):
    hosts, (run, _), _, _ = lockout
    assert "gpufleet: sshd -t rejected the new configuration; the previous one is back in place, " \
           "sshd was not reloaded" in run.output
    assert "no-such-kex@gpufleet.invalid" in run.output


def test_failed_login_after_reload_restores_previous_config(lockout):
    hosts, (run, _), _, _ = lockout
    host = hosts["pq_only"]
    prefix = f"[{host.name}] "
    user = host.pyinfra_data()["ssh_user"]
    assert prefix + "a fresh SSH login failed after the sshd reload (IncompatiblePeer: " \
                    "Incompatible ssh peer (no acceptable kex algorithm))" in run.output
    assert prefix + "failed (hardening): gpufleet did not keep the hardened sshd configuration: a new SSH " \
                    f"login as {user} failed with it" in run.output
    assert "The previous configuration was restored and sshd reloaded; new logins work again. Fix: adjust the " \
           "hardening_* settings" in run.output
