"""Operations of the driver deploy: each reads facts, compares, and yields only what is needed.

- ``repo_key``: trust a repository signing key, for one source only, after checking its fingerprint.
- ``archive_components``: enable archive components (contrib, non-free...) on Debian's own entries.
- ``packages_at_versions``: the one sanctioned way the driver stack changes: unhold, (lock the
  version with NVIDIA's pinning package), install exact versions, verify, re-hold; as the
  rollout's transient unit (operations/driver_upgrade.py).
- ``refresh_initramfs``: update-initramfs where the host has it (containers often do not).
- ``stack_recorded``: gpufleet's record of the CUDA toolkit / cuDNN releases it installed.
"""
from __future__ import annotations

import re
import shlex
from collections.abc import Generator, Mapping, Sequence

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from gpufleet.facts.driver import DebianArchiveSources
from gpufleet.facts.packages import KeyringFingerprints
from gpufleet.facts.packages import STACK_RECORD, STACK_RECORD_DIR, HeldPackages, PackageVersions, StackPackages
from gpufleet.operations.driver_upgrade import SCRIPT_DIR, package_change_command

# Debian's archive (deb.debian.org/debian, security, mirrors) and Ubuntu's (archive/security.ubuntu.com/ubuntu,
# ports.ubuntu.com/ubuntu-ports, cloud mirrors such as us-east-1.ec2.archive.ubuntu.com/ubuntu); not
# Docker's repository and Launchpad PPAs, whose paths end the same way (download.docker.com/linux/debian,
# ppa.launchpadcontent.net/OWNER/ppa/ubuntu)
_DEBIAN_ARCHIVE = re.compile(
    r"^(?!https?://ppa\.launchpad(content)?\.net/)(https?|file)://[^ ]*/(?<!/linux/)(debian(-security)?|ubuntu(-ports)?)/?$")


def _sh(script: str) -> StringCommand:
    return StringCommand("sh", "-c", shlex.quote(script))


# $1 key URL, $2 keyring path inside a .deb, $3 pinned fingerprint, $4 keyring to install.
# The values are arguments, never shell text: a quote or $(...) in a URL stays a character.
_REPO_KEY_SCRIPT = r"""
set -e; umask 022
url=$1 member=$2 fingerprint=$3 keyring=$4
t=$(mktemp -d); trap 'rm -rf "$t"' EXIT; export GNUPGHOME="$t/gnupg"
mkdir -m 700 "$GNUPGHOME"
/usr/lib/apt/apt-helper download-file "$url" "$t/download" >/dev/null ||
  { printf 'gpufleet: cannot download the repository key from %s\n' "$url" >&2; exit 1; }
case "$url" in
  *.deb) dpkg-deb -x "$t/download" "$t/x"; src="$t/x$member"
         [ -f "$src" ] || { printf 'gpufleet: %s holds no %s\n' "$url" "$member" >&2; exit 1; };;
  *) src="$t/download";;
esac
fprs=$(gpg --batch --with-colons --show-keys "$src" 2>/dev/null \
  | awk -F: '$1=="pub"{p=1;next} $1=="fpr"&&p{print $10;p=0}' | tr '\n' ' ' | sed 's/ $//')
if [ "$fprs" != "$fingerprint" ]; then
  printf 'gpufleet: the key from %s has fingerprint(s) %s, not the pinned %s (driver_repo_key_fingerprint): not trusted\n' \
    "$url" "${fprs:-none}" "$fingerprint" >&2
  exit 1
fi
if grep -q 'BEGIN PGP PUBLIC KEY BLOCK' "$src"; then gpg --batch --yes -o "$t/k.gpg" --dearmor "$src"; else cp "$src" "$t/k.gpg"; fi
install -D -m 644 "$t/k.gpg" "$keyring"
"""


@operation()
def repo_key(url: str, fingerprint: str, keyring: str, member: str | None = None
             ) -> Generator[StringCommand, None, None]:
    """Install the key at ``url`` as ``keyring`` only if its single primary key has ``fingerprint``.

    + url: an armored/binary key, or a .deb holding the keyring (NVIDIA's cuda-keyring)
    + fingerprint: 40 hex digits; anything else at the URL is refused
    + keyring: destination (referenced by the source's signed-by, so trusted for it only)
    + member: path of the keyring inside the .deb (default: ``keyring``)
    """
    if fingerprint in host.get_fact(KeyringFingerprints, path=keyring):
        host.noop(f"{keyring} already holds key {fingerprint}")
        return
    member = member or keyring
    yield StringCommand("sh", "-c", QuoteString(_REPO_KEY_SCRIPT), "gpufleet-repo-key",
                        QuoteString(url), QuoteString(member), QuoteString(fingerprint), QuoteString(keyring))


