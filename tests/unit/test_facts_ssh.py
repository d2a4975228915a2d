"""Unit: the SSH and nftables fact parsers read real output recorded on Debian 12 and 13 hosts
(tests/fixtures/ssh/, see COMMANDS.txt) correctly, and reject output they do not understand."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.facts.nftables import parse_nftables_state
from gpufleet.facts.ssh import (
    SshFactError,
    count_keys,
    parse_authorized_keys,
    parse_group_members,
    parse_moduli_counts,
    parse_openssh_version,
    parse_socket_ports,
    parse_sshd_t,
)

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ssh"


def lines(name: str) -> list[str]:
    return (FIXTURES / name).read_text().splitlines()


@pytest.mark.parametrize("name, version", [
    ("sshd-V-bookworm.txt", (9, 2)),
    ("ssh-V-bookworm.txt", (9, 2)),
    ("sshd-V-trixie.txt", (10, 0)),
    ("ssh-V-trixie.txt", (10, 0)),
])
def test_openssh_version(name, version):
    parsed = parse_openssh_version(lines(name))
    assert parsed.version == version
    assert parsed.at_least(8, 5)
    assert parsed.at_least(9, 9) == (version >= (9, 9))


def test_openssh_version_portable_suffix_and_absence():
    assert parse_openssh_version(lines("ssh-V-bookworm.txt")).portable == 1
    assert parse_openssh_version(lines("sshd-V-bookworm.txt")).portable is None
    assert str(parse_openssh_version(lines("sshd-V-trixie.txt"))) == "10.0p2"
    assert parse_openssh_version([]) is None
    # sshd older than 9.x does not know -V: usage text, then the version
    usage = ["sshd: illegal option -- V", "OpenSSH_8.4p1 Debian-5+deb11u3, OpenSSL 1.1.1w  11 Sep 2023",
             "usage: sshd [-46DdeiqTt] ..."]
    assert parse_openssh_version(usage).version == (8, 4)


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_sshd_t_debian_defaults(release):
    config = parse_sshd_t(lines(f"sshd-T-{release}-debian-default.txt"))
    assert config.get("passwordauthentication") == "yes"
    assert config.get("permitrootlogin") == "without-password"
    assert config.get_list("hostkey") == [
        "/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_ed25519_key"]
    assert config.ports == [22]
    assert "hmac-sha1" in config.algorithms("macs")
    assert config.get("authorizedkeysfile") == ".ssh/authorized_keys .ssh/authorized_keys2"


@pytest.mark.parametrize("release, first_kex", [
    ("bookworm", "sntrup761x25519-sha512@openssh.com"), ("trixie", "mlkem768x25519-sha256")])
def test_sshd_t_hardened(release, first_kex):
    config = parse_sshd_t(lines(f"sshd-T-{release}-hardened.txt"))
    assert config.get("passwordauthentication") == "no"
    assert config.get("kbdinteractiveauthentication") == "no"
    assert config.algorithms("kexalgorithms")[0] == first_kex
    assert "curve25519-sha256@libssh.org" in config.algorithms("kexalgorithms")
    assert all(mac.endswith("-etm@openssh.com") for mac in config.algorithms("macs"))
    assert config.get_list("hostkey") == ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key"]


# --- list-valued keywords: one `sshd -T` line per value --------------------------------------

TWO_USERS = {  # recorded with `AllowUsers gpufleet lab-admin` / `AllowGroups gpufleet lab-admins` (COMMANDS.txt)
    "bookworm": FIXTURES / "sshd-T-bookworm-two-users.txt",
    "trixie": FIXTURES / "sshd-T-trixie-two-users.txt",
    # composed from the recorded 24.04 sshd -T (tests/fixtures/ubuntu/ssh/SOURCES.md)
    "noble": FIXTURES.parent / "ubuntu" / "ssh" / "sshd-T-24.04-two-users.txt",
}


@pytest.mark.parametrize("release", sorted(TWO_USERS))
def test_two_allowed_users_are_both_kept_and_match_in_any_order(release):
    config = parse_sshd_t(TWO_USERS[release].read_text().splitlines())
    assert config.get_list("allowusers") == ["gpufleet", "lab-admin"]
    assert config.get_list("allowgroups") == ["gpufleet", "lab-admins"]
    assert config.get("allowusers") is None  # never the last line alone
    # what the deploy and the gate want (gpufleet/catalog/sshd_policy.py): lists, as sets for AllowUsers
    assert config.differences({"allowusers": ["lab-admin", "gpufleet"], "allowgroups": ["gpufleet", "lab-admins"],
                               "pubkeyauthentication": "yes"}) == []
    assert config.differences({"allowusers": ["gpufleet"]}) == [("allowusers", ["gpufleet", "lab-admin"], ["gpufleet"])]
    assert config.differences({"allowusers": ["gpufleet", "lab-admin", "student"]}) == [
        ("allowusers", ["gpufleet", "lab-admin"], ["gpufleet", "lab-admin", "student"])]
    # hostkey keeps its order (the order sshd loads and offers the keys in)
    keys = config.get_list("hostkey")
    assert len(keys) == 3 and config.differences({"hostkey": keys}) == []
    assert config.differences({"hostkey": keys[::-1]}) == [("hostkey", keys, keys[::-1])]


def test_an_allowed_user_another_drop_in_adds_is_seen():
    """sshd appends AllowUsers across files (recorded: a second drop-in with `AllowUsers lab-admin
    student`): the effective list is more than gpufleet's, and the check says so."""
    config = parse_sshd_t(lines("sshd-T-trixie-allowusers-two-files.txt"))
    assert config.get_list("allowusers") == ["gpufleet", "lab-admin", "lab-admin", "student"]
    assert config.differences({"allowusers": ["gpufleet", "lab-admin"]}) == [
        ("allowusers", ["gpufleet", "lab-admin", "lab-admin", "student"], ["gpufleet", "lab-admin"])]
    assert config.differences({"allowusers": ["student", "gpufleet", "lab-admin"]}) == []  # repeats do not count


