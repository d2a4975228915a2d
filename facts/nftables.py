"""
nftables facts: can this host load rules at all (CAP_NET_ADMIN), can it check a ruleset
in a throw-away namespace instead, and what gpufleet last loaded.

``process()`` is pure and unit-tested (tests/unit/test_facts_ssh.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pyinfra.api import FactBase, QuoteString, StringCommand
from pyinfra.api.exceptions import FactProcessError

CAP_NET_ADMIN = 12  # linux/capability.h

# Where gpufleet records what it loaded and persisted once a fresh SSH login confirmed it:
# `file=<sha256 of the ruleset file>` and `live=<sha256 of nft list table>`. On disk, not
# tmpfs: after a reboot nftables.service loads the same file, the live table hashes the same,
# and a converged host stays a no-op.
APPLIED_RECORD = "/var/lib/gpufleet/nftables.applied"
TABLE = "inet gpufleet"
BOOT_CONF = "/etc/nftables.conf"


@dataclass(frozen=True)
class NftablesState:
    can_load: bool            # CAP_NET_ADMIN in the effective set: rules can really be loaded
    can_check_in_namespace: bool  # `unshare -rn` works: `nft -c` can run in a private namespace
    nft_installed: bool
    table_loaded: bool        # gpufleet's table is in the kernel now
    applied_digest: str | None  # sha256 of the /etc/nftables.conf gpufleet last loaded
    live_digest: str | None = None     # sha256 of `nft list table inet gpufleet` now
    applied_live: str | None = None    # ... when gpufleet confirmed it
    conf_digest: str | None = None     # sha256 of /etc/nftables.conf now
    service_enabled: bool = False      # nftables.service loads it at boot

    def converged(self, digest: str) -> bool:
        """The ruleset with this digest is loaded (as confirmed), persisted and loaded at boot."""
        return (self.table_loaded and self.applied_digest == digest == self.conf_digest
                and self.live_digest is not None and self.live_digest == self.applied_live
                and self.service_enabled)

    @property
    def can_check(self) -> bool:
        return self.nft_installed and (self.can_load or self.can_check_in_namespace)

    def to_json(self) -> dict:
        return asdict(self)


def parse_nftables_state(lines: list[str]) -> NftablesState:
    values: dict[str, str] = {}
    for line in lines:
        key, sep, value = line.strip().partition("=")
        if sep:
            values[key] = value
    if "capeff" not in values:
        raise FactProcessError("no CapEff line in /proc/self/status")
    try:
        capeff = int(values["capeff"], 16)
    except ValueError as error:
        raise FactProcessError(f"bad CapEff value {values['capeff']!r}") from error
    return NftablesState(
        can_load=bool(capeff >> CAP_NET_ADMIN & 1),
        can_check_in_namespace=values.get("userns") == "yes",
        nft_installed=values.get("nft") == "yes",
        table_loaded=values.get("table") == "yes",
        applied_digest=values.get("applied_file") or values.get("applied") or None,
        live_digest=values.get("live") or None,
        applied_live=values.get("applied_live") or None,
        conf_digest=values.get("conf") or None,
        service_enabled=values.get("enabled") == "enabled",
    )


_SCRIPT = r"""
echo "capeff=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
if command -v nft >/dev/null 2>&1; then echo nft=yes; else echo nft=no; fi
if unshare -rn true >/dev/null 2>&1; then echo userns=yes; else echo userns=no; fi
if out=$(nft list table $2 2>/dev/null); then
  echo table=yes; echo "live=$(printf '%s\n' "$out" | sha256sum | cut -d' ' -f1)"
else echo table=no; fi
[ -r "$1" ] && sed -n 's/^\(file\|live\)=/applied_\1=/p' "$1"
[ -r "$3" ] && echo "conf=$(sha256sum < "$3" | cut -d' ' -f1)"
echo "enabled=$(systemctl is-enabled nftables.service 2>/dev/null)"
true
"""


class NftablesCapability(FactBase):
    """
    Whether rules can be loaded here, checked in a private namespace, and what is loaded:

    .. code:: python

        NftablesState(can_load=True, can_check_in_namespace=True, nft_installed=True,
                      table_loaded=True, applied_digest="9f2c...", live_digest="41ab...",
                      applied_live="41ab...", conf_digest="9f2c...", service_enabled=True)
    """

    def command(self) -> StringCommand:
        return StringCommand(
            "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_SCRIPT), "gpufleet-nftables-state",
            QuoteString(APPLIED_RECORD), QuoteString(TABLE), QuoteString(BOOT_CONF),
        )

    def process(self, output: list[str]) -> NftablesState:
        return parse_nftables_state(output)