@operation()
def archive_components(components: Sequence[str]) -> Generator[StringCommand, None, None]:
    """Add ``components`` to every Debian or Ubuntu archive entry (mirrors, security) lacking them.

    + components: e.g. ["contrib", "non-free", "non-free-firmware"] (Debian), ["restricted"] (Ubuntu)
    """
    changes = []
    debian = [e for e in host.get_fact(DebianArchiveSources) if _DEBIAN_ARCHIVE.match(e.uri)]
    for entry in debian:
        missing = [c for c in components if c not in entry.components]
        if missing:
            changes.append((entry, missing))
    if not debian:
        host.noop("no Debian or Ubuntu archive entry found in the apt sources: nothing to extend")
        return
    if not changes:
        host.noop(f"the archive entries already have {' '.join(components)}")
        return
    for entry, missing in changes:
        # append after the last component, before any trailing comment
        expr = rf"{entry.line}s/^\([^#]*[^#[:space:]]\)/\1 {' '.join(missing)}/"
        yield StringCommand("sed", "-i", shlex.quote(expr), shlex.quote(entry.path))


def _version_regex(version: str) -> str:
    """ERE matching a Debian version whose upstream part is ``version`` (any epoch, any revision)."""
    return "^([0-9]+:)?" + re.escape(version).replace("\\-", "-") + "-"


