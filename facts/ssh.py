"""
SSH server facts: the OpenSSH version, the *effective* sshd configuration (``sshd -T``),
the authorized keys a user really has, members of a group, and how many small
Diffie-Hellman moduli /etc/ssh/moduli still carries.

Every ``process()`` is pure (text in, data out) and unit-tested on output recorded from
real Debian 12 / 13 hosts (tests/fixtures/ssh/).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pyinfra.api import FactBase, QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError

MARK = "::gpufleet-ssh::"


class SshFactError(FactProcessError, ValueError):
    """Output the parser does not understand (pyinfra fails only the host that printed it)."""


class _Json:
    def to_json(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]


# ------------------------------------------------------------------------------------------
# OpenSSH version
# ------------------------------------------------------------------------------------------

_VERSION = re.compile(r"OpenSSH_(\d+)\.(\d+)(?:p(\d+))?")


@dataclass(frozen=True)
class OpenSshVersion(_Json):
    major: int
    minor: int
    portable: int | None = None  # the "p2" of 10.0p2; `sshd -V` on 9.2 prints none
    raw: str = ""

    @property
    def version(self) -> tuple[int, int]:
        return (self.major, self.minor)

    def at_least(self, major: int, minor: int) -> bool:
        return self.version >= (major, minor)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}" + (f"p{self.portable}" if self.portable else "")


def parse_openssh_version(lines: Iterable[str]) -> OpenSshVersion | None:
    """First ``OpenSSH_X.Y[pZ]`` in `sshd -V` / `ssh -V` output (older sshd print it after
    their usage text); None when there is none (OpenSSH not installed)."""
    for line in lines:
        match = _VERSION.search(line)
        if match:
            return OpenSshVersion(
                major=int(match[1]),
                minor=int(match[2]),
                portable=int(match[3]) if match[3] else None,
                raw=line.strip(),
            )
    return None


class SshdVersion(FactBase):
    """
    The OpenSSH version of the *server* (``sshd -V``; ``ssh -V`` of the same package when
    this sshd is too old to know ``-V``), or None when OpenSSH is not installed:

    .. code:: python

        OpenSshVersion(major=10, minor=0, portable=2, raw="OpenSSH_10.0p2 Debian-7+deb13u4, ...")
    """

    def command(self) -> str:
        return (
            "if command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ]; then "
            "PATH=$PATH:/usr/sbin; sshd -V 2>&1 | grep OpenSSH_ || ssh -V 2>&1; fi; true"
        )

    def process(self, output: list[str]) -> OpenSshVersion | None:
        return parse_openssh_version(output)


# ------------------------------------------------------------------------------------------
# Effective configuration: sshd -T
# ------------------------------------------------------------------------------------------

# Keywords `sshd -T` prints once per value, one line each: what dump_config() in OpenSSH's
# servconf.c passes to dump_cfg_strarray() or prints in a loop (port, listenaddress, subsystem),
# the same in 8.9p1 (Ubuntu 22.04), 9.2p1 (Debian 12), 9.6p1 (Ubuntu 24.04), 10.0p2 (Debian 13)
# and master. Every other keyword is one line, list-valued ones too (authorizedkeysfile,
# authenticationmethods, channeltimeout, logverbose, permitopen, permitlisten: space-separated).
MULTI_VALUED = frozenset({
    "port", "listenaddress", "hostkey", "hostcertificate", "allowusers", "denyusers",
    "allowgroups", "denygroups", "acceptenv", "setenv", "subsystem",
})

# Of those, the ones sshd treats as sets, compared without order or repeats: one matching entry
# is enough (auth.c allowed_user() for Allow/DenyUsers and Allow/DenyGroups, AcceptEnv's
# patterns), or each entry is one more listener (port, listenaddress). sshd appends these across
# every file and drop-in (servconf.c: "appends to list; doesn't respect first-match-wins"), so
# a value another file adds shows here. hostkey (the order keys are loaded and offered in),
# hostcertificate, setenv (the first of a name wins) and subsystem keep their order.
SET_VALUED = frozenset({"port", "listenaddress", "allowusers", "denyusers", "allowgroups", "denygroups", "acceptenv"})

# sshd -T of 9.2 prints PermitRootLogin's old name
_ALIASES = {("permitrootlogin", "without-password"): "prohibit-password"}


@dataclass(frozen=True)
class SshdConfig(_Json):
    """sshd's effective configuration: keyword (lower case) -> value, and the repeated
    keywords (hostkey, port, listenaddress...) -> list of values."""

    values: dict[str, str] = field(default_factory=dict)
    lists: dict[str, list[str]] = field(default_factory=dict)

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key.lower(), default)

    def get_list(self, key: str) -> list[str]:
        return list(self.lists.get(key.lower(), []))

    def algorithms(self, key: str) -> list[str]:
        value = self.values.get(key.lower())
        return value.split(",") if value else []

    def effective(self, key: str) -> str | list[str] | None:
        """What sshd uses for `key`: the list of a multi-valued keyword ([] when none is set),
        else the value (None when sshd printed no such line)."""
        key = key.lower()
        if key in MULTI_VALUED:
            return self.get_list(key)
        value = self.values.get(key)
        return _ALIASES.get((key, value), value) if value is not None else None

    def differences(self, expected: Mapping[str, str | Sequence[str]]) -> list[tuple[str, Any, Any]]:
        """(key, what sshd -T says, what is wanted) for every expected value sshd does not use.
        A list is wanted for a multi-valued keyword: as a set for SET_VALUED ones (AllowUsers
        "a b" on one line is two `allowusers` lines, in any order), else in its order."""
        diffs: list[tuple[str, Any, Any]] = []
        for key, want in expected.items():
            got = self.effective(key)
            if key in MULTI_VALUED:
                wanted = [want] if isinstance(want, str) else list(want)
                same = (set(got or []) == set(wanted)) if key in SET_VALUED else got == wanted
                if not same:
                    diffs.append((key, got, wanted))
            else:  # printed once: a list is its one space-separated line (authorizedkeysfile...)
                line = want if isinstance(want, str) else " ".join(want)
                if got != _ALIASES.get((key, line), line):
                    diffs.append((key, got, want))
        return diffs

    @property
    def ports(self) -> list[int]:
        """Every port sshd listens on: its `port` lines and the port of each `listenaddress`
        (`ListenAddress host:port` overrides Port for that address; sshd -T prints them all)."""
        ports = {int(p) for p in self.get_list("port") if p.isdigit()}
        for address in self.get_list("listenaddress"):
            port = address.split()[0].rpartition(":")[2]  # 10.0.0.1:22, [::]:2222, "addr:22 rdomain x"
            if port.isdigit():
                ports.add(int(port))
        return sorted(ports)


def parse_sshd_t(lines: Iterable[str]) -> SshdConfig:
    values: dict[str, str] = {}
    lists: dict[str, list[str]] = {}
    for line in lines:
        line = line.strip()
        if not line:
            continue
        key, _, value = line.partition(" ")
        if not re.fullmatch(r"[a-z0-9]+", key):
            raise SshFactError(f"unexpected line in sshd -T output: {line!r}")
        if key in MULTI_VALUED:
            lists.setdefault(key, []).append(value)
        else:
            values[key] = value
    if not values:
        raise SshFactError("sshd -T printed nothing: is the configuration valid?")
    return SshdConfig(values=values, lists=lists)


class SshdEffectiveConfig(FactBase):
    """
    The configuration sshd really uses, as ``sshd -T`` prints it: every file and drop-in
    read, first value wins. Never judge hardening from file content alone.

    .. code:: python

        SshdConfig(values={"passwordauthentication": "no", ...}, lists={"port": ["22"], ...})
    """

    def requires_command(self, *args: Any, **kwargs: Any) -> str:
        return "sshd"

    def command(self) -> str:
        return "sshd -T"

    def process(self, output: list[str]) -> SshdConfig:
        return parse_sshd_t(output)


# ------------------------------------------------------------------------------------------
# Socket activation: ssh.socket's ListenStream
# ------------------------------------------------------------------------------------------

def parse_socket_ports(lines: Iterable[str]) -> list[int]:
    """TCP ports of ssh.socket from `systemctl show -p ActiveState,UnitFileState,Listen`, when
    the socket is in use (active or enabled); [] otherwise or when there is no such unit."""
    values: dict[str, list[str]] = {}
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if sep:
            values.setdefault(key, []).append(value)
    active = values.get("ActiveState", [""])[0] in ("active", "activating", "reloading")
    enabled = values.get("UnitFileState", [""])[0].startswith("enabled")
    if not (active or enabled):
        return []
    ports = set()
    for listen in values.get("Listen", []):
        address, _, kind = listen.partition(" ")
        port = address.rpartition(":")[2]
        if kind.strip() == "(Stream)" and port.isdigit():
            ports.add(int(port))
    return sorted(ports)


class SshSocketPorts(FactBase):
    """
    The TCP ports ssh.socket listens on where sshd is socket-activated (sshd's own Port lines
    do not apply then), else []:

    .. code:: python

        [22, 2222]
    """

    def command(self) -> str:
        return "systemctl show ssh.socket -p ActiveState -p UnitFileState -p Listen 2>/dev/null; true"

    def process(self, output: list[str]) -> list[int]:
        return parse_socket_ports(output)


@dataclass(frozen=True)
class SshdActivationData(_Json):
    """How systemd runs sshd: `systemctl show ssh.socket ssh.service` (Id, LoadState,
    ActiveState, UnitFileState, Accept, Listen)."""

    socket_load: str = ""        # "loaded", "not-found" (no ssh.socket unit), "" (no systemd)
    socket_active: str = ""      # ActiveState of ssh.socket: "active" while it listens
    socket_file_state: str = ""  # UnitFileState: "enabled" when it starts at boot
    accept: bool | None = None   # Accept=yes: one `sshd -i` per connection (ssh@.service)
    listen: list[str] = field(default_factory=list)  # "0.0.0.0:22 (Stream)", ...
    service_active: str = ""     # ActiveState of ssh.service
    service_file_state: str = ""

    @property
    def socket_in_use(self) -> bool:
        return (self.socket_load == "loaded"
                and (self.socket_active in ("active", "activating", "reloading")
                     or self.socket_file_state.startswith("enabled")))

    @property
    def socket_activated(self) -> bool:
        """sshd is started by ssh.socket (Ubuntu 22.10+ by default; Debian 13 on request):
        the socket, not sshd_config's Port/ListenAddress, decides where sshd listens."""
        return self.socket_in_use

    @property
    def ports(self) -> list[int]:
        """TCP ports ssh.socket listens on when it is in use, else []."""
        if not self.socket_in_use:
            return []
        ports = set()
        for listen in self.listen:
            address, _, kind = listen.partition(" ")
            port = address.rpartition(":")[2]
            if kind.strip() == "(Stream)" and port.isdigit():
                ports.add(int(port))
        return sorted(ports)

    def describe(self) -> str:
        if not self.socket_activated:
            return "sshd runs as ssh.service (no socket activation)"
        style = "one sshd per connection (Accept=yes)" if self.accept else "ssh.service started by the socket"
        ports = ", ".join(str(p) for p in self.ports) or "no TCP port"
        return f"sshd is socket-activated: ssh.socket listens on {ports}, {style}; ssh.service is {self.service_active or 'unknown'}"


