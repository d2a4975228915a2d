"""
sshd's files: who owns its configuration and how readable it is, and which host keys it has
(type, size, fingerprint), for the dev-sec ssh-baseline controls sshd-04/05 (modes) and
sshd-14/50 (host key set, RSA size).

One ``stat`` for the modes; the public keys are read with the shell's ``read`` and decoded
here (size and SHA256 fingerprint as ``ssh-keygen -l`` prints them), so the fact costs one
process on the host. ``process()`` is pure and unit-tested on output recorded from real
Debian 12 / 13 hosts (tests/fixtures/ssh/).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from pyinfra.api import FactBase, QuoteString, StringCommand

from gpufleet.facts.ssh import SshFactError

SSH_DIR = "/etc/ssh"
SSHD_CONFIG = "/etc/ssh/sshd_config"
SSHD_DROPIN_DIR = "/etc/ssh/sshd_config.d"
HOST_KEY_FILES = {"ed25519": "/etc/ssh/ssh_host_ed25519_key", "rsa": "/etc/ssh/ssh_host_rsa_key"}

_STAT = "::gpufleet-stat::"
_PUB = "::gpufleet-pub::"
_NOPUB = "::gpufleet-nopub::"

# $1 = the configuration directory, $2... = host key files. Modes of the directory, the main
# file, the drop-in directory and every drop-in and key; then each key's public half (derived
# with ssh-keygen -y only when the .pub file is missing).
_SCRIPT = r"""
d=$1; shift
stat -c '::gpufleet-stat::%a %U %G %F|%n' "$d" "$d/sshd_config" "$d/sshd_config.d" "$d"/sshd_config.d/*.conf "$@" 2>/dev/null
for k in "$@"; do
  [ -e "$k" ] || continue
  if [ -r "$k.pub" ] && read -r line < "$k.pub"; then echo "::gpufleet-pub::$k $line"
  elif line=$(ssh-keygen -y -f "$k" 2>/dev/null); then echo "::gpufleet-pub::$k $line"
  else echo "::gpufleet-nopub::$k"; fi
done
true
"""


@dataclass(frozen=True)
class FileMode:
    path: str
    mode: int  # permission bits, e.g. 0o600
    user: str
    group: str
    kind: str  # "regular file", "directory", ...


@dataclass(frozen=True)
class HostKey:
    path: str
    type: str | None = None  # ssh-ed25519, ssh-rsa...; None when its public half is unreadable
    bits: int | None = None
    fingerprint: str | None = None  # SHA256:..., as ssh-keygen -l prints it


@dataclass(frozen=True)
class SshdFilesData:
    files: dict[str, FileMode] = field(default_factory=dict)
    keys: dict[str, HostKey] = field(default_factory=dict)  # existing host keys by path

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def dropins(self) -> list[str]:
        return sorted(p for p in self.files if p.startswith(SSHD_DROPIN_DIR + "/"))


def _read_string(blob: bytes, offset: int) -> tuple[bytes, int]:
    if offset + 4 > len(blob):
        raise ValueError("truncated key blob")
    (length,) = struct.unpack(">I", blob[offset:offset + 4])
    end = offset + 4 + length
    if end > len(blob):
        raise ValueError("truncated key blob")
    return blob[offset + 4:end], end


def describe_public_key(text: str) -> tuple[str, int | None, str]:
    """(type, size in bits, SHA256 fingerprint) of an OpenSSH public key line, as
    ``ssh-keygen -l`` reports them (RSA: the modulus size; Ed25519: 256)."""
    parts = text.split()
    if len(parts) < 2:
        raise SshFactError(f"not an OpenSSH public key: {text!r}")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        name, offset = _read_string(blob, 0)
        key_type = name.decode("ascii")
        bits: int | None = None
        if key_type == "ssh-rsa":
            _exponent, offset = _read_string(blob, offset)
            modulus, _ = _read_string(blob, offset)
            bits = int.from_bytes(modulus, "big").bit_length()
        elif key_type == "ssh-ed25519":
            bits = 256
        elif key_type.startswith("ecdsa-sha2-nistp"):
            bits = int(key_type.removeprefix("ecdsa-sha2-nistp"))
    except (binascii.Error, ValueError, UnicodeDecodeError) as exc:
        raise SshFactError(f"unreadable OpenSSH public key ({exc}): {text[:60]!r}") from exc
    if key_type != parts[0]:
        raise SshFactError(f"public key says {parts[0]} but its blob is {key_type}")
    fingerprint = "SHA256:" + base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return key_type, bits, fingerprint


def parse_sshd_files(lines: Iterable[str]) -> SshdFilesData:
    files: dict[str, FileMode] = {}
    keys: dict[str, HostKey] = {}
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith(_STAT):
            head, sep, path = line[len(_STAT):].partition("|")
            fields = head.split(" ", 3)
            if not sep or len(fields) != 4:
                raise SshFactError(f"unexpected stat line: {line!r}")
            try:
                mode = int(fields[0], 8)
            except ValueError as exc:
                raise SshFactError(f"unexpected stat line: {line!r}") from exc
            files[path] = FileMode(path=path, mode=mode, user=fields[1], group=fields[2], kind=fields[3])
        elif line.startswith(_PUB):
            path, _, text = line[len(_PUB):].partition(" ")
            key_type, bits, fingerprint = describe_public_key(text)
            keys[path] = HostKey(path=path, type=key_type, bits=bits, fingerprint=fingerprint)
        elif line.startswith(_NOPUB):
            path = line[len(_NOPUB):]
            keys[path] = HostKey(path=path)
        else:
            raise SshFactError(f"unexpected line in the sshd files output: {line!r}")
    return SshdFilesData(files=files, keys=keys)


class SshdFiles(FactBase):
    """
    Modes of sshd's configuration (``/etc/ssh``, ``sshd_config``, ``sshd_config.d`` and its
    ``*.conf``) and of the host keys, and each existing host key's type, size and fingerprint:

    .. code:: python

        SshdFilesData(
            files={"/etc/ssh/sshd_config": FileMode(path=..., mode=0o644, user="root", ...), ...},
            keys={"/etc/ssh/ssh_host_rsa_key": HostKey(type="ssh-rsa", bits=3072,
                                                       fingerprint="SHA256:..."), ...})
    """

    def command(self) -> StringCommand:
        return StringCommand(
            "sh", "-c", QuoteString(_SCRIPT), "gpufleet-sshd-files",
            QuoteString(SSH_DIR), *(QuoteString(path) for path in HOST_KEY_FILES.values()),
        )

    def process(self, output: list[str]) -> SshdFilesData:
        return parse_sshd_files(output)
