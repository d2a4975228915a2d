"""
nftables operations: write a ruleset checked with ``nft -c``, load it atomically behind a
dead-man switch.

* ``ruleset``: for hosts that cannot load rules: stage the file, ``nft -c -f`` it in a private
  user+network namespace, and only then move it into place.
* ``apply``: on hosts that can load rules, stage the candidate, check it, arm a systemd timer
  that restores the previous gpufleet table in `revert_after` seconds, load it in one
  transaction, prove that a fresh SSH login still works, and only then save it as the boot
  configuration (/etc/nftables.conf, nftables.service enabled), record what is loaded (on
  disk: a converged host is a no-op after a reboot too) and disarm the timer. A failed login
  restores the previous rules and leaves the boot configuration as it was. Hosts that cannot
  load rules (containers without CAP_NET_ADMIN) are told so, and nothing fails.

Only gpufleet's own table (``inet gpufleet``) is ever replaced: Docker's tables, the forward
path and IP forwarding are not touched (no ``flush ruleset``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator
from io import StringIO

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import files

from gpufleet.operations import as_op

from gpufleet.facts.nftables import APPLIED_RECORD, TABLE, NftablesCapability
from gpufleet.config.failures import fail, fail_now
from gpufleet.operations.ssh import fresh_login
from gpufleet.plans.hardening import OPERATOR_NFT_DIR

REVERT_FILE = "/run/gpufleet/nftables.revert"
REVERT_UNIT = "gpufleet-nft-revert"
CANDIDATE = "/var/lib/gpufleet/nftables/candidate.nft"
BOOT_CANDIDATE = "/var/lib/gpufleet/nftables/boot.nft"
# The boot configuration includes this folder first (the hardening plan's): an
# /etc/nftables.conf with the operator's own tables is kept there when gpufleet's replaces it
# (Debian's untouched stock file is not: it holds no table of anyone's, only `flush ruleset`).
OPERATOR_DIR = OPERATOR_NFT_DIR
KEPT = f"{OPERATOR_DIR}/00-before-gpufleet.nft"

# $1 staged file, $2 destination, $3 how to check (direct | namespace)
_CHECK_AND_INSTALL = r"""
set -u
new=$1 dest=$2 how=$3
if [ "$how" = namespace ]; then out=$(unshare -rn nft -c -f "$new" 2>&1); else out=$(nft -c -f "$new" 2>&1); fi
if [ $? -ne 0 ]; then
  rm -f "$new"
  echo "gpufleet: nft -c rejected the new ruleset; $dest is unchanged: $out" >&2
  exit 1
