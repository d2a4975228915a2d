"""Operations of the driver deploy: each reads facts, compares, and yields only what is needed.

- ``repo_key``: trust a repository signing key, for one source only, after checking its fingerprint.
- ``archive_components``: enable archive components (contrib, non-free...) on Debian's own entries.
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
from gpufleet.facts.packages import STACK_RECORD, STACK_RECORD_DIR, StackPackages

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