def parse_sshd_activation(lines: Iterable[str]) -> SshdActivationData:
    """`systemctl show ssh.socket ssh.service -p Id -p LoadState -p ActiveState
    -p UnitFileState -p Accept -p Listen`: one block per unit, blocks separated by an empty
    line, properties in systemd's order (Accept and Listen come before Id)."""
    units: dict[str, dict[str, list[str]]] = {}
    block: dict[str, list[str]] = {}

    def close() -> None:
        if block:
            if "Id" not in block:
                raise SshFactError(f"systemctl show block without Id=: {sorted(block)}")
            units[block["Id"][0]] = dict(block)
            block.clear()

    for line in lines:
        if not line.strip():
            close()
            continue
        key, sep, value = line.strip().partition("=")
        if not sep:
            raise SshFactError(f"unexpected line in systemctl show output: {line!r}")
        block.setdefault(key, []).append(value)
    close()
    socket = units.get("ssh.socket", {})
    service = units.get("ssh.service", {})

    def first(unit: dict[str, list[str]], key: str) -> str:
        return (unit.get(key) or [""])[0]

    accept = first(socket, "Accept")
    return SshdActivationData(
        socket_load=first(socket, "LoadState"),
        socket_active=first(socket, "ActiveState"),
        socket_file_state=first(socket, "UnitFileState"),
        accept=None if not accept else accept == "yes",
        listen=list(socket.get("Listen", [])),
        service_active=first(service, "ActiveState"),
        service_file_state=first(service, "UnitFileState"),
    )