fi
chmod 644 "$new"
mv -f "$new" "$dest"
"""

# Whether the operator's /etc/nftables.conf ($1) is kept in $2 (and so loaded first at every
# boot) when gpufleet's replaces it: theirs, not kept yet, and not Debian's untouched stock file
# (which holds nobody's table, only `flush ruleset`). Shared by the proof and the persist step.
_KEEPS = r"""
keeps() {
  [ -e "$1" ] && ! grep -q '^# Managed by gpufleet' "$1" && [ ! -e "$2" ] || return 1
  stock=$(dpkg-query -W -f='${Conffiles}\n' nftables 2>/dev/null | awk -v f="$1" '$1 == f {print $2}')
  [ "$(md5sum < "$1" | cut -d' ' -f1)" != "$stock" ]
}
"""

# What boots besides gpufleet's table must be what is loaded now, or the login proven now says
# nothing about the next boot: an operator's file in /etc/nftables.d (or the /etc/nftables.conf
# that will be kept there) that was never loaded could shut SSH out at the next reboot. The boot
# configuration is loaded in a throw-away network namespace, and each other table it makes is
# compared with the live one as nft lists them without counters (`-s`). Only a table the boot
# makes needs to match: a live table the boot lacks can only drop more (a packet must pass every
# base chain on its hook), so the proof through it is the stricter one. Nothing else to load at
# boot: nothing to prove. $1 boot candidate, $2 /etc/nftables.conf, $3 where it is kept, $4 the
# operator's folder, $5 gpufleet's table, $6 the probe file to write.
_BOOT_PROOF = r"""
boot_proof() {
  # its own names: the caller's $conf, $boot, $table are other files
  bp_boot=$1 bp_conf=$2 bp_kept=$3 bp_dir=$4 bp_table=$5 bp_probe=$6
  others=$(ls "$bp_dir"/*.nft 2>/dev/null)
  if keeps "$bp_conf" "$bp_kept"; then others="$bp_conf $others"; fi
  [ -n "$others" ] || return 0
  { if keeps "$bp_conf" "$bp_kept"; then printf 'include "%s"\n' "$bp_conf"; fi
    printf 'include "%s"\n' "$bp_boot"; } > "$bp_probe"
  list='nft -f "$1" >/dev/null || exit 1
    nft list tables | while read -r _ family name; do
      [ "$family $name" = "$2" ] && continue
      echo "== $family $name"; nft -s list table "$family" "$name"
    done'
  if ! want=$(unshare -n sh -c "$list" gpufleet-nft-boot "$bp_probe" "$bp_table" 2>&1) &&
     ! want=$(unshare -rn sh -c "$list" gpufleet-nft-boot "$bp_probe" "$bp_table" 2>&1); then
    rm -f "$bp_probe"
    echo "gpufleet: cannot prove what the next boot loads besides gpufleet's table (from: $others):" \
         "loading it in a private network namespace failed: $want; nothing was loaded or written" >&2
    return 1
  fi
  rm -f "$bp_probe"
  bad=
  for t in $(printf '%s\n' "$want" | sed -n 's/^== //p' | tr ' ' ':'); do
    family=${t%%:*} name=${t#*:}
    boots=$(printf '%s\n' "$want" | awk -v h="== $family $name" '$0 == h {on=1; next} /^== / {on=0} on')
    live=$(nft -s list table "$family" "$name" 2>/dev/null)
    [ "$boots" = "$live" ] && continue
    from=$(grep -lE "table[[:space:]]+$family[[:space:]]+$name([[:space:]]|\{|$)" $others 2>/dev/null | tr '\n' ' ' | sed 's/ $//')
    bad="$bad${bad:+; }table $family $name (${from:-from $others}) is $( [ -n "$live" ] && echo "loaded now, but not as it boots" || echo "not loaded now")"
  done
  [ -z "$bad" ] && return 0
  echo "gpufleet: the next boot would load rules no login was ever proven through: $bad." \
       "gpufleet's rules were not loaded and nothing was saved for the boot. Load those rules now" \
       "(nft -f FILE) if they are right, or move the file out of the way, and run again" >&2
  return 1
}
"""

# $1 candidate ruleset, $2 revert file, $3 timer unit, $4 seconds before the automatic revert,
# $5 table, $6 its boot version, $7 the boot configuration, $8 where an operator's one is kept,
# $9 the operator's folder. Checks the candidate and that what boots besides it is loaded now,
# saves gpufleet's live table, arms the revert, loads. Nothing of the boot configuration is
# touched here.
_ARM_AND_LOAD = _KEEPS + _BOOT_PROOF + r"""
set -u
umask 077
conf=$1 revert=$2 unit=$3 after=$4 table=$5 boot=$6
if ! out=$(nft -c -f "$conf" 2>&1); then
  rm -f "$conf" "$boot"
  echo "gpufleet: nft -c rejected the new ruleset; nothing was loaded or written: $out" >&2
  exit 1
fi
boot_proof "$boot" "$7" "$8" "$9" "$table" "$(dirname "$conf")/boot-probe.nft" || { rm -f "$conf" "$boot"; exit 1; }
mkdir -p "$(dirname "$revert")"
{ echo "table $table"; echo "delete table $table"; nft list table $table 2>/dev/null; } > "$revert.new"
mv -f "$revert.new" "$revert"
systemctl stop "$unit.timer" >/dev/null 2>&1
systemctl reset-failed "$unit.timer" "$unit.service" >/dev/null 2>&1
systemd-run --quiet --unit="$unit" --on-active="$after" --timer-property=AccuracySec=1s \
  /usr/sbin/nft -f "$revert" || { echo "gpufleet: could not arm the automatic revert; nothing loaded" >&2; exit 1; }
if ! nft -f "$conf"; then
  systemctl stop "$unit.timer" >/dev/null 2>&1
  echo "gpufleet: nft -f $conf failed; the previous rules are still loaded" >&2
  exit 1
fi
"""

# After a fresh login through the loaded rules: $1 boot version of the ruleset, $2 boot
# configuration, $3 record, $4 unit, $5 table, $6 where an operator's /etc/nftables.conf is
# kept, $7 the loaded candidate. Persists the rules for the next boot (file, nftables.service
# enabled), records what is loaded, and only then disarms the revert. Refuses when the revert
# already ran (confirmed too late).
_PERSIST = _KEEPS + r"""
set -u
umask 077
new=$1 conf=$2 record=$3 unit=$4 table=$5 kept=$6 loaded=$7
if ! systemctl is-active --quiet "$unit.timer"; then
  echo "gpufleet: the automatic revert ran before the login confirmed the rules; nothing persisted" >&2
  exit 1
fi
mkdir -p "$(dirname "$record")"
if [ -e "$conf" ]; then
  if keeps "$conf" "$kept"; then
    mkdir -p -m 755 "$(dirname "$kept")" && cp -p "$conf" "$kept" || exit 1
  fi
  cp -p "$conf" "$conf.gpufleet-prev" || exit 1
fi
if ! out=$(nft -c -f "$new" 2>&1); then
  rm -f "$conf.gpufleet-prev"
  echo "gpufleet: nft -c rejected the boot configuration; $conf is unchanged: $out" >&2
  exit 1
fi
cp "$new" "$conf.gpufleet-new" && chmod 644 "$conf.gpufleet-new" && mv -f "$conf.gpufleet-new" "$conf" || exit 1
if ! systemctl enable --quiet nftables.service; then
  if [ -e "$conf.gpufleet-prev" ]; then mv -f "$conf.gpufleet-prev" "$conf"; else rm -f "$conf"; fi
  echo "gpufleet: could not enable nftables.service; the boot configuration is as it was" >&2
  exit 1
fi
rm -f "$conf.gpufleet-prev"
live=$(nft list table $table) || exit 1
{ echo "file=$(sha256sum < "$conf" | cut -d' ' -f1)"
  echo "live=$(printf '%s\n' "$live" | sha256sum | cut -d' ' -f1)"; } > "$record.new"
mv -f "$record.new" "$record"
systemctl stop "$unit.timer" >/dev/null 2>&1
rm -f "$new" "$loaded"
true
"""

# $1 revert file, $2 unit, $3 candidate, $4 its boot version: revert now and disarm.
_REVERT_NOW = 'nft -f "$1"; rc=$?; systemctl stop "$2.timer" >/dev/null 2>&1; rm -f "$3" "$4"; exit $rc'


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@operation()
def ruleset(dest: str, content: str) -> Generator[StringCommand | FunctionCommand, None, None]:
    """Write `content` to `dest` once ``nft -c -f`` accepts it; unchanged file: nothing to do."""
    if host.get_fact(Sha256File, path=dest) == _sha256(content):
        host.noop(f"{dest} already holds this ruleset")
        return
    state = host.get_fact(NftablesCapability)
    # While planning, nft may not be installed yet (an earlier operation installs it).
    if not state.can_check and (state.nft_installed or host.state.is_executing):
        yield fail(host, "firewall_enabled",
                   f"cannot check the ruleset for {dest}: nft is missing, or this host can neither "
                   "load rules nor create a private namespace (unshare -rn) to check them in; "
                   "nothing was written",
                   "install nftables, or run where the host can load rules (CAP_NET_ADMIN) or unshare -rn; "
                   "or set firewall_enabled: false")
        return
    staged = f"{dest}.gpufleet-new"
    yield from files.put._inner(src=StringIO(content), dest=staged, mode="600")
    yield StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_CHECK_AND_INSTALL), "gpufleet-nft-check",
        QuoteString(staged), QuoteString(dest),
        QuoteString("direct" if state.can_load else "namespace"),
    )


def _confirm_or_revert(state: State, host: Host, boot_conf: str) -> bool:
    error = fresh_login(host)
    if error is None:
        ok, output = as_op.run(host, StringCommand(
            "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_PERSIST), "gpufleet-nft-persist",
            QuoteString(BOOT_CANDIDATE), QuoteString(boot_conf), QuoteString(APPLIED_RECORD),
            QuoteString(REVERT_UNIT), QuoteString(TABLE), QuoteString(KEPT), QuoteString(CANDIDATE),
        ))
        if ok:
            host.log_styled(f"new firewall rules loaded; a fresh SSH login still works; saved to "
                            f"{boot_conf} for the next boot", fg="green")
            return True
        error = "confirmed, but saving the rules for the next boot failed: " + " ".join(output.stderr_lines)
    reverted, _ = as_op.run(host, StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_REVERT_NOW), "gpufleet-nft-revert",
        QuoteString(REVERT_FILE), QuoteString(REVERT_UNIT), QuoteString(CANDIDATE),
        QuoteString(BOOT_CANDIDATE),
    ))
    return fail_now(state, host, "firewall",
                           f"a fresh SSH login failed with the new firewall rules ({error}); "
                           + ("the previous rules were restored" if reverted else
                              "restoring the previous rules over this session failed too: the timer "
                              f"{REVERT_UNIT}.timer restores them automatically")
                           + f"; {boot_conf} and nftables.service were not changed, the next boot loads what it "
                           "did before",
                           "make sure the rules let your SSH login through (the sshd port in use, "
                           "firewall_trusted_cidrs, firewall_open_ports) and run again",
                           )


@operation()
def apply(path: str, content: str, boot_content: str | None = None, revert_after: int = 60
          ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """
    Load `content` atomically behind a revert timer; once a fresh SSH login through it works,
    save `boot_content` (the same table, plus what loads before it at boot; default: `content`)
    as `path`, enable nftables.service, and disarm the timer. A failed login restores the
    previous rules and leaves `path` and the service as they were.
    """
    boot_content = content if boot_content is None else boot_content
    state = host.get_fact(NftablesCapability)
    if not state.can_load:
        message = (
            f"firewall rules written to {path} and checked with nft -c, but NOT loaded: this "
            "host cannot load nftables rules (no CAP_NET_ADMIN, e.g. a container)"
        )
        host.noop(message)
        host.log_styled(message, fg="yellow", log_func=logger.warning)
        return
    if state.converged(_sha256(boot_content)):
        host.noop(f"the ruleset in {path} is loaded and loads at boot")
        return
    yield from files.directory._inner(path=CANDIDATE.rsplit("/", 1)[0], mode="700")
    yield from files.put._inner(src=StringIO(content), dest=CANDIDATE, mode="600")
    yield from files.put._inner(src=StringIO(boot_content), dest=BOOT_CANDIDATE, mode="600")
    yield StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_ARM_AND_LOAD), "gpufleet-nft-load",
        QuoteString(CANDIDATE), QuoteString(REVERT_FILE), QuoteString(REVERT_UNIT),
        QuoteString(f"{int(revert_after)}s"), QuoteString(TABLE), QuoteString(BOOT_CANDIDATE),
        QuoteString(path), QuoteString(KEPT), QuoteString(OPERATOR_DIR),
    )
    yield FunctionCommand(_confirm_or_revert, (path,), {})
