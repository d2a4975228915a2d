"""Per-key value checks for gpufleet settings.

Each check takes the raw value from tiers.yaml or the inventory and returns the normalised value,
or raises BadValue with the problem and the allowed values. Version keys are checked against
compat.yaml, so no version literal lives here.

KEYS below is the one place where the grammar of every key is stated. Every value goes through
KeySpec.validate(): first the rules every text obeys, whatever its key (ASCII only, no control
characters, no shell metacharacters, at most MAX_TEXT characters, in list items and mapping keys
too), then the key's own grammar. No key's grammar accepts a metacharacter, so a key added to
KEYS cannot let one through.
"""

from __future__ import annotations

import ipaddress
import re
import string
import unicodedata
import urllib.parse
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from gpufleet.catalog import mig
from gpufleet.catalog.compat import compat_data
from gpufleet.catalog.gpus import model_names
from gpufleet.catalog.pytorch import pytorch_data, unverified_releases
from gpufleet.catalog.tiers import tier_names
from gpufleet.versions import is_version, normalise_branch, parse

NONE = "none"
AUTO = "auto"


class BadValue(ValueError):
    def __init__(self, problem: str, allowed: str):
        super().__init__(problem)
        self.problem = problem
        self.allowed = allowed


Check = Callable[[Any], Any]


#: characters no setting may contain: each is shell syntax somewhere the value may end up
SHELL_METACHARACTERS = "'\"`$;&|<>\\"
MAX_TEXT = 1024


def show(value: Any, limit: int = 60) -> str:
    """repr() of a value for a one-line message: escapes newlines, shortens long values."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


_SUSPECT = re.compile("[^\x20-\x7e]|[" + re.escape(SHELL_METACHARACTERS) + "]")


def text_problem(text: str, permits: str = "") -> str | None:
    """Why `text` may not appear in any setting, or None. Rules shared by every key."""
    if len(text) > MAX_TEXT:
        return f"{show(text)} is too long (at most {MAX_TEXT} characters)"
    if not _SUSPECT.search(text):  # the common case, in one pass of the regex engine
        return None
    for position, char in enumerate(text, 1):
        if char in SHELL_METACHARACTERS and char not in permits:
            return f"{show(text)} contains the shell metacharacter {char!r} (character {position})"
        if ord(char) < 32 or ord(char) == 127:
            return f"{show(text)} contains the control character {char!r} (character {position})"
        if ord(char) > 126:
            name = unicodedata.name(char, "unnamed")
            return (f"{show(text)} contains the non-ASCII character {char!r} (U+{ord(char):04X} {name}, "
                    f"character {position}): a look-alike?")
    return None


def _texts(value: Any) -> Iterator[str]:
    """Every string inside a setting value: itself, list items, mapping keys and values."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for item in value:
            yield from _texts(item)


@dataclass(frozen=True)
class KeySpec:
    check: Check
    allowed: Callable[[], str]  # lazily computed (some lists come from the YAML data)
    #: metacharacters this key's own grammar needs (its check then decides where they may stand)
    permits: str = ""

    def validate(self, value: Any) -> Any:
        """The normalised value, or BadValue: the rules of every text first, then the key's grammar."""
        for text in _texts(value):
            problem = text_problem(text, self.permits)
            if problem:
                never = " ".join(c for c in SHELL_METACHARACTERS if c not in self.permits)
                raise BadValue(problem, self.allowed() + f" (never: non-ASCII, control characters, {never})")
        return self.check(value)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _enum(*choices: str) -> KeySpec:
    allowed = " | ".join(choices)

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise BadValue(f"expected one of the strings, got {_type_name(value)} {show(value)}", allowed)
        if value not in choices:
            raise BadValue(f"unknown value {show(value)}", allowed)
        return value

    return KeySpec(check, lambda: allowed)


def _bool() -> KeySpec:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise BadValue(f"expected a boolean, got {_type_name(value)} {show(value)}", "true | false")
        return value

    return KeySpec(check, lambda: "true | false")


def _int(minimum: int, maximum: int = 2 ** 31 - 1) -> KeySpec:
    """An integer within bounds (every integer setting has an upper bound too: a huge number is a
    typo, and some end up in C ints: sshd, nftables, sysctl)."""
    allowed = f"integer >= {minimum} and <= {maximum}"

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadValue(f"expected an integer, got {_type_name(value)} {show(value)}", allowed)
        if not minimum <= value <= maximum:
            raise BadValue(f"{show(value)} out of range", allowed)
        return value

    return KeySpec(check, lambda: allowed)


def _list(item_check: Callable[[Any], Any], allowed: str, key: Callable[[Any], Any] = lambda item: item,
          unique: bool = True) -> KeySpec:
    """A list whose items pass item_check; unless not unique, the same item twice (after
    normalising, compared by `key`) is refused."""

    def check(value: Any) -> tuple[Any, ...]:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise BadValue(f"expected a list, got {_type_name(value)} {show(value)}", allowed)
        out: list[Any] = []
        for item in value:
            normal = item_check(item)
            if unique and any(key(normal) == key(seen) for seen in out):
                raise BadValue(f"{show(item)} is listed twice", allowed + ", each once")
            out.append(normal)
        return tuple(out)

    return KeySpec(check, lambda: allowed)


def _string(item: Any, allowed: str) -> str:
    if not isinstance(item, str):
        raise BadValue(f"expected a string, got {_type_name(item)} {show(item)}", allowed)
    return item


def _text(pattern: str, allowed: str) -> KeySpec:
    regex = re.compile(pattern, re.ASCII)

    def check(value: Any) -> str:
        _string(value, allowed)
        if not regex.fullmatch(value):
            raise BadValue(f"malformed value {show(value)}", allowed)
        return value

    return KeySpec(check, lambda: allowed)


# --- grammars of URLs, paths, names ------------------------------------------------------------

_DNS_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", re.ASCII)
_URL_PATH = re.compile(r"[A-Za-z0-9._~/%+=,:@-]*", re.ASCII)
URL_ALLOWED = "an http:// or https:// URL: host[:port][/path], without user:password@, ?query, #fragment or .."