def test_only_keywords_printed_once_per_value_are_lists():
    """permitopen, permitlisten, channeltimeout, authorizedkeysfile: one line holding every value
    (servconf.c dump_config()), kept as one value; nothing is printed once per value that is not
    in MULTI_VALUED (every recording)."""
    from gpufleet.facts.ssh import MULTI_VALUED, SET_VALUED

    assert SET_VALUED < MULTI_VALUED
    for path in sorted(FIXTURES.glob("sshd-T-*.txt")) + list(TWO_USERS.values()):
        keys = [line.split(" ", 1)[0] for line in path.read_text().splitlines() if line.strip()]
        repeated = {k for k in keys if keys.count(k) > 1}
        assert repeated <= MULTI_VALUED, (path.name, repeated - MULTI_VALUED)
    config = parse_sshd_t(lines("sshd-T-trixie-debian-default.txt"))
    assert (config.get("permitopen"), config.get("channeltimeout")) == ("any", "none")
    assert config.effective("allowusers") == [] and config.effective("permitrootlogin") == "prohibit-password"


def test_the_effective_check_names_both_lists():
    from gpufleet.operations.ssh import effective_differences

    config = parse_sshd_t(lines("sshd-T-trixie-two-users.txt"))
    assert effective_differences(config, {"allowusers": ["gpufleet", "lab-admin"]}) == []
    assert effective_differences(config, {"allowusers": ["gpufleet"], "maxauthtries": "2"}) == [
        "allowusers: sshd -T says ['gpufleet', 'lab-admin'], gpufleet wants ['gpufleet']",
        "maxauthtries: sshd -T says '6', gpufleet wants '2'"]


def test_sshd_t_rejects_garbage():
    with pytest.raises(SshFactError):
        parse_sshd_t(["/etc/ssh/sshd_config line 3: Bad configuration option: Foo"])
    with pytest.raises(SshFactError):
        parse_sshd_t([])


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_authorized_keys(release):
    root = parse_authorized_keys(lines(f"authorized-keys-{release}-root.txt"))
    assert (root.user, root.exists, root.home, root.command) == ("root", True, "/root", None)
    assert root.keys_by_file == {"/root/.ssh/authorized_keys": 1, "/root/.ssh/authorized_keys2": 0}
    assert root.key_count == 1
    nobody = parse_authorized_keys(lines(f"authorized-keys-{release}-nobody.txt"))
    assert nobody.exists and nobody.key_count == 0
    missing = parse_authorized_keys(lines(f"authorized-keys-{release}-missing.txt"))
    assert missing.user == "no-such-user" and not missing.exists


def test_count_keys_options_comments_and_junk():
    assert count_keys([
        "# ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKbZ commented out",
        'from="10.0.0.0/8",no-pty ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKbZsx2k59 alice',
        "sk-ssh-ed25519@openssh.com AAAAGnNrLXNzaC1lZDI1NTE5QG9wZW5zc2guY29t yubikey",
        "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== bob",
        "",
        "not a key at all",
        "ssh-ed25519 notbase64",
    ]) == 3


def test_authorized_keys_command_and_bad_output():
    data = parse_authorized_keys([
        "::gpufleet-ssh:: user carol", "::gpufleet-ssh:: home /home/carol",
        "::gpufleet-ssh:: command /usr/bin/sss_ssh_authorizedkeys",
        "::gpufleet-ssh:: file /home/carol/.ssh/authorized_keys",
    ])
    assert data.command == "/usr/bin/sss_ssh_authorizedkeys" and data.key_count == 0
    with pytest.raises(SshFactError):
        parse_authorized_keys(["ssh-ed25519 AAAA before any marker"])


