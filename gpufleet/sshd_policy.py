"""What `sshd -T` must show on a hardened host: the one table for the deploy (checked right
after the reload, deploys/hardening.py) and for the validation gate (gpufleet/validation.py),
so the gate can never check less than the deploy sets.

The algorithm lists depend on the host's OpenSSH version: the deploy passes them in, the gate
leaves them out. Multi-valued keywords (allowusers, hostkey...) are lists, compared by
facts/ssh.py SshdConfig.differences (as sets where sshd treats them as sets).
`lockouts()`: the settings that would shut the deploy user out, refused before any host changes
(gpufleet/settings.py from the inventory, deploys/hardening.py from the live connection).
The fixed values are the dev-sec ssh-baseline's sshd controls (tests/e2e/devsec_sshd.py; where
gpufleet differs on purpose, gpufleet/data/tiers.yaml says why beside the setting)."""
from __future__ import annotations

import fnmatch
import getpass
from collections.abc import Mapping, Sequence
from typing import Any

# The host keys the drop-in names (HostKey lines, in this order): Ed25519 and RSA only.
HOST_KEY_FILES = ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key"]

BASELINE: dict[str, str] = {
    "permitemptypasswords": "no",
    "pubkeyauthentication": "yes",
    "loglevel": "VERBOSE",
    "syslogfacility": "AUTH",
    "strictmodes": "yes",
    "ignorerhosts": "yes",
    "ignoreuserknownhosts": "yes",
    "hostbasedauthentication": "no",
    "kerberosauthentication": "no",
    "kerberosorlocalpasswd": "no",
    "kerberosticketcleanup": "yes",
    "gssapiauthentication": "no",
    "gssapicleanupcredentials": "yes",
    "permittunnel": "no",
    "permituserenvironment": "no",
    "gatewayports": "no",
    "x11uselocalhost": "yes",
    "clientalivecountmax": "3",
    "tcpkeepalive": "no",
    "maxsessions": "10",
    "printlastlog": "no",
    "printmotd": "no",
    "banner": "none",
}


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def expected_sshd(settings: Any, algorithms: Mapping[str, Sequence[str]] | None = None) -> dict[str, str | list[str]]:
    """`sshd -T` key -> value a host hardened for `settings` shows; `algorithms`: the deploy's
    kexalgorithms, ciphers, macs, hostkeyalgorithms for this host's OpenSSH (comma-joined)."""
    expected: dict[str, str | list[str]] = {
        "passwordauthentication": _yes_no(settings.hardening_password_auth),
        "kbdinteractiveauthentication": _yes_no(settings.hardening_password_auth),
        "permitrootlogin": settings.hardening_permit_root_login,
        "maxauthtries": str(settings.hardening_max_auth_tries),
        "logingracetime": str(settings.hardening_login_grace_time),
        "x11forwarding": _yes_no(settings.hardening_x11_forwarding),
        "allowtcpforwarding": _yes_no(settings.hardening_tcp_forwarding),
        "allowagentforwarding": _yes_no(settings.hardening_agent_forwarding),
        "clientaliveinterval": str(settings.hardening_client_alive_interval),
        "maxstartups": settings.hardening_max_startups,
        **BASELINE,
        "hostkey": list(HOST_KEY_FILES),
    }
    for key, names in (algorithms or {}).items():
        expected[key] = ",".join(names)
    if settings.hardening_allow_users:
        expected["allowusers"] = list(settings.hardening_allow_users)
    if settings.hardening_allow_groups:
        expected["allowgroups"] = list(settings.hardening_allow_groups)
    return expected


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