def _check_hostname(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    labels = name[:-1].split(".") if name.endswith(".") else name.split(".")
    return (len(name) <= 253 and all(_DNS_LABEL.fullmatch(label) for label in labels)
            and not labels[-1].isdigit())


def _check_url(value: Any, allowed: str = URL_ALLOWED) -> str:
    _string(value, allowed)
    if any(c.isspace() for c in value):
        raise BadValue(f"{show(value)} contains whitespace", allowed)
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port  # ValueError when not a number in 0-65535
    except ValueError as exc:
        raise BadValue(f"malformed URL {show(value)}: {exc}", allowed) from None
    if parts.scheme not in ("http", "https") or not value.startswith(parts.scheme + "://"):
        raise BadValue(f"{show(value)}: the scheme must be http or https", allowed)
    if "@" in parts.netloc:
        raise BadValue(f"{show(value)} carries credentials (user@ or user:password@): they would be written "
                       "into apt sources on every host", allowed)
    if not parts.hostname or not _check_hostname(parts.hostname):
        raise BadValue(f"{show(value)} has no valid host name", allowed)
    if port == 0:
        raise BadValue(f"{show(value)}: port 0", allowed)
    if parts.query or parts.fragment or "?" in value or "#" in value:
        raise BadValue(f"{show(value)} has a query or fragment", allowed)
    if not _URL_PATH.fullmatch(parts.path):
        raise BadValue(f"{show(value)}: the path has characters outside A-Z a-z 0-9 . _ ~ / % + = , : @ -", allowed)
    if ".." in parts.path.split("/"):
        raise BadValue(f"{show(value)}: the path contains '..'", allowed)
    return value


def _url(auto: bool = False, none: bool = False) -> KeySpec:
    allowed = ("auto, or " if auto else "") + ("none, or " if none else "") + URL_ALLOWED

    def check(value: Any) -> str:
        if auto and value == AUTO:
            return AUTO
        if none and value == NONE:
            return NONE
        return _check_url(value, allowed)

    return KeySpec(check, lambda: allowed)


_CACHE_ALLOWED = ("none, or the http:// URL of an apt caching proxy speaking apt-cacher-ng's URL forms, such as "
                  "http://cache.example:3142 (no path: apt-cacher-ng serves at its root)")


def _check_cache_url(value: Any) -> str:
    if value == NONE:
        return NONE
    url = _check_url(value, _CACHE_ALLOWED)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        # apt talks plain HTTP to a proxy; the signatures, not the transport, carry the trust
        raise BadValue(f"{show(value)}: the cache is reached over http:// (apt-cacher-ng has no TLS)", _CACHE_ALLOWED)
    if parts.path not in ("", "/"):
        raise BadValue(f"{show(value)} has a path", _CACHE_ALLOWED)
    return url.rstrip("/")


_UPSTREAM_PORTS_ALLOWED = ("list of TCP ports from 1 to 32767 the cache may fetch from, such as [80, 443] "
                           "(Debian 12's apt-cacher-ng 3.7.4 answers 503 for an upstream port from 32768 up)")


def _check_upstream_port(item: Any) -> int:
    if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= 32767:
        raise BadValue(f"{show(item)} is not a TCP port below 32768", _UPSTREAM_PORTS_ALLOWED)
    return item


_PATH_PART = re.compile(r"[A-Za-z0-9._+@-]+", re.ASCII)


def _check_abs_path(value: Any, allowed: str) -> str:
    _string(value, allowed)
    if not value.startswith("/"):
        raise BadValue(f"{show(value)} is not an absolute path", allowed)
    parts = value.split("/")[1:]
    if value != "/" and not all(parts):
        raise BadValue(f"{show(value)} has an empty path component (// or a trailing /)", allowed)
    if any(part in (".", "..") for part in parts):
        raise BadValue(f"{show(value)}: path traversal ('.' or '..' components)", allowed)
    if not all(_PATH_PART.fullmatch(part) for part in parts if part):
        raise BadValue(f"{show(value)}: path components may only use A-Z a-z 0-9 . _ + @ -", allowed)
    return value


def _signing_key() -> KeySpec:
    allowed = "none, or the absolute path of the MOK private key on the host (A-Z a-z 0-9 . _ + @ - and /, no ..)"

    def check(value: Any) -> str:
        if value == NONE:
            return NONE
        return _check_abs_path(value, allowed)

    return KeySpec(check, lambda: allowed)


# Debian Policy 5.6.1 (Source/Package names) and 5.6.12 (Version): name = [a-z0-9][a-z0-9+.-]+;
# version = [epoch:]upstream_version[-debian_revision], upstream starting with a digit, with a
# hyphen only when there is a revision and a colon only when there is an epoch.
_DEB_NAME = re.compile(r"[a-z0-9][a-z0-9+.-]+", re.ASCII)
_DEB_REVISION = re.compile(r"[A-Za-z0-9+.~]+", re.ASCII)
PACKAGE_ALLOWED = ("Debian package names (Debian Policy 5.6.1: [a-z0-9][a-z0-9+.-]+, at least two characters), "
                   "each optionally =version (Policy 5.6.12: [epoch:]upstream[-revision])")


def is_debian_version(text: str) -> bool:
    epoch, colon, rest = text.partition(":") if re.match(r"\d+:", text) else ("", "", text)
    upstream, hyphen, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
    if hyphen and not _DEB_REVISION.fullmatch(revision):
        return False
    chars = "A-Za-z0-9.+~" + ("\\-" if hyphen else "") + (":" if colon else "")
    return bool(re.fullmatch(rf"[0-9][{chars}]*", upstream, re.ASCII))


def _check_package(item: Any) -> str:
    _string(item, PACKAGE_ALLOWED)
    name, eq, version = item.partition("=")
    if not _DEB_NAME.fullmatch(name) or len(name) > 255:
        raise BadValue(f"{show(item)} is not a Debian package name", PACKAGE_ALLOWED)
    if eq and not is_debian_version(version):
        raise BadValue(f"{show(item)}: {show(version)} is not a Debian version", PACKAGE_ALLOWED)
    return item


# OpenSSH KexAlgorithms names (ssh_config(5) / `ssh -Q kex`). Planning checks the grammar and
# refuses the weak ones (ssh-audit fails them, and the hardening promises to pass it); whether
# the host's sshd knows a well-formed name is its own `sshd -t` check of the candidate
# configuration, before any reload (deploys/hardening.py), since the list differs by OpenSSH
# release (mlkem768x25519-sha256 from 9.9).
KEX_KNOWN = ("curve25519-sha256", "curve25519-sha256@libssh.org", "sntrup761x25519-sha512",
             "sntrup761x25519-sha512@openssh.com", "mlkem768x25519-sha256", "diffie-hellman-group16-sha512",
             "diffie-hellman-group18-sha512", "diffie-hellman-group-exchange-sha256")
KEX_WEAK = ("diffie-hellman-group1-sha1", "diffie-hellman-group14-sha1", "diffie-hellman-group14-sha256",
            "diffie-hellman-group-exchange-sha1", "ecdh-sha2-nistp256", "ecdh-sha2-nistp384", "ecdh-sha2-nistp521")
_SSH_ALGORITHM = re.compile(r"[a-z0-9][a-z0-9.+-]{0,63}(@[a-z0-9][a-z0-9.-]{0,63})?", re.ASCII)
KEX_ALLOWED = ("list of OpenSSH KexAlgorithms names (lower-case a-z 0-9 . + -, optionally @domain), not the weak "
               + ", ".join(KEX_WEAK) + "; e.g. " + ", ".join(KEX_KNOWN[:2]))


def _check_kex(item: Any) -> str:
    _string(item, KEX_ALLOWED)
    if not _SSH_ALGORITHM.fullmatch(item):
        raise BadValue(f"{show(item)} is not an OpenSSH algorithm name", KEX_ALLOWED)
    if item in KEX_WEAK:
        raise BadValue(f"{item} is a weak key exchange (ssh-audit fails it)", KEX_ALLOWED)
    return item


# Linux interface names: at most 15 characters (IFNAMSIZ 16 with the NUL), no / : or space.
_IFNAME = r"[A-Za-z0-9_.-]{1,15}"
_HCA = r"[A-Za-z0-9_.-]{1,64}(?::[0-9]{1,3})?"


def _nccl_list(item: str, allowed: str) -> KeySpec:
    # NCCL_SOCKET_IFNAME / NCCL_IB_HCA: optional ^ (exclude) then = (exact names instead of
    # prefixes), then a comma-separated list (NCCL environment variables documentation).
    regex = re.compile(rf"auto|\^?=?{item}(?:,{item})*", re.ASCII)

    def check(value: Any) -> str:
        _string(value, allowed)
        if not regex.fullmatch(value):
            raise BadValue(f"malformed value {show(value)}", allowed)
        names = value.lstrip("^=").split(",")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice and value != AUTO:
            raise BadValue(f"{show(twice[0])} is listed twice", allowed)
        return value

    return KeySpec(check, lambda: allowed)


def _size(units: str, max_bytes: int, allowed: str) -> KeySpec:
    factor = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

    def check(value: Any) -> str:
        _string(value, allowed)
        match = re.fullmatch(rf"([0-9]{{1,19}})([{units}]?)", value, re.ASCII)
        if not match:
            raise BadValue(f"malformed size {show(value)}", allowed)
        size = int(match[1]) * factor[match[2].lower()]
        if not 1 <= size <= max_bytes:
            raise BadValue(f"{show(value)} out of range", allowed)
        return value

    return KeySpec(check, lambda: allowed)


# --- keys whose allowed values come from compat.yaml / tiers.yaml ---------------------------


def _check_tier(value: Any) -> str:
    names = tier_names()
    if not isinstance(value, str) or value not in names:
        raise BadValue(f"unknown tier {show(value)}", ", ".join(names))
    return value


def _branches_allowed() -> str:
    return "auto, " + ", ".join(sorted(compat_data().usable_branches, key=int))


def _check_branch(value: Any) -> str:
    if value == AUTO:
        return AUTO
    branch = normalise_branch(value)
    data = compat_data()
    if branch is None:
        raise BadValue(f"expected a branch such as \"580\" or auto, got {_type_name(value)} {show(value)}", _branches_allowed())
    info = data.driver_branches.get(branch)
    if info is None:
        raise BadValue(f"driver branch R{branch} is not in the compatibility data", _branches_allowed())
    if not info.usable:
        raise BadValue(f"driver branch R{branch} has unverified data ({info.note})", _branches_allowed())
    return branch


def _check_driver_version(value: Any) -> str:
    if value == AUTO:
        return AUTO
    if not is_version(value) or value.count(".") < 1:
        raise BadValue(f"expected a full driver version such as \"580.95.05\" or auto, got {show(value)}", "auto | a version listed in compat.yaml")
    return value  # that it is listed for the branch is a cross-key check (settings.py)


def _cuda_allowed() -> str:
    return "none, " + ", ".join(sorted(compat_data().cuda_releases, key=parse, reverse=True))


def _check_cuda(value: Any) -> str:
    if value == NONE:
        return NONE
    if isinstance(value, float):
        raise BadValue(f"CUDA version given as a number {value!r}; quote it (\"{value}\")", _cuda_allowed())
    releases = compat_data().cuda_releases
    if isinstance(value, str) and value not in releases:
        # an update "13.2.0" (GA) / "13.2.2" asks for exactly that update of its minor: kept as written
        minor = ".".join(value.split(".")[:2])
        if minor in releases and value in releases[minor].updates:
            return value
        if minor in releases:
            raise BadValue(f"CUDA {show(value)} is not an update of CUDA {minor} in the compatibility data",
                           ", ".join(["none", minor, *reversed(list(releases[minor].updates))]))
    if not isinstance(value, str) or value not in releases:
        raise BadValue(f"CUDA {show(value)} is not in the compatibility data", _cuda_allowed())
    return value


def _cudnn_allowed() -> str:
    return "none, " + ", ".join(compat_data().cudnn_versions)


def _check_cudnn(value: Any) -> str:
    if value == NONE:
        return NONE
    if not is_version(value):
        raise BadValue(f"expected a quoted cuDNN version, got {_type_name(value)} {show(value)}", _cudnn_allowed())
    known = compat_data().cudnn_versions
    if value in known:
        return value
    # "9.17" means the newest 9.17.x release in the data
    matches = [v for v in known if v.startswith(value + ".")]
    if matches:
        return matches[0]
    raise BadValue(f"cuDNN {show(value)} is not in the compatibility data", _cudnn_allowed())



def _pytorch_allowed() -> str:
    return "none, " + ", ".join(pytorch_data().versions)


def _check_pytorch(value: Any) -> str:
    if value == NONE:
        return NONE
    if isinstance(value, float):
        raise BadValue(f"PyTorch version given as a number {value!r}; quote it (\"{value}\")", _pytorch_allowed())
    if not isinstance(value, str) or not re.fullmatch(r"\d+\.\d+", value):
        raise BadValue(f"expected a PyTorch release such as \"2.11\" (major.minor), got {_type_name(value)} {show(value)}",
                       _pytorch_allowed())
    if value in unverified_releases():
        raise BadValue(f"PyTorch {value}: the architecture lists of its wheels are unverified in the compatibility data",
                       _pytorch_allowed())
    if value not in pytorch_data().releases:
        raise BadValue(f"PyTorch {value} is not in the compatibility data", _pytorch_allowed())
    return value


# --- where PyTorch lives (gpufleet/plans/pytorch_runtime.py) ---------------------------------------

_PYTHON_ALLOWED = ("the absolute path of a python interpreter on the host, such as /opt/conda/envs/ml/bin/python "
                   "(A-Z a-z 0-9 . _ + @ - and /, no .., no shell metacharacters)")
_VENV_PATH_ALLOWED = ("an absolute path for gpufleet's shared PyTorch environment, such as /opt/gpufleet/pytorch: "
                      "at least two components, not / or a system directory, not under a world-writable or "
                      "per-user place (/tmp, /var/tmp, /dev, /run, /home, /root) (A-Z a-z 0-9 . _ + @ - and /, no ..)")
_INDEX_ALLOWED = ("auto (PyTorch's index for the resolved CUDA variant), or " + URL_ALLOWED
                  + "; {variant} in the path stands for the variant (cu130, cu128...)")
_WHEEL_DIR_ALLOWED = ("none, or the absolute path of a folder of wheels on the host (pip --no-index --find-links), "
                      "such as /srv/wheels/pytorch (A-Z a-z 0-9 . _ + @ - and /, no ..)")
#: where no shared environment goes: the system's own folders, and places other users write in
_NO_VENV_UNDER = ("/tmp/", "/var/tmp/", "/dev/", "/proc/", "/sys/", "/run/", "/home/", "/root/", "/boot/", "/etc/")


def _check_interpreter(value: Any) -> str:
    _check_abs_path(value, _PYTHON_ALLOWED)
    if value.endswith("/"):
        raise BadValue(f"{show(value)} is a folder, not an interpreter", _PYTHON_ALLOWED)
    return value


def _check_venv_path(value: Any) -> str:
    _check_abs_path(value, _VENV_PATH_ALLOWED)
    if value.count("/") < 2 or value in _SYSTEM_DIRS or value in ("/usr/local", "/var/lib", "/opt/conda") \
            or (value + "/").startswith(_NO_VENV_UNDER):
        raise BadValue(f"{show(value)} is a system, per-user or world-writable place", _VENV_PATH_ALLOWED)
    return value


def _check_index_url(value: Any) -> str:
    if value == AUTO:
        return AUTO
    _string(value, _INDEX_ALLOWED)
    if "@" in urllib.parse.urlsplit(value).netloc:
        raise BadValue(f"{show(value)} carries credentials (user@ or user:password@): they would be on pip's "
                       "command line on every host", _INDEX_ALLOWED)
    bare = value.replace("{variant}", "cu130")
    if "{" in bare or "}" in bare:
        raise BadValue(f"{show(value)}: braces only as {{variant}}", _INDEX_ALLOWED)
    _check_url(bare, _INDEX_ALLOWED)
    return value


def _check_wheel_dir(value: Any) -> str:
    if value == NONE:
        return NONE
    return _check_abs_path(value, _WHEEL_DIR_ALLOWED)



MAX_CLOCK_MHZ = 10000
_CLOCK_ALLOWED = f"max | default | unmanaged | {{memory: MHz, graphics: MHz}} (1-{MAX_CLOCK_MHZ})"


def _check_clock(value: Any) -> Any:
    if isinstance(value, str):
        if value in ("max", "default", "unmanaged"):
            return value
        raise BadValue(f"unknown clock policy {show(value)}", _CLOCK_ALLOWED)
    if isinstance(value, Mapping):
        if set(value) != {"memory", "graphics"}:
            raise BadValue(f"clock pair needs exactly the keys memory and graphics, got {show(sorted(map(str, value)))}", _CLOCK_ALLOWED)
        for part in ("memory", "graphics"):
            item = value[part]
            if isinstance(item, bool) or not isinstance(item, int) or not 1 <= item <= MAX_CLOCK_MHZ:
                raise BadValue(f"clock {part} must be an integer MHz from 1 to {MAX_CLOCK_MHZ}, got {show(item)}", _CLOCK_ALLOWED)
        return MappingProxyType({"memory": value["memory"], "graphics": value["graphics"]})
    raise BadValue(f"expected a policy name or a clock pair, got {_type_name(value)} {show(value)}", _CLOCK_ALLOWED)


def _check_mig(value: Any) -> Any:
    """gpu_mig's grammar (gpufleet/catalog/mig.py); each GPU's profiles are checked at planning."""
    try:
        return mig.check_setting(value)
    except ValueError as error:
        raise BadValue(str(error), mig.GRAMMAR) from None


def _nccl_allowed() -> str:
    return " | ".join(compat_data().nccl_profiles)


def _check_nccl(value: Any) -> str:
    if not isinstance(value, str) or value not in compat_data().nccl_profiles:
        raise BadValue(f"unknown NCCL profile {show(value)}", _nccl_allowed())
    return value


MAX_OMP_THREADS = 1024


def _check_omp(value: Any) -> Any:
    allowed = f"auto | integer from 1 to {MAX_OMP_THREADS}"
    if value == AUTO:
        return AUTO
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadValue(f"expected auto or an integer, got {_type_name(value)} {show(value)}", allowed)
    if not 1 <= value <= MAX_OMP_THREADS:
        raise BadValue(f"{show(value)} out of range", allowed)
    return value


# PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF: "<option>:<value>,<option2>:<value2>..." with each
# option's values as documented in PyTorch's "CUDA semantics" notes, section "Optimizing memory
# usage with PYTORCH_ALLOC_CONF" (docs/source/notes/cuda.md, https://docs.pytorch.org/docs/stable/
# notes/cuda.html#optimizing-memory-usage-with-pytorch-alloc-conf) and the checks of
# c10/cuda/CUDAAllocatorConfig.cpp (max_split_size_mb > 20; divisions and register threads powers
# of two, at most 128 threads). Which options gpufleet accepts is compat.yaml's
# pytorch_alloc_options; each needs a value grammar here (a unit test checks).
_BOOL_WORD = r"True|False"
_POW2 = r"1|2|4|8|16|32|64|128|256|512|1024|2048|4096|8192|16384|32768|65536"
_MB = r"[1-9][0-9]{0,6}"
ALLOC_OPTION_VALUES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "backend": (r"native|cudaMallocAsync", "native | cudaMallocAsync"),
    "max_split_size_mb": (r"2[1-9]|[3-9][0-9]|[1-9][0-9]{2,6}", "MB > 20"),
    "roundup_power2_divisions": (rf"(?:{_POW2})|\[(?:(?:{_POW2}|>):(?:{_POW2}))(?:,(?:{_POW2}|>):(?:{_POW2}))*\]",
                                 "a power of 2, or [MB:divisions,...,>:divisions] with powers of 2"),
    "max_non_split_rounding_mb": (_MB, "MB >= 1"),
    "garbage_collection_threshold": (r"0?\.[0-9]*[1-9][0-9]*", "a fraction strictly between 0.0 and 1.0"),
    "expandable_segments": (_BOOL_WORD, "True | False"),
    "release_lock_on_cudamalloc": (_BOOL_WORD, "True | False"),
    "pinned_use_cuda_host_register": (_BOOL_WORD, "True | False"),
    "pinned_num_register_threads": (r"1|2|4|8|16|32|64|128", "a power of 2 up to 128"),
    "pinned_use_background_threads": (_BOOL_WORD, "True | False"),
})