def test_authorized_keys_lines_a_user_wrote_are_content_never_markers():
    """The host prints every line of a key file behind ">": a user's file cannot add a key
    file, end the fact (user-missing) or start a line the prefetch would read as a marker."""
    head = ["::gpufleet-ssh:: user mallory", "::gpufleet-ssh:: home /home/mallory", "::gpufleet-ssh:: command none",
            "::gpufleet-ssh:: file /home/mallory/.ssh/authorized_keys"]
    data = parse_authorized_keys([*head, ">ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKbZ mallory",
                                  ">::gpufleet-ssh:: file /root/.ssh/authorized_keys", ">::gpufleet-ssh:: user-missing",
                                  ">::gpufleet-prefetch::0", ">"])
    assert data.exists and data.keys_by_file == {"/home/mallory/.ssh/authorized_keys": 1}
    with pytest.raises(SshFactError):  # a line not behind ">" is not the script's output
        parse_authorized_keys([*head, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIKbZ mallory"])


def test_group_members():
    assert parse_group_members(["gpu:x:1001:alice,bob", "carol", "alice"]) == ["alice", "bob", "carol"]
    assert parse_group_members([]) == []
    with pytest.raises(SshFactError):
        parse_group_members(["not a group line"])


@pytest.mark.parametrize("release, total, small", [
    ("bookworm", 423, 60), ("trixie", 432, 60)])
def test_moduli_counts(release, total, small):
    before = parse_moduli_counts(lines(f"moduli-{release}-debian-default.txt"))
    after = parse_moduli_counts(lines(f"moduli-{release}-hardened.txt"))
    assert (before.total, before.small) == (total, small)
    assert after.small == 0 and after.total == total - small
    assert parse_moduli_counts(["missing"]) is None
    with pytest.raises(SshFactError):
        parse_moduli_counts(["awk: cannot open file"])


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_nftables_state_in_a_container(release):
    state = parse_nftables_state(lines(f"nftables-state-{release}-container.txt"))
    assert not state.can_load  # nspawn drops CAP_NET_ADMIN
    assert state.can_check_in_namespace and state.nft_installed and state.can_check
    assert not state.table_loaded and state.applied_digest is None


def test_nftables_state_on_a_real_host():
    state = parse_nftables_state(["capeff=000001ffffffffff", "nft=yes", "userns=no", "table=yes",
                                  "applied=ab12"])
    assert state.can_load and state.can_check and state.table_loaded
    assert state.applied_digest == "ab12"


def test_ports_include_every_listenaddress_port():
    # recorded on trixie: harness 00-listen.conf (no port) + ListenAddress host:2222 and [::1]:2223
    config = parse_sshd_t(["port 22", "listenaddress 10.232.6.10:22", "listenaddress 10.232.6.10:2222",
                           "listenaddress [::1]:2223", "passwordauthentication no"])
    assert config.ports == [22, 2222, 2223]


# `systemctl show ssh.socket -p ActiveState -p UnitFileState -p Listen`, recorded on trixie
SOCKET_DISABLED = ["Listen=[::]:22 (Stream)", "ActiveState=inactive", "UnitFileState=disabled"]
SOCKET_ENABLED = ["Listen=[::]:22 (Stream)", "ActiveState=inactive", "UnitFileState=enabled"]


def test_socket_ports_only_when_sshd_is_socket_activated():
    assert parse_socket_ports(SOCKET_DISABLED) == []
    assert parse_socket_ports(SOCKET_ENABLED) == [22]
    assert parse_socket_ports(["Listen=0.0.0.0:2200 (Stream)", "Listen=/run/x.sock (Stream)",
                               "Listen=[::]:5000 (Datagram)", "ActiveState=active",
                               "UnitFileState=disabled"]) == [2200]
    assert parse_socket_ports([]) == []  # no such unit: systemctl printed nothing


def test_nftables_converged_needs_the_live_table_the_file_and_the_boot_service():
    base = ["capeff=000001ffffffffff", "nft=yes", "userns=yes", "table=yes", "live=L1",
            "applied_file=F1", "applied_live=L1", "conf=F1", "enabled=enabled"]
    assert parse_nftables_state(base).converged("F1")
    assert not parse_nftables_state(base).converged("F2")                    # another ruleset wanted
    for changed in ("live=L2", "table=no", "conf=F0", "enabled=disabled", "applied_live=L0"):
        key = changed.split("=")[0]
        state = parse_nftables_state([line for line in base if not line.startswith(key + "=")] + [changed])
        assert not state.converged("F1"), changed
