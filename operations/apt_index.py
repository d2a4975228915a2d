"""Refreshing apt's index for one repository only (the rest of the index is left as it is)."""
from __future__ import annotations

from collections.abc import Generator

from pyinfra.api import QuoteString, StringCommand, operation


@operation(is_idempotent=False)
def index_refreshed(url: str) -> Generator[StringCommand, None, None]:
    """`apt-get update` of the sources that point at `url` (all sources when none does).

    + url: repository base URL, e.g. the driver_repo_url setting
    """
    yield StringCommand(
        "f=$(grep -rlF --", QuoteString(url), "/etc/apt/sources.list.d/ 2>/dev/null | grep '\\.list$' | head -1);",
        'if [ -n "$f" ]; then apt-get update -q -o Dir::Etc::SourceList="$f" -o Dir::Etc::SourceParts=/nonexistent'
        " -o APT::Get::List-Cleanup=0; else apt-get update -q; fi")


@operation(is_idempotent=False)
def lists_refreshed(paths: list[str]) -> Generator[StringCommand, None, None]:
    """`apt-get update` of the sources in the list files `paths` only, in one command.

    A converge that has just written a repository's source reads that repository's index, not
    the whole archive's again (a fresh host's first converge had refreshed everything three
    times: base, driver and Docker; bench/bootstrap.py). The other sources' lists are kept.

    + paths: apt source list files, e.g. /etc/apt/sources.list.d/cuda-debian12-x86_64.list
    """
    yield StringCommand(
        "for f in", *(QuoteString(p) for p in paths), "; do",
        # apt reads a missing list as an empty one and says nothing: the source was just written
        '[ -f "$f" ] || { echo "no source list $f" >&2; exit 1; };',
        'apt-get update -q -o Dir::Etc::SourceList="$f" -o Dir::Etc::SourceParts=/nonexistent'
        " -o APT::Get::List-Cleanup=0 || exit $?; done")


#: where pyinfra's apt.update(cache_time=...) reads when the index was last read (Debian's apt
#: writes no such stamp itself)
UPDATE_STAMP = "/var/lib/apt/periodic/update-success-stamp"


@operation(is_idempotent=False)
def index_read() -> Generator[StringCommand, None, None]:
    """A full `apt-get update`, always, and the stamp the areas' `update=True, cache_time=...`
    installs read: a first converge that has just written every source reads the whole index
    once (deploys/bootstrap.py), and base, driver, monitoring and hardening then find it fresh
    instead of reading it again."""
    yield StringCommand("apt-get update -q && { [ ! -d /var/lib/apt/periodic ] || touch", QuoteString(UPDATE_STAMP), "; }")
