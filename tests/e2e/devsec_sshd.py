"""The dev-sec ssh-baseline's sshd controls as a table, and their evaluation on a real host.

Source: github.com/dev-sec/ssh-baseline at 975dff3c (2.8.1), controls/sshd_spec.rb and
libraries/ssh_crypto.rb, copied to tests/fixtures/dev-sec-ssh-baseline/ (tests/unit/
test_devsec_table.py checks this table against them). The baseline is InSpec: it reads
/etc/ssh/sshd_config as text. Here every control is judged on the host's real state instead:
`sshd -T` (the configuration sshd really uses, drop-ins included), file modes from `stat`, the
RSA key size from the baseline's own `ssh-keygen -l` command, the moduli from its own awk, the
running sshd's command line, and the version string the server sends.

`baseline` is what the profile expects for OpenSSH >= 8.5 on Debian (both test releases).
`gpufleet` is set only where gpufleet differs; the reason stands in gpufleet/data/tiers.yaml
next to the setting, marked "dev-sec <id>".
"""
from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Any

SAME = object()

# ssh_crypto.rb, OpenSSH >= 6.6 / 8.5
BASELINE_CIPHERS = ("chacha20-poly1305@openssh.com,aes256-gcm@openssh.com,aes128-gcm@openssh.com,"
                    "aes256-ctr,aes192-ctr,aes128-ctr")
BASELINE_KEX = "sntrup761x25519-sha512@openssh.com,curve25519-sha256@libssh.org,diffie-hellman-group-exchange-sha256"
BASELINE_MACS = ("hmac-sha2-512-etm@openssh.com,hmac-sha2-256-etm@openssh.com,umac-128-etm@openssh.com,"
                 "hmac-sha2-512,hmac-sha2-256")
BASELINE_HOST_KEYS = ["/etc/ssh/ssh_host_rsa_key", "/etc/ssh/ssh_host_ecdsa_key", "/etc/ssh/ssh_host_ed25519_key"]

# gpufleet's own values where it differs (by Debian release where OpenSSH decides)
GPUFLEET_KEX = {
    "bookworm": "sntrup761x25519-sha512@openssh.com,curve25519-sha256@libssh.org",
    "trixie": "mlkem768x25519-sha256,sntrup761x25519-sha512,sntrup761x25519-sha512@openssh.com,"
              "curve25519-sha256@libssh.org",
}
GPUFLEET_MACS = "hmac-sha2-512-etm@openssh.com,hmac-sha2-256-etm@openssh.com,umac-128-etm@openssh.com"
GPUFLEET_HOST_KEYS = ["/etc/ssh/ssh_host_ed25519_key", "/etc/ssh/ssh_host_rsa_key"]


@dataclass(frozen=True)
class Control:
    id: str
    kind: str  # eq | match | present | absent | dir | file | banner | moduli | procs | rsa_bits
    key: str = ""  # the sshd_config keyword the spec names
    baseline: Any = None
    gpufleet: Any = SAME
    sshd_t: str = ""  # the keyword sshd -T prints, when not key.lower()

    @property
    def deviates(self) -> bool:
        return self.gpufleet is not SAME


