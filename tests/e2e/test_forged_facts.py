"""End-to-end: a local user listed in hardening_allow_users cannot forge the answers of the
run's one-command fact prefetch (gpufleet/controller/factcache.py) through their own authorized_keys,
which gpufleet reads for them (gpufleet/facts/ssh.py AuthorizedKeys), nor read root-only files
through it.

On a host with a network of its own (nftables really loads, as in test_firewall_private.py):
the hardening step as all.py runs it (tests/e2e/deploys/hardening_all_path.py: fact cache,
prefetch, inventory check) converges with the user allowed to log in; the user then
writes into their authorized_keys sections of the prefetch's output that would answer the
earlier SshdActivation question with an ssh.socket listening on 2375 (the fixed markers of
gpufleet before this change, which the controller took for that fact's answer and opened
2375 in the firewall and saved it for boot; and guesses at the new markers), and links their
authorized_keys2 to /etc/shadow. The next run changes nothing: the live ruleset (`nft list
ruleset`) and /etc/nftables.conf are as the converge left them, 2375 nowhere; the key file
comes back behind ">" and the shadow file not at all.
"""
from __future__ import annotations

import json
import re
import secrets
import shlex
import time

import pytest

from gpufleet.controller import factbatch
from gpufleet.controller import factcache
from gpufleet.facts.ssh import AuthorizedKeys, SshdActivation
from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import REPO, changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_all_path.py"
USER = "mallory"
GROUP = "gpu-users"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKbZsx2k59HNRZdwQjbpkCWsU7BPqSL+QcxT9QsQpChT mallory@lab"
FORGED_PORT = 2375  # Docker's unauthenticated API port: what an attacker would want open
# What `systemctl show ssh.socket ssh.service -p ...` prints for a socket listening on 2375.
FORGED_ACTIVATION = [
    "Accept=no", f"Listen=0.0.0.0:{FORGED_PORT} (Stream)", "Id=ssh.socket", "LoadState=loaded",
    "ActiveState=active", "UnitFileState=enabled", "",
    "Id=ssh.service", "LoadState=loaded", "ActiveState=active", "UnitFileState=disabled",
]


def _single_index(host_name: str, cls: type, user: str | None = None) -> int:
    """Where `cls` is among the single facts of the host's next prefetch (its section number
    in gpufleet's output before this change), from the plan the converge wrote."""
    plan = factcache.read_plan(REPO / factcache.PLAN_DIR / f"{host_name}.json", host_name)
    singles = []
    for path, kwargs_json in plan:
        fact_cls = factcache._load_class(path)
        if fact_cls is None or getattr(fact_cls, "gpufleet_end_of_run", False) \
                or getattr(fact_cls, "gpufleet_no_prefetch", False):
            continue
        kwargs = json.loads(kwargs_json)
        if factbatch.family(fact_cls, kwargs) is None:
            singles.append((path, kwargs.get("user")))
    return singles.index((factcache._fact_path(cls), user))


def forged_key_file(index: int) -> str:
    """The user's authorized_keys: their real key, then sections answering section `index`."""
    guess_nonce, guess_host = secrets.token_hex(8), secrets.token_hex(16)
    lines = [KEY]
    # gpufleet before this change: fixed markers, a repeated one restarted the section
    lines += [f"::gpufleet-prefetch::{index}", *FORGED_ACTIVATION, "::gpufleet-rc::0"]
    # guesses at the new shape (the controller's nonce is on the command line, the host's not)
    lines += [f"::gpufleet-prefetch::{guess_nonce}::host {guess_host}",
              f"::gpufleet-prefetch::{guess_nonce}-{guess_host}::{index}", *FORGED_ACTIVATION,
              f"::gpufleet-rc::{guess_nonce}-{guess_host}::0"]
    # and the fact's own marker: another user's key file
    lines += ["::gpufleet-ssh:: file /root/.ssh/authorized_keys", KEY]
    return "\n".join(lines)  # no final newline: the markers after it must still start a line


def _sh(host, command: str, **kwargs):
    return testhosts.ssh(host, command, **kwargs)


@pytest.fixture(scope="module")
def host(hostpool):
    host, = hostpool.get("factforge", 1, private_network=True)
    assert host.netns
    return host