class SshdActivation(FactBase):
    """
    Whether sshd is socket-activated (ssh.socket), where the socket listens, and the state of
    ssh.service; an empty answer (no systemd) means a plain daemon:

    .. code:: python

        SshdActivationData(socket_load="loaded", socket_active="active",
                           socket_file_state="enabled", accept=False,
                           listen=["0.0.0.0:22 (Stream)", "[::]:22 (Stream)"],
                           service_active="active", service_file_state="disabled")
    """

    def command(self) -> str:
        return ("systemctl show ssh.socket ssh.service -p Id -p LoadState -p ActiveState "
                "-p UnitFileState -p Accept -p Listen 2>/dev/null; true")

    def process(self, output: list[str]) -> SshdActivationData:
        return parse_sshd_activation(output)


# ------------------------------------------------------------------------------------------
# An sshd drop-in waiting for its fresh-login confirmation
# ------------------------------------------------------------------------------------------

class SshdPending(FactBase):
    """The drop-in an interrupted run left unconfirmed (the marker's content), else None."""

    def command(self, path: str) -> StringCommand:
        return StringCommand("cat", QuoteString(path), "2>/dev/null;", "true")

    def process(self, output: list[str]) -> str | None:
        text = "\n".join(line.strip() for line in output if line.strip())
        return text or None


