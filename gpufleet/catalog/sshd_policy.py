"""What gpufleet's sshd drop-in writes and what `sshd -T` must then show on a hardened host: one
table (`dropin()`), rendered as the drop-in (templates/etc/ssh/sshd_config.d/
00-gpufleet-hardening.conf.j2, deploys/hardening.py), checked right after the reload
(deploys/hardening.py) and by the validation gate (gpufleet/checks/validation.py) through
`expected_sshd()`, so neither check can look for less, or other, than the drop-in sets.

The algorithm lists depend on the host's OpenSSH version: the deploy passes them in, the gate
leaves them out. Multi-valued keywords (allowusers, hostkey...) are lists, compared by
facts/ssh.py SshdConfig.differences (as sets where sshd treats them as sets).
`lockouts()`: the settings that would shut the deploy user out, refused before any host changes
(gpufleet/config/settings.py from the inventory, deploys/hardening.py from the live connection).
The fixed values are the dev-sec ssh-baseline's sshd controls (tests/e2e/devsec_sshd.py; where
gpufleet differs on purpose, gpufleet/data/tiers.yaml says why beside the setting)."""
from __future__ import annotations

import fnmatch
import getpass
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

# The host keys the drop-in names (HostKey lines, in this order): Ed25519 and RSA only.
HOST_KEY_FILES = ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key"]

#: A drop-in line: (sshd_config keyword, value), a list for a keyword that takes several values;
#: COMMENT as the keyword: a comment line.
Line = tuple[str, str | list[str]]
COMMENT = "#"
#: Keywords sshd_config takes one value per line (HostKey PATH); other lists go on one line.
ONE_PER_LINE = frozenset({"HostKey"})
#: Written, not checked: sshd -T prints DebianBanner only in Debian's newer packages (Ubuntu's,
#: Debian 13's), not in Debian 12's 9.2p1 (tests/fixtures/ssh/sshd-T-bookworm-*.txt).
NOT_IN_SSHD_T = frozenset({"DebianBanner"})
#: The algorithm keywords (`sshd -T` names) the deploy chooses for the host's OpenSSH.
ALGORITHM_KEYS = ("hostkeyalgorithms", "kexalgorithms", "ciphers", "macs")


class SshdSettings(Protocol):
    """The hardening_ settings the drop-in reads (gpufleet/config/settings.py Settings has them;
    the catalog sits below the settings' floor, so it names what it reads instead)."""

    @property
    def hardening_permit_root_login(self) -> str: ...
    @property
    def hardening_password_auth(self) -> bool: ...
    @property
    def hardening_allow_users(self) -> Sequence[str]: ...
    @property
    def hardening_allow_groups(self) -> Sequence[str]: ...
    @property
    def hardening_max_auth_tries(self) -> int: ...
    @property
    def hardening_login_grace_time(self) -> int: ...
    @property
    def hardening_tcp_forwarding(self) -> bool: ...
    @property
    def hardening_agent_forwarding(self) -> bool: ...
    @property
    def hardening_x11_forwarding(self) -> bool: ...
    @property
    def hardening_client_alive_interval(self) -> int: ...
    @property
    def hardening_max_startups(self) -> str: ...


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def dropin(settings: SshdSettings, algorithms: Mapping[str, Sequence[str]] | None = None) -> list[list[Line]]:
    """The drop-in a host hardened for `settings` gets, section by section (a blank line
    between sections); `algorithms`: the deploy's kexalgorithms, ciphers, macs,
    hostkeyalgorithms for this host's OpenSSH (`sshd -T` names); without them, no algorithm
    lines (what the gate checks)."""
    algs = {key: ",".join(names) for key, names in (algorithms or {}).items()}
    unknown = set(algs) - set(ALGORITHM_KEYS)
    if unknown:
        raise ValueError(f"not an algorithm keyword of the drop-in: {sorted(unknown)}")

    def algorithm(keyword: str) -> list[Line]:
        return [(keyword, algs[keyword.lower()])] if keyword.lower() in algs else []

    return [
        [(COMMENT, "Logging: VERBOSE records the key fingerprint of every login."),
         ("SyslogFacility", "AUTH"),
         ("LogLevel", "VERBOSE")],
        [(COMMENT, "Authentication: keys only."),
         ("PubkeyAuthentication", "yes"),
         ("PasswordAuthentication", _yes_no(settings.hardening_password_auth)),
         ("KbdInteractiveAuthentication", _yes_no(settings.hardening_password_auth)),
         ("PermitEmptyPasswords", "no"),
         ("PermitRootLogin", settings.hardening_permit_root_login),
         ("MaxAuthTries", str(settings.hardening_max_auth_tries)),
         ("LoginGraceTime", str(settings.hardening_login_grace_time)),
         ("StrictModes", "yes"),
         ("IgnoreRhosts", "yes"),
         ("IgnoreUserKnownHosts", "yes"),
         ("HostbasedAuthentication", "no"),
         ("KerberosAuthentication", "no"),
         ("KerberosOrLocalPasswd", "no"),
         ("KerberosTicketCleanup", "yes"),
         ("GSSAPIAuthentication", "no"),
         ("GSSAPICleanupCredentials", "yes"),
         *([("AllowUsers", list(settings.hardening_allow_users))] if settings.hardening_allow_users else []),
         *([("AllowGroups", list(settings.hardening_allow_groups))] if settings.hardening_allow_groups else [])],
        [(COMMENT, "Forwarding and X11."),
         ("X11Forwarding", _yes_no(settings.hardening_x11_forwarding)),
         ("AllowTcpForwarding", _yes_no(settings.hardening_tcp_forwarding)),
         ("AllowAgentForwarding", _yes_no(settings.hardening_agent_forwarding)),
         ("AllowStreamLocalForwarding", "no"),
         ("PermitTunnel", "no"),
         ("PermitUserEnvironment", "no"),
         ("GatewayPorts", "no"),
         ("X11UseLocalhost", "yes")],
        [(COMMENT, "Sessions: dead clients are dropped by encrypted probes (TCP keepalives can be spoofed),"),
         (COMMENT, "unauthenticated connections are bounded."),
         ("ClientAliveInterval", str(settings.hardening_client_alive_interval)),
         ("ClientAliveCountMax", "3"),
         ("TCPKeepAlive", "no"),
         ("MaxSessions", "10"),
         ("MaxStartups", settings.hardening_max_startups)],
        [(COMMENT, "Say less: no OS release in the version banner, no last-login line, no motd or banner."),
         ("DebianBanner", "no"),
         ("PrintLastLog", "no"),
         ("PrintMotd", "no"),
         ("Banner", "none")],
        [(COMMENT, "Host keys: Ed25519 and RSA only (no DSA, no ECDSA); RSA as large as hardening_rsa_host_key_bits."),
         ("HostKey", list(HOST_KEY_FILES)),
         *algorithm("HostKeyAlgorithms")],
        [(COMMENT, "Key exchange: post-quantum hybrids first; then the classic ones listed in"),
         (COMMENT, "hardening_extra_kex for clients without them (paramiko 4, hence pyinfra, has none)."),
         *algorithm("KexAlgorithms"),
         *algorithm("Ciphers"),
         (COMMENT, "Encrypt-then-MAC only."),
         *algorithm("MACs")],
    ]