def _alloc_allowed() -> str:
    options = compat_data().pytorch_alloc_options
    return "empty, or option:value[,option:value] with options " + ", ".join(options)


def _check_alloc_conf(value: Any) -> str:
    allowed = _alloc_allowed()
    _string(value, allowed)
    if value == "":
        return value
    options = compat_data().pytorch_alloc_options
    # roundup_power2_divisions may carry a bracketed list with commas: split outside brackets only
    parts = re.split(r",(?![^\[]*\])", value)
    seen = set()
    for part in parts:
        name, sep, setting = part.partition(":")
        if not sep or not setting:
            raise BadValue(f"malformed entry {show(part)} (option:value)", allowed)
        if name not in options:
            raise BadValue(f"unknown PyTorch allocator option {show(name)}", allowed)
        if name in seen:
            raise BadValue(f"option {name} given twice", allowed)
        seen.add(name)
        pattern, values = ALLOC_OPTION_VALUES[name]
        if not re.fullmatch(pattern, setting, re.ASCII):
            raise BadValue(f"{name}:{show(setting)}: {name} takes {values}", allowed)
    return value


ULIMIT_NAMES = ("core", "cpu", "data", "fsize", "locks", "memlock", "msgqueue", "nice", "nofile", "nproc",
                "rss", "rtprio", "rttime", "sigpending", "stack")