# Arguments: UNHOLD... -- REHOLD... -- PINNING -- (PACKAGE UPSTREAM-VERSION VERSION-ERE)... -- PRESENT...
# Releases UNHOLD, finds the full Debian version of each PACKAGE whose upstream part is the
# wanted one (exit 3, nothing changed, when the sources offer none), installs PINNING first,
# then everything in one apt run, checks each version (exit 4), and holds REHOLD again, also
# when apt failed. Values are arguments, never shell text (package names and versions hold no
# newline: each list is kept one per line).
_PACKAGES_SCRIPT = r"""
set -u
nl='
'
unhold= rehold= pinning= triples= present= comps= loose= s=0
for a in "$@"; do
  if [ "$a" = -- ]; then s=$((s + 1)); continue; fi
  case $s in
    0) unhold="$unhold$a$nl";; 1) rehold="$rehold$a$nl";; 2) pinning=$a;;
    3) triples="$triples$a$nl";; *) present="$present$a$nl";;
  esac
done
set -f; IFS=$nl
held_file=$(mktemp); trap 'rm -f "$held_file"' EXIT
apt() { apt-get -y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@"; }
[ -z "$unhold" ] || apt-mark unhold $unhold >/dev/null
rc=0
(
  export DEBIAN_FRONTEND=noninteractive
  args=
  set -- $triples
  while [ $# -ge 3 ]; do
    pkg=$1 version=$2 re=$3; shift 3
    v=$(apt-cache madison "$pkg" | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep -E -m1 "$re" || true)
    if [ -z "$v" ]; then
      printf 'gpufleet: the package sources offer no %s %s (they offer: %s); nothing was changed
' "$pkg" "$version"         "$(apt-cache madison "$pkg" | awk -F'|' '{print $2}' | tr -d ' ' | tr '
' ' ')" >&2
      exit 3
    fi
    args="$args$pkg=$v$nl"
  done
  # A CUDA toolkit meta package asks for its components with >= only, so apt would bring the
  # newest ones: each component of its closure whose name ends in the toolkit's -X-Y comes at the
  # version the release names (its lower bound), released first and held with the meta package.
  for t in $args; do
    case ${t%%=*} in cuda-toolkit-[0-9]*-[0-9]*) ;; *) continue;; esac
    suffix=${t%%=*}; suffix=-${suffix#cuda-toolkit-}; queue=$t$nl
    while [ -n "$queue" ]; do
      item=${queue%%"$nl"*}; queue=${queue#*"$nl"}
      for dep in $(apt-cache show "$item" 2>/dev/null | sed -n '/^$/q; s/^Depends: //p' | tr ',' '\n' \
                   | sed -n -e "s/^ *\([a-z0-9][a-z0-9.+-]*$suffix\) *(>= *\([^) ]*\)).*/\1 \2/p" \
                            -e "s/^ *\([a-z0-9][a-z0-9.+-]*$suffix\) *$/\1/p"); do
        name=${dep%% *} bound=${dep#* }
        case "$nl$comps$nl$loose" in *"$nl$name="*|*"$nl$name$nl"*) continue;; esac
        if [ "$bound" = "$dep" ]; then   # asked for without a version: held as apt installs it
          loose="$loose$name$nl"; printf '%s %s\n' "$name" "${t%%=*}" >> "$held_file"; continue
        fi
        v=$(apt-cache madison "$name" | awk -F'|' -v b="$bound" '{gsub(/ /,"",$2); u=$2; sub(/^[0-9]+:/,"",u)
              if (u == b) {print $2; exit}; sub(/-[^-]*$/,"",u); if (u == b) {print $2; exit}}')
        if [ -z "$v" ]; then
          printf 'gpufleet: %s needs %s %s, which the package sources do not offer; nothing was changed\n' \
            "$item" "$name" "$bound" >&2
          exit 3
        fi
        comps="$comps$name=$v$nl"; queue="$queue$name=$v$nl"
        printf '%s %s\n' "$name" "${t%%=*}" >> "$held_file"
      done
    done
  done
  for c in $comps $loose; do apt-mark unhold "${c%%=*}" >/dev/null 2>&1 || true; done
  [ -z "$pinning" ] || apt install "$pinning"
  apt install --no-install-recommends --allow-downgrades $args $comps $present
  set -- $triples
  while [ $# -ge 3 ]; do
    pkg=$1 version=$2 re=$3; shift 3
    dpkg-query -W -f='${Version}' "$pkg" | grep -E -q "$re" ||
      { printf 'gpufleet: %s is not at %s after the install
' "$pkg" "$version" >&2; exit 4; }
  done
  for c in $comps; do
    [ "$(dpkg-query -W -f='${Version}' "${c%%=*}" 2>/dev/null)" = "${c#*=}" ] ||
      { printf 'gpufleet: %s is not at %s after the install\n' "${c%%=*}" "${c#*=}" >&2; exit 4; }
  done
) || rc=$?
# a toolkit's components are held with it
while IFS=" " read -r c meta; do
  case "$nl$rehold" in *"$nl$meta$nl"*) rehold="$rehold$c$nl";; esac
done < "$held_file"
for p in $rehold; do
  if dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q ' installed$'; then apt-mark hold "$p" >/dev/null; fi
done
exit $rc
"""
# The file the unit runs: its output to the unit's log (read back on failure), dpkg repaired first.
PACKAGES_UNIT_SCRIPT = r"""#!/bin/sh
# gpufleet: the sanctioned driver stack change of deploys/driver.py (operations/driver.py), run as
# the transient unit gpufleet-package-change.service so that it survives the SSH session.
umask 077
mkdir -p /var/log/gpufleet
exec >>/var/log/gpufleet/package-change.log 2>&1
echo "=== $(date -u +%FT%TZ) packages at versions: $*"
# a change interrupted earlier (unit killed, host rebooted) left dpkg half done: finish it first
DEBIAN_FRONTEND=noninteractive dpkg --configure -a
""" + _PACKAGES_SCRIPT
PACKAGES_SCRIPT_PATH = SCRIPT_DIR + "/packages-at-versions"
# $1 path, $2 text: the script written whole (0700 in a 0700 folder) by a command of the operation,
# with its privileges (sudo), no upload staged in /tmp
_WRITE_SCRIPT = 'umask 077; install -d -m 700 "${1%/*}" && printf %s "$2" > "$1.tmp" && chmod 700 "$1.tmp" && mv -f "$1.tmp" "$1"'


