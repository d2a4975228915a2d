"""The sanctioned driver change: release the holds, install exact versions, hold again."""
from __future__ import annotations

from pyinfra import host
from pyinfra.api import QuoteString, StringCommand, operation

from facts.packages import HeldPackages, PackageVersions

APT_OPTS = ("-y", "-q", "-o", "Dpkg::Options::=--force-confold", "-o", "Dpkg::Use-Pty=0")


@operation()
def packages_at_versions(install: dict[str, str], remove: list[str] | None = None, hold: list[str] | None = None,
                         downgrade: bool = False):
    """Put packages at exact versions the sanctioned way: unhold, `apt-get install pkg=ver`, hold.

    + install: package -> exact Debian version
    + remove: packages to remove in the same apt transaction (e.g. the old pinning package)
    + hold: the packages held afterwards (re-held even when apt fails, so nothing is left loose)
    + downgrade: allow going to older versions (rollback)
    """
    remove = list(remove or [])
    hold = sorted(set(hold or []))
    installed = host.get_fact(PackageVersions, packages=sorted(set(install) | set(remove)))
    todo = {name: ver for name, ver in install.items() if installed.get(name) != ver}
    gone = [name for name in remove if installed.get(name)]
    held = set(host.get_fact(HeldPackages))
    if not todo and not gone:
        missing = sorted(set(hold) - held)
        if missing:
            yield StringCommand("apt-mark", "hold", *(QuoteString(p) for p in missing))
        else:
            host.noop(f"{len(install)} package(s) at their versions already, holds in place")
        return
    release = sorted(held & (set(todo) | set(gone) | set(hold)))
    specs = [f"{name}={ver}" for name, ver in sorted(todo.items())] + [f"{name}-" for name in sorted(gone)]
    opts = list(APT_OPTS) + (["--allow-downgrades"] if downgrade else [])
    install_cmd = StringCommand("DEBIAN_FRONTEND=noninteractive", "apt-get", "install",
                                *(QuoteString(o) for o in opts), *(QuoteString(s) for s in specs))
    rehold = (StringCommand("apt-mark", "hold", *(QuoteString(p) for p in hold)) if hold
              else StringCommand("true"))
    unhold = (StringCommand("apt-mark", "unhold", *(QuoteString(p) for p in release)) if release
              else StringCommand("true"))
    # one command: the holds come back whatever apt does
    yield StringCommand(unhold, "&&", "{", install_cmd, ";", "rc=$?;", rehold, ";", "exit", "$rc;", "}")