_ULIMITS_ALLOWED = ("mapping of ulimit name (" + ", ".join(ULIMIT_NAMES) + ") to an integer from -1 (unlimited) "
                    "to 2^63-1, e.g. {memlock: -1, stack: 67108864}")


def _check_ulimits(value: Any) -> Mapping[str, int]:
    if not isinstance(value, Mapping):
        raise BadValue(f"expected a mapping, got {_type_name(value)} {show(value)}", _ULIMITS_ALLOWED)
    for name, limit in value.items():
        if name not in ULIMIT_NAMES:
            raise BadValue(f"unknown ulimit {show(name)}", _ULIMITS_ALLOWED)
        if isinstance(limit, bool) or not isinstance(limit, int) or not -1 <= limit < 2 ** 63:
            raise BadValue(f"ulimit {name} must be an integer from -1 to 2^63-1, got {show(limit)}", _ULIMITS_ALLOWED)
    return MappingProxyType(dict(value))


_PORTS_ALLOWED = "list of \"port/proto\" or \"low-high/proto\" strings (proto tcp or udp, ports 1-65535) or integers"


def _check_port(item: Any) -> str:
    if isinstance(item, int) and not isinstance(item, bool):
        item = f"{item}/tcp"
    if not isinstance(item, str):
        raise BadValue(f"bad port {show(item)}", _PORTS_ALLOWED)
    match = re.fullmatch(r"([0-9]{1,5})(?:-([0-9]{1,5}))?/(tcp|udp)", item, re.ASCII)
    if not match or not all(1 <= int(p) <= 65535 for p in match.groups()[:2] if p):
        raise BadValue(f"bad port {show(item)}", _PORTS_ALLOWED)
    if match[2] and int(match[2]) <= int(match[1]):
        raise BadValue(f"bad port range {show(item)}: the second port must be higher", _PORTS_ALLOWED)
    return item