def test_a_users_forged_prefetch_sections_open_no_port_and_change_nothing(host, tmp_path):
    started = time.monotonic()
    deploy_user = host.pyinfra_data()["ssh_user"] or "root"
    # An ordinary local user with an SSH key, allowed to log in by hardening_allow_users.
    # An ordinary local user with an SSH key, allowed to log in with the deploy user. Through
    # hardening_allow_groups: with two names in hardening_allow_users, sshd -T prints one
    # allowusers line per name and this branch's parser keeps the last one (gpufleet then refuses
    # the hardened configuration; branch sshdlists fixes it): the user's key file is read the
    # same way either way (the group's members are each asked AuthorizedKeys).
    _sh(host, "sh -c " + shlex.quote(
        'id "$1" >/dev/null 2>&1 || useradd -m -s /bin/bash "$1"; h=$(getent passwd "$1" | cut -d: -f6); '
        'install -d -m 700 -o "$1" -g "$1" "$h/.ssh"; printf "%s\\n" "$2" > "$h/.ssh/authorized_keys"; '
        'chown "$1": "$h/.ssh/authorized_keys"; getent group "$3" >/dev/null || groupadd "$3"; '
        'usermod -aG "$3" "$1"; usermod -aG "$3" "$4"; apt-get install -y -qq nftables >/dev/null 2>&1')
        + " gpufleet-test " + " ".join(map(shlex.quote, (USER, KEY, GROUP, deploy_user))), timeout=300)
    inv = write_inventory(tmp_path / "inventory.py", [host], data={host.name: {
        "tier": "dev", "validate_os_release": OS_RELEASE[host.release],
        "firewall_open_ports": ["9400/tcp"], "hardening_allow_groups": [GROUP]}})

    first = pyinfra(inv, DEPLOY, netns=host.netns)
    assert first.returncode == 0, first.output[-6000:]
    ruleset = _sh(host, "nft list ruleset").stdout
    boot = _sh(host, "sha256sum /etc/nftables.conf").stdout
    assert "tcp dport 9400 accept" in ruleset and f"{FORGED_PORT}" not in ruleset

    # The user (as themselves) writes forged sections aimed at the SshdActivation answer, and
    # links their second key file to /etc/shadow.
    index = _single_index(host.name, SshdActivation)
    _sh(host, "runuser -u " + shlex.quote(USER) + " -- sh -c " + shlex.quote(
        "printf '%s' " + shlex.quote(forged_key_file(index)) + " > ~/.ssh/authorized_keys; "
        "ln -sf /etc/shadow ~/.ssh/authorized_keys2"))

    second = pyinfra(inv, DEPLOY, netns=host.netns)
    assert second.returncode == 0, second.output[-6000:]
    after = _sh(host, "nft list ruleset").stdout
    assert f"{FORGED_PORT}" not in after, after
    assert changed_operations(second) == [], second.output[-6000:]
    assert after == ruleset
    assert _sh(host, "sha256sum /etc/nftables.conf").stdout == boot
    assert f"{FORGED_PORT}" not in _sh(host, "cat /etc/nftables.conf").stdout
    # The forgery never reached the framing: no answer had to be dropped (one command still).
    assert "every prefetched fact answer dropped" not in second.output

    # The fact itself, as the prefetch runs it (root): the user's lines come back behind ">",
    # read as the user, and /etc/shadow (a symlink the user made) not at all.
    out = _sh(host, AuthorizedKeys().command(USER).get_raw_value()).stdout.splitlines()
    assert not [line for line in out if re.match(r">?[a-z_][a-z0-9_-]*:[^:]*:\d+:", line)], out  # shadow entries
    assert f">::gpufleet-prefetch::{index}" in out and ">::gpufleet-ssh:: file /root/.ssh/authorized_keys" in out, out
    data = AuthorizedKeys().process(out)
    assert data.exists and data.key_count == 2  # the real key and the copy after the fake marker, in this file
    assert list(data.keys_by_file) == [f"/home/{USER}/.ssh/authorized_keys", f"/home/{USER}/.ssh/authorized_keys2"]
    assert data.keys_by_file[f"/home/{USER}/.ssh/authorized_keys2"] == 0
    print(f"\nforged-facts e2e: {time.monotonic() - started:.0f} s; SshdActivation is single fact {index} of the "
          f"prefetch, {USER}'s AuthorizedKeys {_single_index(host.name, AuthorizedKeys, USER)}")
