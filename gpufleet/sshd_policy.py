"""What `sshd -T` must show on a hardened host, whatever its OpenSSH version: one list for the
deploy (checked right after the reload, deploys/hardening.py) and for the validation gate
(gpufleet/validation.py), so the gate can never check less than the deploy sets.

The algorithm lists depend on the host's OpenSSH version and are added by the deploy.
The fixed values are the dev-sec ssh-baseline's sshd controls (tests/e2e/devsec_sshd.py; where
gpufleet differs on purpose, gpufleet/data/tiers.yaml says why beside the setting)."""
from __future__ import annotations

from typing import Any

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


def expected_sshd(settings: Any) -> dict[str, str]:
    """`sshd -T` key -> value a host hardened for `settings` shows (algorithm lists aside)."""
    expected = {
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
    }
    if settings.hardening_allow_users:
        expected["allowusers"] = " ".join(settings.hardening_allow_users)
    if settings.hardening_allow_groups:
        expected["allowgroups"] = " ".join(settings.hardening_allow_groups)
    return expected
