"""Unit: the SshdFiles fact reads modes and host keys from output recorded on real Debian 12 and 13
hosts (sizes and fingerprints equal to `ssh-keygen -l` on the same host), and the pure decisions
of operations/sshd_files.py: which modes to fix, and when a small RSA host key may be replaced."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.facts.ssh import SshFactError
from gpufleet.facts.sshd_files import HostKey, SshdFilesData, describe_public_key, parse_sshd_files
from gpufleet.operations.sshd_files import host_key_plan, mode_fixes

pytestmark = pytest.mark.unit
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ssh"
RSA = "/etc/ssh/ssh_host_rsa_key"
ED = "/etc/ssh/ssh_host_ed25519_key"


def recorded(release: str = "bookworm") -> SshdFilesData:
    return parse_sshd_files((FIXTURES / f"sshd-files-{release}-debian-default.txt").read_text().splitlines())


def test_the_drop_in_lists_the_keys_this_module_makes_sure_of():
    from gpufleet.catalog.sshd_policy import HOST_KEY_FILES

    assert HOST_KEY_FILES == [ED, RSA]


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_keys_match_ssh_keygen_on_the_same_host(release):
    data = recorded(release)
    keygen = {}
    for line in (FIXTURES / f"ssh-keygen-l-{release}-debian-default.txt").read_text().splitlines():
        bits, fingerprint, _comment, kind = line.split()
        keygen[kind] = (int(bits), fingerprint)
    assert (data.keys[ED].bits, data.keys[ED].fingerprint) == keygen["(ED25519)"]
    assert (data.keys[RSA].bits, data.keys[RSA].fingerprint) == keygen["(RSA)"]
    assert data.keys[RSA].type == "ssh-rsa" and data.keys[ED].type == "ssh-ed25519"


@pytest.mark.parametrize("release", ["bookworm", "trixie"])
def test_modes_of_a_debian_default_host(release):
    data = recorded(release)
    assert data.files["/etc/ssh"].mode == 0o755 and data.files["/etc/ssh"].kind == "directory"
    assert data.files["/etc/ssh/sshd_config"].mode == 0o644
    assert data.dropins == ["/etc/ssh/sshd_config.d/00-listen.conf"]
    # what the baseline wants changed on stock Debian: the main file and the drop-ins, nothing else
    assert mode_fixes(data) == {"/etc/ssh/sshd_config": 0o600, "/etc/ssh/sshd_config.d/00-listen.conf": 0o600}


def test_mode_fixes_owner_and_folders():
    data = parse_sshd_files([
        "::gpufleet-stat::775 root root directory|/etc/ssh",
        "::gpufleet-stat::600 root adm regular file|/etc/ssh/sshd_config",
        "::gpufleet-stat::755 root root directory|/etc/ssh/sshd_config.d",
        "::gpufleet-stat::600 root root regular file|/etc/ssh/sshd_config.d/00-gpufleet-hardening.conf",
        "::gpufleet-stat::640 root root regular file|/etc/ssh/ssh_host_rsa_key",
    ])
    assert mode_fixes(data) == {"/etc/ssh": 0o755, "/etc/ssh/sshd_config": 0o600, RSA: 0o600}


def _keys(rsa_bits: int | None = 3072, ed25519: bool = True, rsa: bool = True) -> SshdFilesData:
    keys = {}
    if ed25519:
        keys[ED] = HostKey(ED, "ssh-ed25519", 256, "SHA256:ed")
    if rsa:
        keys[RSA] = HostKey(RSA, "ssh-rsa" if rsa_bits else None, rsa_bits, "SHA256:old" if rsa_bits else None)
    return SshdFilesData(keys=keys)


def test_small_rsa_key_replaced_only_when_this_run_trusts_another_key():
    todo, left = host_key_plan(_keys(3072), 4096, "ssh-ed25519")
    assert todo == [(RSA, "rsa", 4096, "3072 bits, SHA256:old")] and left == []
    # verified by RSA, by ECDSA (no longer offered once hardened: RSA may be next), or not over SSH
    for verified_by in ("ssh-rsa", "rsa-sha2-512", "ecdsa-sha2-nistp256", None):
        todo, left = host_key_plan(_keys(3072), 4096, verified_by)
        assert todo == [] and len(left) == 1 and "NOT replaced" in left[0], verified_by
    todo, left = host_key_plan(_keys(3072, ed25519=False), 4096, "ssh-ed25519")
    assert todo == [(ED, "ed25519", 256, "missing")]  # the RSA key waits for the next run
    assert "no Ed25519 key" in left[0]


def test_big_enough_or_missing_keys():
    assert host_key_plan(_keys(4096), 4096, "ssh-rsa") == ([], [])
    assert host_key_plan(_keys(3072), 3072, None) == ([], [])
    todo, left = host_key_plan(_keys(rsa=False), 4096, "ssh-rsa")  # a missing key: nobody pinned it
    assert todo == [(RSA, "rsa", 4096, "missing")] and left == []
    todo, left = host_key_plan(_keys(None), 4096, "ssh-ed25519")
    assert todo == [] and "unknown" in left[0]


@pytest.mark.parametrize("line", [
    "::gpufleet-stat::644 root root|/etc/ssh",          # too few fields
    "::gpufleet-stat::rw- root root regular file|/x",    # mode not octal
    "::gpufleet-pub::/etc/ssh/k ssh-rsa AAAA!!notbase64",
    "::gpufleet-pub::/etc/ssh/k ssh-ed25519 AAAAB3NzaC1yc2EAAAADAQAB",  # type and blob disagree
    "something else",
])
def test_output_it_does_not_understand_is_refused(line):
    with pytest.raises(SshFactError):
        parse_sshd_files([line])


def test_describe_public_key_rejects_truncated_blob():
    with pytest.raises(SshFactError):
        describe_public_key("ssh-rsa AAAAB3NzaC1yc2EAAAAD")
