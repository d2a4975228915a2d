"""What an OpenSSH server of a given release accepts, so that hardening never writes an algorithm
the host's sshd rejects (Ubuntu 22.04 runs OpenSSH 8.9p1, 24.04 9.6p1, Debian 12 9.2p1,
Debian 13 10.0p2).

The first release that has each algorithm gpufleet writes, or that hardening_extra_kex may
name, is checked by tests/unit/test_sshd_support.py against the `ssh -Q` lists of 8.9p1,
9.2p1, 9.6p1, 9.9p1 and 10.0p2 derived from openssh-portable's source at those tags
(tests/fixtures/ubuntu/ssh/SOURCES.md). Every sshd_config keyword the drop-in writes is in
8.9p1's keyword table (the oldest release gpufleet supports), checked by the same test.
An algorithm not listed here is left to `sshd -t`, which judges the candidate on the host
before any reload (operations/ssh.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpufleet.facts.ssh import OpenSshVersion

# `ssh -Q` family -> algorithm -> first OpenSSH release (major, minor) that has it.
SINCE: dict[str, dict[str, tuple[int, int]]] = {
    "kex": {
        "mlkem768x25519-sha256": (9, 9),
        "sntrup761x25519-sha512": (9, 9),               # the @openssh.com name's standard alias
        "sntrup761x25519-sha512@openssh.com": (8, 5),
        "curve25519-sha256": (7, 4),
        "curve25519-sha256@libssh.org": (6, 5),
        "diffie-hellman-group16-sha512": (7, 3),
        "diffie-hellman-group18-sha512": (7, 3),
        "diffie-hellman-group-exchange-sha256": (4, 4),
    },
    "cipher": {
        "chacha20-poly1305@openssh.com": (6, 5),
        "aes256-gcm@openssh.com": (6, 2),
        "aes128-gcm@openssh.com": (6, 2),
        "aes256-ctr": (3, 7),
        "aes192-ctr": (3, 7),
        "aes128-ctr": (3, 7),
    },
    "mac": {
        "hmac-sha2-512-etm@openssh.com": (6, 2),
        "hmac-sha2-256-etm@openssh.com": (6, 2),
        "umac-128-etm@openssh.com": (6, 2),
    },
    "HostKeyAlgorithms": {
        "ssh-ed25519": (6, 5),
        "rsa-sha2-512": (7, 2),
        "rsa-sha2-256": (7, 2),
    },
}

# sshd_config keyword of each family.
KEYWORD = {"kex": "KexAlgorithms", "cipher": "Ciphers", "mac": "MACs", "HostKeyAlgorithms": "HostKeyAlgorithms"}

# The oldest OpenSSH release whose keyword table and algorithm lists are verified.
OLDEST_VERIFIED = (8, 9)


def _show(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def too_new(version: OpenSshVersion, family: str, names: list[str]) -> list[str]:
    """The names of `family` this OpenSSH `version` (facts.ssh.OpenSshVersion) does not have
    yet, each with the release that brought it; [] when all are there or unknown here."""
    since = SINCE[family]
    return [f"{name} (OpenSSH {_show(since[name])} and later)"
            for name in names if name in since and not version.at_least(*since[name])]


def rejected_algorithms(version: OpenSshVersion, lists: dict[str, list[str]]) -> list[str]:
    """One line per sshd_config keyword whose list names an algorithm `version` lacks."""
    problems = []
    for family, names in lists.items():
        missing = too_new(version, family, names)
        if missing:
            problems.append(f"{KEYWORD[family]}: {', '.join(missing)}; this host's sshd is OpenSSH {version}")
    return problems


def available(version: OpenSshVersion, family: str) -> list[str]:
    """Every algorithm of `family` gpufleet knows that `version` has (for refusal messages)."""
    return [name for name, since in SINCE[family].items() if version.at_least(*since)]