def dropin_lines(sections: list[list[Line]]) -> list[str]:
    """`dropin()` as sshd_config lines: a blank line between sections."""
    out: list[str] = []
    for section in sections:
        out.extend([""] if out else [])
        for keyword, value in section:
            if keyword == COMMENT:
                out.append(f"# {value}")
            elif isinstance(value, list) and keyword in ONE_PER_LINE:
                out.extend(f"{keyword} {v}" for v in value)
            else:
                out.append(f"{keyword} {' '.join(value) if isinstance(value, list) else value}")
    return out


def expected_sshd(settings: SshdSettings, algorithms: Mapping[str, Sequence[str]] | None = None) -> dict[str, str | list[str]]:
    """`sshd -T` key -> value a host hardened for `settings` shows: every line of `dropin()`
    but comments and NOT_IN_SSHD_T, keyed as sshd -T prints them (lower case)."""
    return {keyword.lower(): list(value) if isinstance(value, list) else value
            for section in dropin(settings, algorithms) for keyword, value in section
            if keyword != COMMENT and keyword not in NOT_IN_SSHD_T}


# Lock-outs refused before any host changes -----------------------------------------------------

def deploy_user(ssh_user: Any) -> str:
    """The user pyinfra logs in as: `ssh_user`, else paramiko's default, the controller's own
    login name (root when the controller runs as root)."""
    return str(ssh_user) if ssh_user else getpass.getuser()


def allows_user(patterns: Sequence[str], user: str) -> bool:
    """Whether sshd's AllowUsers `patterns` let `user` in (match.c match_user(): `*` and `?`
    wildcards; of USER@HOST only USER can be judged here, the address is sshd's to check)."""
    return any(fnmatch.fnmatchcase(user, pattern.partition("@")[0]) for pattern in patterns)


def named_users(patterns: Sequence[str]) -> list[str]:
    """The users AllowUsers `patterns` name outright (USER of USER@HOST), whose keys can be
    checked; a wildcard pattern names no one in particular."""
    users = (p.partition("@")[0] for p in patterns)
    return list(dict.fromkeys(u for u in users if u and not set(u) & set("*?!")))


def lockouts(permit_root_login: str, allow_users: Sequence[str], user: str, said: str) -> list[tuple[str, str, str]]:
    """(key, problem, what is allowed) for each way these settings lock `user` (the deploy
    user, `said` saying where it comes from) out of its next login."""
    found = []
    if user == "root" and permit_root_login == "no":
        found.append(("hardening_permit_root_login",
                      f'"no" turns root login off, and this host is deployed as root ({said}): its next '
                      "login would be refused",
                      'prohibit-password (root by key only) while the deploy user is root; "no" once the host '
                      "is deployed as a sudo user (ssh_user: NAME, _sudo: True)"))
    if allow_users and not allows_user(allow_users, user):
        found.append(("hardening_allow_users",
                      f"[{', '.join(allow_users)}] does not allow the deploy user {user} ({said}): its next "
                      "login would be refused",
                      f"a list that includes {user} (or a pattern matching it), e.g. [{', '.join([user, *allow_users])}]; "
                      "[] for no restriction"))
    return found
