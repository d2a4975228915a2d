"""
Debian package facts: held packages, and installed versions of a list of
packages in one dpkg-query call. Hosts without dpkg (or apt) give empty
results rather than failing.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pyinfra.api import FactBase
from typing_extensions import override

from ._common import MARK, JsonMixin, begin, checked_lines, fail, split_sections, with_values

# dpkg package names, plus the glob characters dpkg-query -W accepts.
_PACKAGE_PATTERN = re.compile(r"^[a-z0-9][a-z0-9+.\-*?\[\]]*$")
# A plain package name, as apt-cache is asked about (no globs, no :arch).
_PLAIN_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.\-]*$")
_PACKAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9+.\-]*(?::[a-z0-9]+)?$")

# The format every dpkg-query call in the gpufleet facts uses:
#   "libnccl2 2.27.3-1+cuda13.0 hi "  (name, version, want/status/error flags)
# Not-installed packages known to dpkg print an empty version: "foo  un ".
DPKG_FORMAT = r"${Package} ${Version} ${db:Status-Abbrev}\n"


@dataclass(frozen=True)
class DpkgEntry(JsonMixin):
    name: str
    version: str | None
    status: str  # db:Status-Abbrev without trailing blank: 'ii', 'hi', 'rc', 'un', 'iHR'

    @property
    def installed(self) -> bool:
        # Second letter is the package state: i = installed; W/t = installed but
        # triggers pending (still usable).
        return len(self.status) >= 2 and self.status[1] in "iWt"

    @property
    def held(self) -> bool:
        return self.status.startswith("h")


def quoted_package_names(names: Iterable[str], globs: bool = False) -> str:
    """The names shell-quoted and space-separated, each checked first (ValueError naming the first
    that is not a plain Debian package name, or with ``globs`` a dpkg-query -W pattern)."""
    pattern, what = ((_PACKAGE_PATTERN, "not a Debian package name or pattern") if globs
                     else (_PLAIN_PACKAGE, "not a Debian package name"))
    quoted = []
    for name in names:
        if not pattern.match(name):
            raise ValueError(f"{what}: {name!r}")
        quoted.append(shlex.quote(name))
    return " ".join(quoted)


def dpkg_query_command(patterns: Iterable[str]) -> str:
    """One dpkg-query -W call for the given names/globs, quoted; never fails."""
    return " ".join(["if command -v dpkg-query >/dev/null 2>&1; then dpkg-query -W",
                     "-f=" + shlex.quote(DPKG_FORMAT), quoted_package_names(patterns, globs=True),
                     "2>/dev/null || true; fi"])


def parse_dpkg_query(lines: Iterable[str]) -> dict[str, DpkgEntry]:
    """Parse DPKG_FORMAT lines into entries by package name (first one wins)."""
    entries: dict[str, DpkgEntry] = {}
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        if len(parts) == 3:
            name, version, status = parts
        elif len(parts) == 2:
            (name, status), version = parts, None
        else:
            raise fail("expected 'package version status' from dpkg-query", line)
        if not _PACKAGE_NAME.match(name) or not re.fullmatch(r"[a-zA-Z]{2,3}", status):
            raise fail("unexpected dpkg-query line", line)
        entries.setdefault(name, DpkgEntry(name, version or None, status))
    return entries


class HeldPackages(FactBase[list[str]]):
    """
    Returns the sorted names of packages on hold: dpkg's "hold" selection, which is
    what ``apt-mark showhold`` lists (that is the fallback without dpkg-query; it loads
    apt's whole cache, 40 ms against 5 ms on a test host):

    .. code:: python

        ["libcudnn9-cuda-13", "libnccl-dev", "libnccl2"]
    """

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def command(self) -> str:
        # Both branches print bare package names, one per line.
        return (
            "if command -v dpkg-query >/dev/null 2>&1; then "
            "dpkg-query -W -f='${db:Status-Want} ${Package}\\n' 2>/dev/null "
            "| sed -n 's/^hold //p'; "
            "elif command -v apt-mark >/dev/null 2>&1; then apt-mark showhold 2>/dev/null; "
            "fi; true"
        )

    @override
    def process(self, output: list[str]) -> list[str]:
        return sorted(set(checked_lines(output, _PACKAGE_NAME, "a package name from the held-package list")))


class PackageVersions(FactBase[dict[str, "str | None"]]):
    """
    Returns the installed version of each requested package (None when not
    installed), from one dpkg-query call; glob patterns add every installed
    match:

    .. code:: python

        host.get_fact(PackageVersions, packages=["libnccl2", "cuda-toolkit-13-0"])
        {"libnccl2": "2.27.3-1+cuda13.0", "cuda-toolkit-13-0": None}
    """

    @override
    @staticmethod
    def default() -> dict[str, str | None]:
        return {}

    @override
    def command(self, packages: Sequence[str]) -> str:
        if isinstance(packages, str):
            packages = [packages]
        query = dpkg_query_command(packages)  # validates the names
        # Echo the requested names first so process() (which is not given the
        # arguments) can report the missing ones as None.
        names = [shlex.quote(p) for p in packages if not set("*?[") & set(p)]
        return "; ".join([" ".join(["echo", shlex.quote(MARK + " want"), *names]), begin("dpkg"), query])

    @override
    def process(self, output: list[str]) -> dict[str, str | None]:
        sections, _ = split_sections(output)
        head = sections.get("", [])
        wanted: list[str] = []
        for line in output:
            if line.startswith(f"{MARK} want"):
                wanted = line[len(f"{MARK} want") :].split()
        if head:
            raise fail("unexpected output before the dpkg-query section", head[0])
        result: dict[str, str | None] = {name: None for name in wanted}
        for name, entry in parse_dpkg_query(sections.get("dpkg", [])).items():
            if entry.installed:
                result[name] = entry.version
        return result


# Keyring fingerprints (v4: 40 hex digits, v5: 64), as gpg --with-colons prints them.
_FPR = re.compile(r"^(?:[0-9A-F]{40}|[0-9A-F]{64})$")


class KeyringFingerprints(FactBase[list[str]]):
    """
    Fingerprints of the primary keys in an OpenPGP keyring file (binary or armored); [] when the
    file or gpg is missing:

    .. code:: python

        host.get_fact(KeyringFingerprints, path="/usr/share/keyrings/cuda-archive-keyring.gpg")
        ["EB693B3035CD5710E231E123A4B469963BF863CC"]
    """

    @override
    @staticmethod
    def default() -> list[str]:
        return []

    @override
    def command(self, path: str) -> str:
        return with_values(
            'if [ -f "$path" ] && command -v gpg >/dev/null 2>&1; then '
            'h=$(mktemp -d); GNUPGHOME="$h" gpg --batch --with-colons --show-keys '
            '"$path" 2>/dev/null | awk -F: \'$1=="pub"{p=1;next} $1=="fpr"&&p{print $10;p=0}\'; '
            'rm -rf "$h"; fi; true', path=path)

    @override
    def process(self, output: list[str]) -> list[str]:
        return checked_lines(output, _FPR, "a 40- or 64-digit fingerprint from gpg --show-keys")


class AptCandidates(FactBase[dict[str, "str | None"]]):
    """
    apt's candidate version of each package from the current package index (None: apt knows
    no installable version):

    .. code:: python

        host.get_fact(AptCandidates, packages=["linux-headers-6.1.0-26-amd64"])
        {"linux-headers-6.1.0-26-amd64": "6.1.112-1"}
    """

    @override
    @staticmethod
    def default() -> dict[str, str | None]:
        return {}

    @override
    def command(self, packages: Sequence[str]) -> str:
        return " ".join(["set --", quoted_package_names(packages) + ";",  # checked and quoted
                         'for p in "$@"; do '
                         'c=$(LC_ALL=C apt-cache policy "$p" 2>/dev/null | sed -n "s/^ *Candidate: //p"); '
                         'echo "$p ${c:-(none)}"; done'])

    @override
    def process(self, output: list[str]) -> dict[str, str | None]:
        result: dict[str, str | None] = {}
        for line in output:
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2:
                raise fail("expected 'package candidate'", line)
            result[parts[0]] = None if parts[1] == "(none)" else parts[1]
        return result


#: gpufleet's record of the CUDA toolkit and cuDNN releases it installed (0600 in a 0700 folder,
#: root's): what tells an inventory change (pending) from a package changed by hand (drift).
STACK_RECORD_DIR = "/var/lib/gpufleet/installed"
STACK_RECORD = STACK_RECORD_DIR + "/stack"
_RECORD_LINE = re.compile(r"^([a-z0-9][a-z0-9+.\-]*) ([0-9][A-Za-z0-9.+~]*)$")


@dataclass(frozen=True)
class StackPackagesData(JsonMixin):
    installed: dict  # package -> installed Debian version, None when not installed
    recorded: dict   # package -> the upstream release gpufleet installed it at (its record)
    record_found: bool = False
    # The installed components of each requested cuda-toolkit-X-Y: its dpkg Depends closure of
    # packages named *-X-Y, component -> [installed Debian version, the version the toolkit
    # release asks for (its >= lower bound; None when asked for without one), held (true/false)]
    components: dict = dataclasses.field(default_factory=dict)


# The names a toolkit's -X-Y components start with (apt's install list of cuda-toolkit-12-8:
# cuda-nvcc-12-8, libcublas-12-8, libnpp-12-8, gds-tools-12-8 ..., NVIDIA/nvidia-container-toolkit#883)
COMPONENT_PREFIXES = ("cuda-", "lib", "gds-")
TOOLKIT = re.compile(r"^cuda-toolkit-(\d+-\d+)$")
# Nsight Systems / Compute as NVIDIA's CUDA repository names them: one package per tool release
# (nsight-systems-2025.3.2), several side by side, behind the CUDA minor's cuda-nsight-systems-X-Y /
# cuda-nsight-compute-X-Y, which cuda-visual-tools-X-Y (cuda-tools-X-Y, cuda-toolkit-X-Y) depends on
# (compat.yaml nsight_tools): reached from a toolkit, they are its components though their name
# does not end in its -X-Y, so they are pinned, held and moved with it like the others
NSIGHT_RELEASE = re.compile(r"^nsight-(?:systems|compute)-\d{4}\.\d+\.\d+$")
NSIGHT_GLOBS = ("nsight-systems-20*", "nsight-compute-20*")


def component_globs(suffixes: Iterable[str], prefixes: Iterable[str] = COMPONENT_PREFIXES) -> list[str]:
    """dpkg-query globs for the -X-Y components of the toolkits with these suffixes ("13-0")."""
    wanted = tuple(prefixes)
    return [f"{prefix}*-{suffix}" for suffix in suffixes for prefix in wanted]


_DEPENDS_ITEM = re.compile(r"^([a-z0-9][a-z0-9+.\-]*)(?::[a-z0-9]+)?\s*(?:\(\s*(<<|<=|=|>=|>>)\s*([^)\s]+)\s*\))?$")


def toolkit_closure(meta: str, depends_of: Callable[[str, str | None], str]) -> dict[str, str | None]:
    """The components of CUDA toolkit meta package ``meta`` (cuda-toolkit-X-Y): every package
    reached through Depends whose name ends in its -X-Y, asked for with >= or with no version
    (alternatives are not followed), with that lower bound (None: asked for without one), in
    the order the walk meets them. ``depends_of(name, bound)``: the Depends of the package version
    the caller has in mind (the installed one, or the one offered for that bound; ``meta``'s own is
    asked with bound None)."""
    match = TOOLKIT.match(meta)
    if not match:
        return {}
    suffix = "-" + match.group(1)
    out: dict[str, str | None] = {}
    queue = [meta]
    while queue:
        name = queue.pop(0)
        for item in (part.strip() for part in depends_of(name, out.get(name)).split(",")):
            dep = _DEPENDS_ITEM.match(item)
            if (not dep or not (dep.group(1).endswith(suffix) or NSIGHT_RELEASE.match(dep.group(1)))
                    or dep.group(2) not in (None, ">=")
                    or dep.group(1) in out or dep.group(1) == meta):
                continue
            out[dep.group(1)] = dep.group(3)
            queue.append(dep.group(1))
    return out


def toolkit_components(entries: dict[str, tuple[str, str, str]], metas: Iterable[str]) -> dict[str, list]:
    """The components of each installed toolkit meta package in ``metas`` (``entries``: package ->
    (version, status, Depends) of the installed *-X-Y packages), walked by toolkit_closure, with
    their installed version, the lower bound the release asks for (None: none) and whether they
    are held."""
    out: dict[str, list] = {}
    for meta in metas:
        if not TOOLKIT.match(meta) or meta not in entries:
            continue
        for name, bound in toolkit_closure(meta, lambda n, _: entries.get(n, ("", "", ""))[2]).items():
            if name not in out:
                version, status, _ = entries.get(name, ("", "", ""))
                out[name] = [version or None, bound, status.startswith("h")]
    return out


#: StackPackages' format for the components of a toolkit: package, version, status, Depends
COMPONENTS_FORMAT = r"${Package}\t${Version}\t${db:Status-Abbrev}\t${Depends}\n"


def stack_component_patterns(packages: Sequence[str]) -> list[str]:
    """The dpkg-query patterns StackPackages asks with its packages' Depends: the -X-Y components
    of every toolkit meta package among ``packages`` and the Nsight releases ([]: no toolkit)."""
    suffixes = sorted({m.group(1) for m in map(TOOLKIT.match, packages) if m})
    return [*component_globs(suffixes), *NSIGHT_GLOBS] if suffixes else []


class StackPackages(FactBase[StackPackagesData]):
    """
    The installed versions of the CUDA toolkit and cuDNN packages (one dpkg-query call, as
    PackageVersions) and, in the same command, gpufleet's record of the releases it installed
    them at (STACK_RECORD, lines ``package release``):

    .. code:: python

        host.get_fact(StackPackages, packages=["libcudnn9-cuda-13"])
        StackPackagesData(installed={"libcudnn9-cuda-13": "9.16.0.29-1"},
                          recorded={"libcudnn9-cuda-13": "9.17.0.29"}, record_found=True)
    """

    @override
    @staticmethod
    def default() -> StackPackagesData:
        return StackPackagesData({}, {})

    @override
    def command(self, packages: Sequence[str]) -> str:
        parts = [PackageVersions().command(packages), begin("record"),
                 with_values('cat "$record" 2>/dev/null || true', record=STACK_RECORD)]
        components = stack_component_patterns(packages)
        if components:
            # the installed packages of each toolkit's -X-Y with their Depends: process() walks them
            parts += [begin("components"), " ".join([
                "if command -v dpkg-query >/dev/null 2>&1; then dpkg-query -W",
                "-f=" + shlex.quote(COMPONENTS_FORMAT), quoted_package_names(components, globs=True),
                "2>/dev/null || true; fi"])]
        return "; ".join(parts)

    @override
    def process(self, output: list[str]) -> StackPackagesData:
        at = next((i for i, line in enumerate(output) if line.strip() == f"{MARK} begin record"), len(output))
        end = next((i for i, line in enumerate(output) if line.strip() == f"{MARK} begin components"), len(output))
        entries: dict[str, tuple[str, str, str]] = {}
        for line in output[end + 1:]:
            fields = line.split("\t") + [""]   # no Depends: the line may end at the status
            if len(fields) not in (4, 5) or not _PACKAGE_NAME.match(fields[0]):
                raise fail("expected 'package<TAB>version<TAB>status<TAB>depends' from dpkg-query", line)
            if len(fields[2].strip()) >= 2 and fields[2].strip()[1] in "iWt":
                entries[fields[0]] = (fields[1], fields[2].strip(), fields[3])
        installed = PackageVersions().process(output[:at])
        recorded, found = {}, at < len(output)
        for line in output[at + 1:end]:
            if not line.strip() or line.startswith("#"):
                continue
            match = _RECORD_LINE.match(line.strip())
            if not match:
                raise fail("expected 'package release' in gpufleet's record " + STACK_RECORD, line)
            recorded[match.group(1)] = match.group(2)
        return StackPackagesData(installed, recorded, found and bool(recorded),
                                 toolkit_components(entries, sorted(entries)))


# $1 a toolkit's -X-Y: every version the package index holds of each package named like a
# toolkit component of that -X-Y (cuda-*, lib*, gds-*), with its Depends (apt-cache show: the
# index as apt reads it, its sources' signatures checked by apt-get update).
_TOOLKIT_INDEX_SCRIPT = r"""
command -v apt-cache >/dev/null 2>&1 || exit 0
apt-cache pkgnames 2>/dev/null | grep -E -e "^(cuda-|lib|gds-)[a-z0-9.+-]*-$1\$" -e "^nsight-(systems|compute)-[0-9]{4}[.][0-9]+[.][0-9]+\$" \
  | xargs -r apt-cache show 2>/dev/null | grep -E -e '^(Package|Version|Depends):' -e '^$' || true