CONTROLS = [
    Control("sshd-01", "eq", "Ciphers", BASELINE_CIPHERS),
    Control("sshd-02", "eq", "KexAlgorithms", BASELINE_KEX, gpufleet=GPUFLEET_KEX),
    Control("sshd-03", "eq", "MACs", BASELINE_MACS, gpufleet=GPUFLEET_MACS),
    Control("sshd-04", "dir", "/etc/ssh"),
    Control("sshd-05", "file", "/etc/ssh/sshd_config"),
    Control("sshd-06", "match", "PermitRootLogin", r"no|without-password|prohibit-password"),
    Control("sshd-07", "eq", "Port", "22"),
    Control("sshd-08", "match", "AddressFamily", r"inet|inet6|any"),
    Control("sshd-09", "present", "ListenAddress"),
    Control("sshd-10", "absent", "Protocol", "2"),  # only_if OpenSSH < 7.6: sshd has no Protocol any more
    Control("sshd-11", "eq", "StrictModes", "yes"),
    Control("sshd-12", "eq", "SyslogFacility", "AUTH"),
    Control("sshd-13", "eq", "LogLevel", "VERBOSE"),
    Control("sshd-14", "eq", "HostKey", BASELINE_HOST_KEYS, gpufleet=GPUFLEET_HOST_KEYS),
    Control("sshd-15", "absent", "UseLogin"),  # nil on OpenSSH >= 7.4
    Control("sshd-16", "absent", "UsePrivilegeSeparation"),  # nil on OpenSSH >= 7.5
    Control("sshd-17", "eq", "PermitUserEnvironment", "no"),
    Control("sshd-18", "eq", "LoginGraceTime", "30s"),
    Control("sshd-19", "eq", "MaxAuthTries", "2"),
    Control("sshd-20", "eq", "MaxSessions", "10"),
    Control("sshd-21", "eq", "MaxStartups", "10:30:60"),
    Control("sshd-22", "eq", "PubkeyAuthentication", "yes"),
    Control("sshd-23", "eq", "IgnoreRhosts", "yes"),
    Control("sshd-24", "eq", "IgnoreUserKnownHosts", "yes"),
    Control("sshd-25", "eq", "HostbasedAuthentication", "no"),
    Control("sshd-27", "eq", "PasswordAuthentication", "no"),
    Control("sshd-28", "eq", "PermitEmptyPasswords", "no"),
    # OpenSSH 8.7 renamed it; sshd -T prints the new name
    Control("sshd-29", "eq", "ChallengeResponseAuthentication", "no", sshd_t="kbdinteractiveauthentication"),
    Control("sshd-30", "eq", "KerberosAuthentication", "no"),
    Control("sshd-31", "eq", "KerberosOrLocalPasswd", "no"),
    Control("sshd-32", "eq", "KerberosTicketCleanup", "yes"),
    Control("sshd-33", "eq", "GSSAPIAuthentication", "no"),
    Control("sshd-34", "eq", "GSSAPICleanupCredentials", "yes"),
    Control("sshd-35", "eq", "TCPKeepAlive", "no"),
    Control("sshd-36", "eq", "ClientAliveInterval", "300"),
    Control("sshd-37", "eq", "ClientAliveCountMax", "3"),
    Control("sshd-38", "eq", "PermitTunnel", "no"),
    Control("sshd-39", "eq", "AllowTcpForwarding", "no"),
    Control("sshd-40", "eq", "AllowAgentForwarding", "no"),
    Control("sshd-41", "eq", "GatewayPorts", "no"),
    Control("sshd-42", "eq", "X11Forwarding", "no"),
    Control("sshd-43", "eq", "X11UseLocalhost", "yes"),
    Control("sshd-44", "eq", "PrintMotd", "no"),
    Control("sshd-45", "eq", "PrintLastLog", "no"),
    Control("sshd-46", "eq", "Banner", "none"),
    # sshd -T does not print it: judged on what it changes, the version string sshd sends
    Control("sshd-47", "banner", "DebianBanner", "no"),
    Control("sshd-48", "moduli", "/etc/ssh/moduli", 2047),
    Control("sshd-49", "procs", "sshd -D", ["-oCiphers", "-oKexAlgorithms", "-oHostKeyAlgorithms"]),
    Control("sshd-50", "rsa_bits", "/etc/ssh/ssh_host_rsa_key", 4096),
]

# One login: everything the controls look at. The moduli and RSA lines are the spec's own commands.
STATE_SCRIPT = r"""
echo '::sshd-T::'; sshd -T
echo '::stat::'; stat -c '%F|%U|%G|%a|%n' /etc/ssh /etc/ssh/sshd_config
echo '::rsa::'; ssh-keygen -l -f /etc/ssh/ssh_host_rsa_key
echo '::moduli::'; test $(awk '$5 < 2047 && $5 ~ /^[0-9]+$/ { print $5 }' /etc/ssh/moduli | uniq | wc -c) -eq 0; echo "rc=$?"
echo '::procs::'; ps -eo args | awk '/sshd -D/ && !/awk/'
true
"""