def split_port(item: str) -> tuple[str, str]:
    """A port item _check_port let through, as (port or range, protocol): "6817-6819/tcp" ->
    ("6817-6819", "tcp"). The one reader of the one port grammar (the firewall plan uses it)."""
    port, _, proto = item.partition("/")
    return port, proto


def _check_login_name(item: Any) -> str:
    # sshd AllowUsers/AllowGroups patterns: names with ? and * wildcards, optional @host
    if not isinstance(item, str) or not re.fullmatch(r"[A-Za-z0-9._*?!%-][A-Za-z0-9._*?!@%/-]{0,255}", item, re.ASCII):
        raise BadValue(f"bad name {show(item)}", "user or group names (sshd patterns)")
    return item


_CIDRS_ALLOWED = "list of CIDRs such as 10.0.0.0/16 or fd00::/8"


def _check_cidr(item: Any) -> str:
    _string(item, _CIDRS_ALLOWED)
    try:
        network = ipaddress.ip_network(item, strict=False)
    except ValueError:
        raise BadValue(f"bad network {show(item)}", _CIDRS_ALLOWED) from None
    if "/" in item and ipaddress.ip_address(item.partition("/")[0]) != network.network_address:
        raise BadValue(f"{show(item)} has host bits set (did you mean {network}?)", _CIDRS_ALLOWED)
    return str(network)


_TRUSTED_ALLOWED = _CIDRS_ALLOWED + ", each at least a /1 (the peers that may reach every port)"


def _check_trusted_cidr(item: Any) -> str:
    """A trusted network, never all of them: 0.0.0.0/0 or ::/0 (any /0) would open every port
    to the whole internet, the firewall left for show."""
    _string(item, _TRUSTED_ALLOWED)
    try:
        everything = ipaddress.ip_network(item, strict=False).prefixlen == 0
    except ValueError:
        everything = False  # _check_cidr says what is wrong with it
    if everything:
        raise BadValue(f"{show(item)} trusts every address, the whole internet, on every port", _TRUSTED_ALLOWED)
    return _check_cidr(item)


_CLUSTER_ALLOWED = (_CIDRS_ALLOWED + ": the networks of the host's training peers (their fabric or cluster "
                    "network), each at most as wide as a /8 (IPv4) or a /16 (IPv6)")
#: the widest network a list of training peers may name: 10.0.0.0/8 is the widest private block
#: in IPv4; fd00::/8 (ULA) is one site's choice of prefix, a /16 leaves it room.
_CLUSTER_WIDEST = {4: 8, 6: 16}


def _check_cluster_cidr(item: Any) -> str:
    """A network of training peers: every TCP port is open to it, so never the whole internet
    (0.0.0.0/0, ::/0), nor anything as wide (0.0.0.0/1, 2000::/3 the global unicast space,
    ::ffff:0:0/96 every IPv4 address as IPv6 sees it): a cluster fits in a /8."""
    _string(item, _CLUSTER_ALLOWED)
    try:
        network = ipaddress.ip_network(item, strict=False)
    except ValueError:
        return _check_cidr(item)  # says what is wrong with it
    mapped = isinstance(network, ipaddress.IPv6Network) and network.subnet_of(ipaddress.IPv6Network("::ffff:0:0/96"))
    width = (network.prefixlen - 96, 4) if mapped else (network.prefixlen, network.version)
    if width[0] == 0 and not mapped:
        raise BadValue(f"{show(item)} is every address, the whole internet: every TCP port would be open to it",
                       _CLUSTER_ALLOWED)
    if width[0] < _CLUSTER_WIDEST[width[1]]:
        what = "IPv4 addresses, as IPv6 writes them" if mapped else "addresses"
        raise BadValue(f"{show(item)} spans 2^{(32 if width[1] == 4 else 128) - width[0]} {what}, a part of the "
                       "whole internet, not a cluster: every TCP port would be open to it", _CLUSTER_ALLOWED)
    return _check_cidr(item)