"""
_STANZA_FIELD = re.compile(r"^(Package|Version|Depends): ?(.*)$")
_INDEX_VERSION = re.compile(r"^(\d+:)?[0-9][A-Za-z0-9.+~\-]*$")


class ToolkitIndex(FactBase[dict[str, dict[str, str]]]):
    """
    What the package index offers for the components of a CUDA toolkit's -X-Y: package ->
    {Debian version: its Depends}, for every package named like a component (cuda-*, lib*, gds-*
    ending in -X-Y). The core walks it from the meta package's version
    (gpufleet.plans.package_plan.toolkit_release), with the same walk as the installed toolkit's
    (toolkit_closure):

    .. code:: python

        host.get_fact(ToolkitIndex, package="cuda-toolkit-13-0")
        {"cuda-toolkit-13-0": {"13.0.2-1": "cuda-compiler-13-0 (>= 13.0.2), ..."},
         "cuda-nvcc-13-0": {"13.0.88-1": "cuda-toolkit-13-0-config-common", "13.0.96-1": "..."}}
    """

    # asked only when a toolkit moves: a later run, which mostly changes nothing, must not pay
    # for the package index walk in its prefetch
    gpufleet_no_prefetch = True

    @override
    @staticmethod
    def default() -> dict[str, dict[str, str]]:
        return {}

    @override
    def command(self, package: str) -> str:
        match = TOOLKIT.match(package)
        if not match:
            raise ValueError(f"not a CUDA toolkit meta package: {package!r}")
        return " ".join(["sh -c", shlex.quote(_TOOLKIT_INDEX_SCRIPT), "gpufleet-toolkit-index", match.group(1)])

    @override
    def process(self, output: list[str]) -> dict[str, dict[str, str]]:
        index: dict[str, dict[str, str]] = {}
        stanza: dict[str, str] = {}
        for line in [*output, ""]:
            if not line.strip():
                if stanza:
                    name, version = stanza.get("Package", ""), stanza.get("Version", "")
                    if not _PACKAGE_NAME.match(name) or not _INDEX_VERSION.match(version):
                        raise fail("expected a package stanza with Package and Version from apt-cache show",
                                   repr(stanza))
                    index.setdefault(name, {})[version] = stanza.get("Depends", "")
                stanza = {}
                continue
            field = _STANZA_FIELD.match(line.rstrip())
            if not field:
                raise fail("expected Package, Version or Depends lines from apt-cache show", line)
            stanza[field.group(1)] = field.group(2).strip()
        return index


class AptVersions(FactBase[dict[str, list[str]]]):
    """Versions apt can install, per package, newest first (`apt-cache madison`, no update)."""

    gpufleet_no_prefetch = True  # asked when packages move: not worth a later run's prefetch

    @override
    @staticmethod
    def default() -> dict[str, list[str]]:
        return {}

    @override
    def command(self, packages: Sequence[str]) -> str:
        return " ".join(["apt-cache madison", quoted_package_names(packages), "2>/dev/null || true"])

    @override
    def process(self, output: list[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for line in output:
            parts = [p.strip() for p in line.split("|")]
            if len(parts) < 3:
                continue
            name, version = parts[0], parts[1]
            if version not in found.setdefault(name, []):
                found[name].append(version)
        return found


@dataclass(frozen=True)
class PackageChangeData(JsonMixin):
    running: bool               # gpufleet-package-change.service is still at work
    result: str | None          # its Result= (success, exit-code, signal...), None when never run
    status: int | None          # its main process's exit status
    audit: tuple[str, ...]      # `dpkg --audit` lines: packages an interrupted change left half done


class PackageChange(FactBase[PackageChangeData]):
    """The last driver package change run as a transient unit (operations/driver_upgrade.py) and
    what `dpkg --audit` reports."""

    @override
    def command(self) -> str:
        return ("systemctl show -p LoadState -p SubState -p Result -p ExecMainStatus "
                "gpufleet-package-change.service 2>/dev/null; "
                "dpkg --audit 2>&1 | sed 's/^/audit: /'; true")

    @override
    def process(self, output: list[str]) -> PackageChangeData:
        props, audit = {}, []
        for line in output:
            if line.startswith("audit: "):
                if line[7:].strip():
                    audit.append(line[7:].rstrip())
            elif "=" in line:
                key, _, value = line.strip().partition("=")
                props[key] = value
        loaded = props.get("LoadState") == "loaded"
        status = props.get("ExecMainStatus", "")
        return PackageChangeData(
            running=loaded and props.get("SubState", "") in ("start", "start-pre", "start-post", "running"),
            result=props.get("Result") if loaded else None,
            status=int(status) if loaded and status.isdigit() else None,
            audit=tuple(audit))
