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

# Where gpufleet records the digest of the ruleset it loaded (tmpfs: gone after a reboot,
# when nftables.service loads /etc/nftables.conf again).
APPLIED_RECORD = "/run/gpufleet/nftables.applied"
TABLE = "inet gpufleet"


@dataclass(frozen=True)
class NftablesState:
    can_load: bool            # CAP_NET_ADMIN in the effective set: rules can really be loaded
    can_check_in_namespace: bool  # `unshare -rn` works: `nft -c` can run in a private namespace
    nft_installed: bool
    table_loaded: bool        # gpufleet's table is in the kernel now
    applied_digest: str | None  # sha256 of the /etc/nftables.conf gpufleet last loaded

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
        applied_digest=values.get("applied") or None,
    )


_SCRIPT = r"""
echo "capeff=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)"
if command -v nft >/dev/null 2>&1; then echo nft=yes; else echo nft=no; fi
if unshare -rn true >/dev/null 2>&1; then echo userns=yes; else echo userns=no; fi
if nft list table $2 >/dev/null 2>&1; then echo table=yes; else echo table=no; fi
[ -r "$1" ] && echo "applied=$(cat "$1")"
true
"""


class NftablesCapability(FactBase):
    """
    Whether rules can be loaded here, checked in a private namespace, and what is loaded:

    .. code:: python

        NftablesState(can_load=False, can_check_in_namespace=True, nft_installed=True,
                      table_loaded=False, applied_digest=None)
    """

    def command(self) -> StringCommand:
        return StringCommand(
            "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_SCRIPT), "gpufleet-nftables-state",
            QuoteString(APPLIED_RECORD), QuoteString(TABLE),
        )

    def process(self, output: list[str]) -> NftablesState:
        return parse_nftables_state(output)