# ------------------------------------------------------------------------------------------
# Authorized keys of a user
# ------------------------------------------------------------------------------------------

# Public key types sshd accepts in authorized_keys (plain, security-key and certificates).
_KEY_TYPE = (
    r"(?:ssh-ed25519|ssh-rsa|ssh-dss|ecdsa-sha2-nistp(?:256|384|521)"
    r"|sk-ssh-ed25519@openssh\.com|sk-ecdsa-sha2-nistp256@openssh\.com"
    r"|[a-z0-9-]+-cert-v01@openssh\.com)"
)
_KEY_LINE = re.compile(rf"(?:^|\s){_KEY_TYPE}\s+AAAA[0-9A-Za-z+/]+=*(?:\s|$)")

# Resolves the user's AuthorizedKeysFile (sshd -T -C applies Match blocks for that user),
# expands %h %u %%, and prints every file under a marker. $1 = user name.
# Each file is read as that user, as sshd reads it (a key file symlinked to /etc/shadow shows
# nothing), regular files only, at most 1 MiB and 10 s (a FIFO swapped in blocks nothing), and
# every line of it comes out behind ">": nothing the user wrote can start a line of this
# output (a marker here or one of the prefetch's, gpufleet/controller/factcache.py).
_AUTHORIZED_KEYS_SCRIPT = r"""
M='::gpufleet-ssh::'
u=$1
echo "$M user $u"
ent=$(getent passwd "$u") || { echo "$M user-missing"; exit 0; }
IFS=: read -r _ _ uid gid _ home _ <<EOF
$ent
EOF
echo "$M home $home"
me=$(id -u)
conf=$(sshd -T -C "user=$u,host=localhost,addr=127.0.0.1" 2>/dev/null)
files=$(printf '%s\n' "$conf" | sed -n 's/^authorizedkeysfile //p')
command=$(printf '%s\n' "$conf" | sed -n 's/^authorizedkeyscommand //p')
echo "$M command ${command:-none}"
[ -n "$files" ] || files='.ssh/authorized_keys .ssh/authorized_keys2'
for f in $files; do
  [ "$f" = none ] && continue
  p=$(printf '%s' "$f" | sed -e "s#%h#$home#g" -e "s#%u#$u#g" -e 's#%%#%#g')
  case "$p" in /*) ;; *) p="$home/$p" ;; esac
  echo "$M file $p"
  [ -f "$p" ] || continue
  if [ "$me" = 0 ] && [ "$uid" != 0 ]; then
    timeout 10 setpriv --reuid="$uid" --regid="$gid" --init-groups head -c 1048576 -- "$p" 2>/dev/null
  elif [ "$me" = "$uid" ] || [ "$me" = 0 ]; then
    timeout 10 head -c 1048576 -- "$p" 2>/dev/null
  fi | awk '{ print ">" $0 }'
done
true
"""


@dataclass(frozen=True)
class AuthorizedKeysData(_Json):
    user: str
    exists: bool = True
    home: str | None = None
    keys_by_file: dict[str, int] = field(default_factory=dict)
    command: str | None = None  # AuthorizedKeysCommand, when sshd uses one

    @property
    def key_count(self) -> int:
        return sum(self.keys_by_file.values())


def count_keys(lines: Iterable[str]) -> int:
    """Key lines of an authorized_keys file (options before the key type are allowed)."""
    return sum(
        1 for line in lines
        if line.strip() and not line.lstrip().startswith("#") and _KEY_LINE.search(line)
    )