_LISTEN_ALLOWED = "all, or one IP address of the host such as 10.0.0.5, 127.0.0.1 or fd00::5"


def _check_listen_address(value: Any) -> str:
    _string(value, _LISTEN_ALLOWED)
    if value == "all":
        return value
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise BadValue(f"not an IP address: {show(value)}", _LISTEN_ALLOWED) from None
    if address.is_unspecified or address.is_multicast:
        raise BadValue(f"{show(value)} is not one address of the host (use all for every address)", _LISTEN_ALLOWED)
    return str(address)


def _check_gpu_model(item: Any) -> str:
    if not isinstance(item, str) or item not in model_names():
        raise BadValue(f"unknown GPU model {show(item)}", "nvidia-smi names from compat.yaml: " + ", ".join(model_names()))
    return item


MAX_GPUS = 64


def _check_gpu_count(value: Any) -> tuple[int, int]:
    allowed = f"an integer from 1 to {MAX_GPUS}, or [min, max]"
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= MAX_GPUS:
            raise BadValue(f"{value} out of range", allowed)
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        low, high = value
        if 1 <= low <= high <= MAX_GPUS:
            return (low, high)
    raise BadValue(f"bad GPU count {show(value)}", allowed)


def _os_allowed() -> str:
    data = compat_data()
    return ", ".join(sorted(set(data.nvidia_repo["os_dirs"]) | set(data.distro_offers)))


def _check_os(value: Any) -> str:
    data = compat_data()
    if not isinstance(value, str) or (value not in data.nvidia_repo["os_dirs"] and value not in data.distro_offers):
        raise BadValue(f"unknown OS release {show(value)}", _os_allowed())
    return value


_SNAPSHOT_TARGET_ALLOWED = ("empty, or an LVM vg/lv, a btrfs subvolume path (/, /srv) or a ZFS dataset (rpool/ROOT/debian): "
                            "A-Z a-z 0-9 _ . + - @ : and /, no ..")


def _check_snapshot_target(value: Any) -> str:
    allowed = _SNAPSHOT_TARGET_ALLOWED
    _string(value, allowed)
    if value == "":
        return value
    if not re.fullmatch(r"[A-Za-z0-9_./@:+-]+", value, re.ASCII):
        raise BadValue(f"malformed value {show(value)}", allowed)
    if any(part in (".", "..") for part in value.split("/")):
        raise BadValue(f"{show(value)}: path traversal ('.' or '..' components)", allowed)
    return value  # which form fits rollout_snapshot is a cross-key check (settings.py)


#: the {fields} rollout_snapshot_command may use (deploys/upgrade.py fills them in)
SNAPSHOT_FIELDS = ("host", "address", "tier", "snapshot", "id", "from_version", "to_version")
_SNAPSHOT_COMMAND_ALLOWED = ("argv list run on the controller without a shell; {" + "} {".join(SNAPSHOT_FIELDS)
                             + "} are filled in")


def _check_argv_word(item: Any) -> str:
    allowed = _SNAPSHOT_COMMAND_ALLOWED
    _string(item, allowed)
    if not item:
        raise BadValue("an empty argument", allowed)
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(item) if field is not None]
    except ValueError as exc:
        raise BadValue(f"{show(item)}: {exc}", allowed) from None
    for field in fields:
        if field not in SNAPSHOT_FIELDS:
            raise BadValue(f"{show(item)}: unknown field {{{field}}}", allowed)
    return item


_SCRATCH_DEVICES_ALLOWED = ("auto (every blank local NVMe disk), or a list of whole drives such as "
                            "[/dev/nvme1n1, /dev/nvme2n1] (/dev/nvme<c>n<n>, /dev/sd<x>, /dev/vd<x>, "
                            "/dev/xvd<x>, /dev/loop<n>), each blank")
_DRIVE = re.compile(r"/dev/(nvme\d+n\d+|sd[a-z]{1,3}|vd[a-z]{1,3}|xvd[a-z]{1,3}|loop\d+)", re.ASCII)


def _check_scratch_devices(value: Any) -> Any:
    if value == AUTO:
        return value
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise BadValue(f"expected auto or a non-empty list, got {_type_name(value)} {show(value)}",
                       _SCRATCH_DEVICES_ALLOWED)
    out: list[str] = []
    for item in value:
        _string(item, _SCRATCH_DEVICES_ALLOWED)
        if not _DRIVE.fullmatch(item):
            raise BadValue(f"{show(item)} is not a whole drive's device path", _SCRATCH_DEVICES_ALLOWED)
        if item in out:
            raise BadValue(f"{show(item)} is listed twice", _SCRATCH_DEVICES_ALLOWED + ", each once")
        out.append(item)
    return tuple(out)


_SCRATCH_PATH_ALLOWED = ("an absolute path for the mount point outside the system's trees (not /, /bin, /boot, "
                         "/dev, /etc, /home or a user's home, /lib*, /proc, /root, /run, /sbin, /snap, /sys, /tmp, "
                         "/usr, /var or anything below them, nor /mnt, /media, /opt, /srv themselves; "
                         "A-Z a-z 0-9 . _ + @ - and /, no ..), such as /scratch, /mnt/nvme or /data")
#: the system's trees: a scratch mounted at or below one hides what the system or a user keeps
#: there (/var/lib/docker, /home/<user>, /var/tmp, /root ...)
_SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/home", "/proc", "/root", "/run", "/sbin", "/snap",
                 "/sys", "/tmp", "/usr", "/var", "/lost+found")
#: directories that hold other mounts or software: not a mount point themselves, a folder in them is
_SYSTEM_DIRS = ("/", "/mnt", "/media", "/opt", "/srv")


def _check_scratch_path(value: Any) -> str:
    _check_abs_path(value, _SCRATCH_PATH_ALLOWED)
    path = "/" + "/".join(part for part in value.split("/") if part)
    top = path.split("/")[1] if path != "/" else ""
    if path in _SYSTEM_DIRS or any(path == tree or path.startswith(tree + "/") for tree in _SYSTEM_TREES) \
            or re.fullmatch(r"lib(?:32|64|x32|exec)?", top):  # /lib, /lib32, /lib64, /libx32
        raise BadValue(f"{show(value)} is a system directory", _SCRATCH_PATH_ALLOWED)
    return value