@operation()
def packages_at_versions(
    versions: Mapping[str, str],
    present: Sequence[str] = (),
    pinning: str | None = None,
    hold: bool = True,
    release: Sequence[str] = (),
    require_idle: bool = False,
) -> Generator[StringCommand, None, None]:
    """Bring ``versions`` (package -> upstream version) and ``present`` packages in as one step.

    Held packages among ``release`` (and every package touched) are released first and held
    again afterwards, also when apt fails, so a sanctioned change never leaves the stack unheld.

    + versions: packages that must be at exactly these upstream versions
    + present: packages that must be installed (any version the sources offer)
    + pinning: NVIDIA's version-locking package, installed first (replaces another one)
    + hold: hold everything managed here afterwards
    + release: further held packages that this change may have to move (e.g. an old pinning package)
    + require_idle: refuse (busy: drain.BUSY_EXIT) when GPU work runs, checked in the very command
      that starts the change (packages swapped under a running job break it)

    It runs as a transient systemd unit that survives the SSH session, the way the rollout's does
    (driver_upgrade.package_change_command): an earlier interrupted change is finished first
    (dpkg --configure -a), the result is read back, a failure reported with the log's last lines.
    """
    names = [*versions, *present, *([pinning] if pinning else [])]
    installed = host.get_fact(PackageVersions, packages=names)
    # the same test as the script's: the whole upstream part, so 9.17.0.29 is not 9.17.0.30
    wrong = {p: v for p, v in versions.items() if not re.match(_version_regex(v), installed.get(p) or "")}
    missing = [p for p in [*present, *([pinning] if pinning else [])] if not installed.get(p)]
    if not wrong and not missing:
        host.noop("at the wanted versions already: " + ", ".join(f"{p} {v}" for p, v in versions.items()))
        return
    held = {*host.get_fact(HeldPackages)}
    unhold = sorted(held & ({*names} | set(release)))
    rehold = sorted({*names, *(set(unhold) if hold else ())}) if hold else sorted(unhold)
    triples = [part for pkg, version in versions.items() for part in (pkg, version, _version_regex(version))]
    yield StringCommand("sh", "-c", QuoteString(_WRITE_SCRIPT), "gpufleet-script", QuoteString(PACKAGES_SCRIPT_PATH),
                        QuoteString(PACKAGES_UNIT_SCRIPT))
    yield package_change_command([*unhold, "--", *rehold, "--", pinning or "", "--", *triples, "--", *present],
                                 script=PACKAGES_SCRIPT_PATH, require_idle=require_idle)


@operation()
def refresh_initramfs() -> Generator[StringCommand, None, None]:
    """Rebuild the initramfs so a changed module blacklist applies at boot (skipped where the
    host has no update-initramfs, e.g. containers; dracut hosts use dracut)."""
    yield _sh(
        "if command -v update-initramfs >/dev/null 2>&1; then update-initramfs -u -k all; "
        "elif command -v dracut >/dev/null 2>&1; then dracut --regenerate-all --force; "
        "else echo 'gpufleet: no update-initramfs or dracut on this host: nothing to refresh'; fi"
    )



# $1 folder, $2 file, then one `package release` line per argument: written whole (a temporary
# file renamed), 0600 in a 0700 folder.
_RECORD_SCRIPT = r"""
set -eu
umask 077
dir=$1 file=$2; shift 2
install -d -m 700 "$dir"
tmp=$(mktemp "$file.XXXXXX")
printf '# Managed by gpufleet: the CUDA toolkit and cuDNN releases it installed. Do not edit.\n' > "$tmp"
for line in "$@"; do printf '%s\n' "$line" >> "$tmp"; done
chmod 600 "$tmp"
mv -f "$tmp" "$file"
"""
_RECORD_WORD = re.compile(r"^[a-z0-9][a-z0-9+.\-]* [0-9][A-Za-z0-9.+~]*$")


@operation()
def stack_recorded(versions: Mapping[str, str], packages: Sequence[str]) -> Generator[StringCommand, None, None]:
    """Record that gpufleet installed ``versions`` (package -> upstream release) in its record
    on the host, other packages' entries kept: what later tells a hand change (drift) from an
    inventory change (a pending upgrade). Read with the StackPackages fact of ``packages`` (the
    one the deploy asked already: no remote command of its own on a run that changes nothing).

    + versions: the CUDA toolkit / cuDNN packages just put at these releases
    + packages: the packages the StackPackages fact was asked about
    """
    found = host.get_fact(StackPackages, packages=list(packages))
    wanted = {**found.recorded, **versions}
    if wanted == found.recorded:
        host.noop(f"{STACK_RECORD} records " + (", ".join(f"{p} {v}" for p, v in sorted(versions.items()))
                                                 or "nothing new"))
        return
    lines = [f"{p} {v}" for p, v in sorted(wanted.items())]
    for line in lines:
        if not _RECORD_WORD.match(line):
            raise ValueError(f"not a package and release: {line!r}")
    yield StringCommand("sh", "-c", QuoteString(_RECORD_SCRIPT), "gpufleet-record",
                        QuoteString(STACK_RECORD_DIR), QuoteString(STACK_RECORD), *(QuoteString(x) for x in lines))