def parse_authorized_keys(lines: Sequence[str]) -> AuthorizedKeysData:
    user = ""
    home = None
    command = None
    files: dict[str, list[str]] = {}
    current: str | None = None
    for line in lines:
        if line.startswith(MARK):
            word, _, rest = line[len(MARK):].strip().partition(" ")
            if word == "user":
                user = rest
                continue
            if word == "user-missing":
                return AuthorizedKeysData(user=user, exists=False)
            if word == "home":
                home = rest
            elif word == "command":
                command = None if rest in ("", "none") else rest
            elif word == "file":
                current = rest
                files.setdefault(current, [])
            else:
                raise SshFactError(f"unexpected marker: {line!r}")
            continue
        if not line.startswith(">"):
            raise SshFactError(f"unexpected line in authorized keys output: {line!r}")
        if current is None:
            raise SshFactError(f"authorized keys output before any file marker: {line!r}")
        files[current].append(line[1:])
    return AuthorizedKeysData(
        user=user, home=home, command=command,
        keys_by_file={path: count_keys(content) for path, content in files.items()},
    )


class AuthorizedKeys(FactBase):
    """
    The authorized keys `user` really has: the files sshd reads for that user
    (AuthorizedKeysFile as ``sshd -T -C user=...`` resolves it) and how many keys each holds.

    .. code:: python

        AuthorizedKeysData(user="root", home="/root",
                           keys_by_file={"/root/.ssh/authorized_keys": 1, ...}, command=None)
    """

    def command(self, user: str) -> StringCommand:
        return StringCommand(
            "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_AUTHORIZED_KEYS_SCRIPT),
            "gpufleet-authorized-keys", QuoteString(user),
        )

    def process(self, output: list[str]) -> AuthorizedKeysData:
        return parse_authorized_keys(output)


# ------------------------------------------------------------------------------------------
# Group members (for AllowGroups)
# ------------------------------------------------------------------------------------------

def parse_group_members(lines: Sequence[str]) -> list[str]:
    """`getent group G` line, then the users whose primary group it is (one per line)."""
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        return []
    parts = lines[0].split(":")
    if len(parts) != 4:
        raise SshFactError(f"unexpected getent group output: {lines[0]!r}")
    members = [m for m in parts[3].split(",") if m]
    members += lines[1:]
    return list(dict.fromkeys(members))


class GroupMembers(FactBase):
    """Users in `group`: its listed members plus users whose primary group it is ([] if absent)."""

    def command(self, group: str) -> StringCommand:
        return StringCommand(
            "sh", "-c", QuoteString(
                'g=$(getent group "$1") || exit 0; echo "$g"; '
                'gid=$(echo "$g" | cut -d: -f3); getent passwd | awk -F: -v gid="$gid" \'$4 == gid {print $1}\''
            ), "gpufleet-group-members", QuoteString(group),
        )

    def process(self, output: list[str]) -> list[str]:
        return parse_group_members(output)


# ------------------------------------------------------------------------------------------
# /etc/ssh/moduli
# ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModuliData(_Json):
    total: int
    small: int  # moduli below the requested size


def parse_moduli_counts(lines: Iterable[str]) -> ModuliData | None:
    for line in lines:
        match = re.fullmatch(r"\s*total=(\d+) small=(\d+)\s*", line)
        if match:
            return ModuliData(total=int(match[1]), small=int(match[2]))
        if line.strip() == "missing":
            return None
    raise SshFactError("expected 'total=N small=M' from the moduli count")


def moduli_awk_small(min_bits: int) -> str:
    # Column 5 of moduli(5) is the size in bits minus one (3071 for a 3072-bit modulus).
    return f"$1 !~ /^#/ && NF >= 7 && $5 + 1 < {int(min_bits)}"


class SmallModuli(FactBase):
    """How many Diffie-Hellman moduli in /etc/ssh/moduli are below `min_bits` (None: no file)."""

    def command(self, min_bits: int = 3072, path: str = "/etc/ssh/moduli") -> StringCommand:
        return StringCommand(
            "if", "[", "-r", QuoteString(path), "];", "then", "awk",
            QuoteString(f"{moduli_awk_small(min_bits)} {{s++}} $1 !~ /^#/ && NF >= 7 {{t++}} "
                        "END {printf \"total=%d small=%d\\n\", t, s}"),
            QuoteString(path), ";", "else", "echo", "missing;", "fi",
        )

    def process(self, output: list[str]) -> ModuliData | None:
        return parse_moduli_counts(output)