_SHM_ALLOWED = "unmanaged, a size from 64m to 16t such as 64g, or a share of RAM from 1% to 100% such as 50%"


def _check_shm_size(value: Any) -> str:
    _string(value, _SHM_ALLOWED)
    if value == "unmanaged":
        return value
    percent = re.fullmatch(r"([0-9]{1,3})%", value, re.ASCII)
    if percent:
        if not 1 <= int(percent[1]) <= 100:
            raise BadValue(f"{show(value)} out of range", _SHM_ALLOWED)
        return value
    match = re.fullmatch(r"([0-9]{1,19})([kmgtKMGT]?)", value, re.ASCII)
    if not match:
        raise BadValue(f"malformed size {show(value)}", _SHM_ALLOWED)
    size = int(match[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match[2].lower()]
    if not 64 << 20 <= size <= 16 << 40:
        raise BadValue(f"{show(value)} out of range", _SHM_ALLOWED)
    return value


def _check_group_name(value: Any) -> str:
    allowed = "a group name: a-z 0-9 _ -, starting with a letter or _, at most 32 characters (made if missing)"
    _string(value, allowed)
    if not re.fullmatch(r"[a-z_][a-z0-9_-]{0,31}", value, re.ASCII):
        raise BadValue(f"bad group name {show(value)}", allowed)
    return value


def _check_terabytes(value: Any) -> float:
    allowed = "a number of TB (10^12 bytes) from 0 to 10000, such as 30 or 3.84; 0 = not checked"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadValue(f"expected a number, got {_type_name(value)} {show(value)}", allowed)
    if not 0 <= value <= 10000:
        raise BadValue(f"{show(value)} out of range", allowed)
    return value


_SLURM_STATES = ("any", "alloc", "idle", "mixed", "nondrained_idle", "cycle")
_SLURM_STATES_ALLOWED = "a list of any | alloc | idle | mixed | nondrained_idle, and cycle; at least one state"
_TEXTFILE_ALLOWED = "an absolute path such as /var/lib/prometheus/node-exporter"


def _check_slurm_state(item: Any) -> str:
    _string(item, _SLURM_STATES_ALLOWED)
    if item not in _SLURM_STATES:
        raise BadValue(f"{show(item)} is not a Slurm health check node state", _SLURM_STATES_ALLOWED)
    return str(item)


PRESENCE = _enum("required", "absent", "any")
FINGERPRINT = _text(r"[0-9A-F]{40}", "40 upper-case hex digits (OpenPGP fingerprint, no spaces)")

#: Every gpufleet setting, in the order plan views print them: the grammar of each key.
KEYS: Mapping[str, KeySpec] = MappingProxyType(
    {
        "tier": KeySpec(_check_tier, lambda: ", ".join(tier_names())),
        "tier_mismatch": _enum("warn", "fail"),
        "driver_source": _enum("nvidia", "distro"),
        "driver_branch": KeySpec(_check_branch, _branches_allowed),
        "driver_version": KeySpec(_check_driver_version, lambda: "auto | a version listed in compat.yaml"),
        "driver_flavour": _enum("open", "proprietary", "auto"),
        "driver_reboot": _enum("never", "if-idle", "allowed"),
        "driver_repo_url": _url(),
        "driver_persistence": _enum("daemon", "legacy", "off"),
        "driver_hold": _bool(),
        "driver_repo_keyring_url": _url(auto=True),
        "driver_repo_key_fingerprint": _text(r"auto|[0-9A-F]{40}", "auto or a 40-digit upper-case hex OpenPGP fingerprint"),
        "driver_kernel_headers": _enum("require", "skip"),
        "driver_module_signing_key": _signing_key(),
        "driver_reboot_force": _bool(),
        "driver_dcgm": _bool(),
        "driver_upgrade_in_place": _bool(),
        "driver_upgrade_pending": _enum("report", "fail"),
        "cuda_version": KeySpec(_check_cuda, _cuda_allowed),
        "cuda_driver_compat": _enum("toolkit", "minor"),
        "cudnn_version": KeySpec(_check_cudnn, _cudnn_allowed),
        "pytorch_version": KeySpec(_check_pytorch, _pytorch_allowed),
        "pytorch_runtime": _enum("venv", "python", "none"),
        "pytorch_python": KeySpec(_check_interpreter, lambda: _PYTHON_ALLOWED),
        "pytorch_venv_path": KeySpec(_check_venv_path, lambda: _VENV_PATH_ALLOWED),
        "pytorch_index_url": KeySpec(_check_index_url, lambda: _INDEX_ALLOWED),
        "pytorch_wheel_dir": KeySpec(_check_wheel_dir, lambda: _WHEEL_DIR_ALLOWED),
        "clock_policy": KeySpec(_check_clock, lambda: _CLOCK_ALLOWED),
        "gpu_mig": KeySpec(_check_mig, lambda: mig.GRAMMAR),
        "nccl_profile": KeySpec(_check_nccl, _nccl_allowed),
        "docker_source": _enum("docker", "distro"),
        "docker_default_runtime": _enum("nvidia", "runc"),
        "docker_cdi": _bool(),
        "docker_shm_size": _size("bkmgBKMG", 4 << 40, "size from 1 byte to 4t, such as 64m, 1g, 64g"),
        "docker_ulimits": KeySpec(_check_ulimits, lambda: _ULIMITS_ALLOWED),
        "docker_repo_url": _url(),
        "docker_repo_fingerprint": FINGERPRINT,
        "docker_toolkit_repo_url": _url(),
        "docker_toolkit_repo_fingerprint": FINGERPRINT,
        "docker_toolkit_version": _text(r"\d+\.\d+\.\d+(-\d+)?", "a container toolkit package version such as 1.18.0-1"),
        "docker_smoke_image": _text(r"none|[a-z0-9][\w.\-/:@]*", "none, or an image reference such as ubuntu:24.04"),
        "docker_live_restore": _bool(),
        "docker_restart_with_gpu_containers": _enum("never", "live-restore", "always"),
        "docker_registry_mirror": _url(none=True),
        "packages_cache_url": KeySpec(_check_cache_url, lambda: _CACHE_ALLOWED),
        "packages_cache_serve": _bool(),
        "packages_cache_port": _int(1, 65535),
        "packages_cache_upstream_ports": _list(_check_upstream_port, _UPSTREAM_PORTS_ALLOWED),
        "packages_internet": _bool(),
        "tuning_omp_threads": KeySpec(_check_omp, lambda: "auto | integer >= 1"),
        # ">" only as the catch-all of a roundup_power2_divisions list, e.g. [256:1,>:8]
        "tuning_pytorch_alloc_conf": KeySpec(_check_alloc_conf, _alloc_allowed, permits=">"),
        "tuning_nccl_debug_vars": _bool(),
        "tuning_nccl_socket_ifname": _nccl_list(_IFNAME, "auto, or an NCCL interface list: [^][=]name[,name...], "
                                                "names of at most 15 characters A-Z a-z 0-9 _ . -, such as =eth0"),
        "tuning_nccl_ib_hca": _nccl_list(_HCA, "auto, or an NCCL HCA list: [^][=]hca[:port][,hca[:port]...], "
                                         "such as =mlx5_0,mlx5_1"),
        "tuning_cpu_governor": _enum("performance", "schedutil", "ondemand", "unmanaged"),
        "tuning_profiling": _enum("admins", "users"),
        "storage_scratch": _enum("none", "auto"),
        "storage_scratch_devices": KeySpec(_check_scratch_devices, lambda: _SCRATCH_DEVICES_ALLOWED),
        "storage_scratch_path": KeySpec(_check_scratch_path, lambda: _SCRATCH_PATH_ALLOWED),
        "storage_scratch_group": KeySpec(_check_group_name, lambda: "a group name (a-z 0-9 _ -), made if missing"),
        "storage_shm_size": KeySpec(_check_shm_size, lambda: _SHM_ALLOWED, permits=""),
        "hardening_permit_root_login": _enum("no", "prohibit-password"),
        "hardening_password_auth": _bool(),
        "hardening_allow_users": _list(_check_login_name, "list of user names"),
        "hardening_allow_groups": _list(_check_login_name, "list of group names"),
        "hardening_max_auth_tries": _int(1, 10),
        "hardening_login_grace_time": _int(5, 600),
        "hardening_extra_kex": _list(_check_kex, KEX_ALLOWED),
        "hardening_tcp_forwarding": _bool(),
        "hardening_agent_forwarding": _bool(),
        "hardening_x11_forwarding": _bool(),
        "hardening_client_alive_interval": _int(0, 3600),
        "hardening_max_startups": _text(r"[1-9]\d{0,3}:\d{1,3}:[1-9]\d{0,3}", "start:rate:full, such as 10:30:60"),
        "hardening_rsa_host_key_bits": _int(3072, 8192),
        "hardening_moduli_min_bits": _int(2048, 8192),
        "hardening_unattended_upgrades": _bool(),
        "firewall_enabled": _bool(),
        "firewall_open_ports": _list(_check_port, _PORTS_ALLOWED),
        "firewall_trusted_cidrs": _list(_check_trusted_cidr, _TRUSTED_ALLOWED),
        "firewall_cluster_cidrs": _list(_check_cluster_cidr, _CLUSTER_ALLOWED),
        "firewall_revert_after": _int(10, 3600),
        "hardening_sshd_revert_after": _int(10, 3600),
        "monitoring_node_exporter": _bool(),
        "monitoring_node_exporter_port": _int(1, 65535),
        "monitoring_dcgm_exporter": _bool(),
        "monitoring_dcgm_exporter_port": _int(1, 65535),
        "monitoring_dcgm_exporter_version": _text(r"\d+\.\d+\.\d+", "a dcgm-exporter release such as 4.5.0 (any epoch and Debian revision)"),
        "monitoring_scrape_ports": _list(_check_port, _PORTS_ALLOWED),
        "monitoring_listen_address": KeySpec(_check_listen_address, lambda: _LISTEN_ALLOWED),
        "monitoring_allowed_cidrs": _list(_check_cidr, _CIDRS_ALLOWED),
        "health_watch": _bool(),
        "health_interval": _int(10, 86400),
        "health_action": _enum("report-only", "drain-only", "remediate"),
        "health_escalate_count": _int(2, 100),
        "health_escalate_window": _int(60, 30 * 86400),
        "health_escalate_to": _enum("drain", "rma"),
        "health_slurm_check": _bool(),
        "health_slurm_interval": _int(10, 86400),
        "health_slurm_node_states": _list(_check_slurm_state, _SLURM_STATES_ALLOWED),
        "health_slurm_prolog": _bool(),
        "health_dcgm_watches": _bool(),
        "health_textfile_dir": KeySpec(lambda v: _check_abs_path(v, _TEXTFILE_ALLOWED), lambda: _TEXTFILE_ALLOWED),
        "rollout_batch_size": _int(1),
        "rollout_require_idle": _bool(),
        "acceptance_new_host": _bool(),
        "acceptance_rollout": _bool(),
        "acceptance_diag_level": _int(0, 3),
        "acceptance_port": _int(1024, 65535),
        "acceptance_allreduce_mib": _int(1, 65536),
        "acceptance_timeout": _int(10, 3600),
        "rollout_canary_diag_level": _int(0, 3),
        "rollout_lock_wait": _int(0, 86400),
        "rollout_snapshot": _enum("none", "lvm", "btrfs", "zfs", "command"),
        "rollout_snapshot_target": KeySpec(_check_snapshot_target, lambda: _SNAPSHOT_TARGET_ALLOWED),
        "rollout_snapshot_size": _size("KMGTkmgt", 1 << 60, "LVM snapshot size such as 10G"),
        "rollout_snapshot_command": _list(_check_argv_word, _SNAPSHOT_COMMAND_ALLOWED, unique=False),
        "rollout_slurm_node_name": _text(r"|[A-Za-z0-9][A-Za-z0-9._\-]*", "empty (the short host name), or a Slurm node name"),
        "rollout_drain_timeout": _int(0, 7 * 86400),
        "rollout_slurm_reboot": _enum("gpufleet", "slurm"),
        "validate_os_release": KeySpec(_check_os, _os_allowed),
        "validate_gpu_models": _list(_check_gpu_model, "list of nvidia-smi names from compat.yaml"),
        "validate_gpu_count": KeySpec(_check_gpu_count, lambda: f"an integer from 1 to {MAX_GPUS}, or [min, max]"),
        "validate_nvswitch": PRESENCE,
        "validate_nvlink": PRESENCE,
        "validate_rdma": PRESENCE,
        "validate_min_ram_gb": _int(0, 1 << 16),
        "validate_min_nic_gbps": _int(0, 3200),
        "validate_min_nvme_tb": KeySpec(_check_terabytes, lambda: "a number of TB from 0 to 10000; 0 = not checked"),
        "extra_packages": _list(_check_package, PACKAGE_ALLOWED, key=lambda item: item.partition("=")[0]),
    }
)