def parse_state(text: str, banner: str) -> dict:
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.fullmatch(r"::([a-zA-Z-]+)::", line)
        if match:
            current = sections.setdefault(match[1], [])
        elif current is not None and line.strip():
            current.append(line)
    sshd_t: dict[str, list[str]] = {}
    for line in sections.get("sshd-T", []):
        key, _, value = line.partition(" ")
        sshd_t.setdefault(key, []).append(value)
    files = {}
    for line in sections.get("stat", []):
        kind, user, group, mode, path = line.split("|", 4)
        files[path] = {"kind": kind, "user": user, "group": group, "mode": int(mode, 8)}
    rsa = sections.get("rsa", [])
    return {
        "sshd_t": sshd_t, "files": files, "banner": banner,
        "rsa_bits": int(rsa[0].split()[0]) if rsa else None,
        "moduli_ok": sections.get("moduli") == ["rc=0"],
        "procs": sections.get("procs", []),
    }


def server_banner(address: str, port: int = 22) -> str:
    """The identification string sshd sends first (`SSH-2.0-OpenSSH_9.2p1 Debian-2+deb12u7`)."""
    with socket.create_connection((address, port), timeout=10) as sock:
        data = b""
        while b"\n" not in data and len(data) < 1024:
            chunk = sock.recv(256)
            if not chunk:
                break
            data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def _seconds(value: str) -> int:
    units = {"": 1, "s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u.lower()] for n, u in re.findall(r"(\d+)([smhSMH]?)", value))


def wanted(control: Control, release: str) -> Any:
    value = control.gpufleet if control.deviates else control.baseline
    return value[release] if isinstance(value, dict) else value


def evaluate(control: Control, state: dict, release: str) -> tuple[bool, str]:
    """(passed, what the host has) for one control: the baseline's test, or gpufleet's recorded value."""
    want = wanted(control, release)
    sshd_t = state["sshd_t"]
    key = control.sshd_t or control.key.lower()
    got = sshd_t.get(key)
    if control.kind == "eq":
        if control.key == "HostKey":
            return got == want, str(got)
        value = got[0] if got and len(got) == 1 else None
        if control.key == "LoginGraceTime":
            return value is not None and _seconds(value) == _seconds(want), str(value)
        return value == want, str(got)
    if control.kind == "match":
        return bool(got) and len(got) == 1 and re.search(want, got[0]) is not None, str(got)
    if control.kind == "present":
        return bool(got) and all(v.strip() for v in got), str(got)
    if control.kind == "absent":
        return got is None, str(got)
    if control.kind in ("dir", "file"):
        info = state["files"].get(control.key)
        if info is None:
            return False, "missing"
        mode = info["mode"]
        owned = info["user"] == "root" and info["group"] == "root"
        if control.kind == "dir":
            # exists, directory, root:root, executable, readable by all, writable by the owner only
            ok = (info["kind"] == "directory" and owned and mode & 0o111 and mode & 0o444 == 0o444
                  and mode & 0o200 and not mode & 0o022)
        else:
            # exists, file, root:root, not executable, read/write by the owner only
            ok = (info["kind"] == "regular file" and owned and not mode & 0o111 and mode & 0o600 == 0o600
                  and not mode & 0o066)
        return bool(ok), f"{info['kind']} {info['user']}:{info['group']} {oct(mode)}"
    if control.kind == "banner":
        return "debian" not in state["banner"].lower(), state["banner"]
    if control.kind == "moduli":
        return state["moduli_ok"], "no modulus below 2047 bits" if state["moduli_ok"] else "small moduli"
    if control.kind == "procs":
        procs = state["procs"]
        return len(procs) == 1 and not any(opt in procs[0] for opt in want), str(procs)
    if control.kind == "rsa_bits":
        bits = state["rsa_bits"]
        return bits is not None and bits >= want, f"{bits} bits"
    raise ValueError(f"unknown kind {control.kind}")
