"""
SSH server operations that cannot lock the operator out.

* ``require_authorized_keys``: refuse (fail this host, change nothing) when a user who must
  still log in after passwords are disabled has no authorized key.
* ``sshd_dropin``: install a drop-in, validated with ``sshd -t`` in place (a rejected
  candidate is taken back at once and the previous file restored: sshd reads its
  configuration only at start and reload, so the running daemon never sees it), arm the
  revert timer, reload sshd, log in afresh exactly as pyinfra does (paramiko, same connection
  data), and disarm; if the login fails, restore the previous drop-in, reload, and fail the
  host with a clear message. One operation, so the timer spans this host's own steps only,
  never the rest of the fleet's: should this run never get to the login (killed, network
  gone), the timer puts the previous drop-in back on its own.
* ``settle_pending``: a drop-in an interrupted run left unconfirmed is verified or reverted.
* ``expect_effective``: compare ``sshd -T`` with what the drop-in asks for.
* ``prune_moduli``: drop Diffie-Hellman moduli below a size, only when some are left.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Generator
from io import StringIO
from typing import TYPE_CHECKING, cast

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation
from pyinfra.facts.files import Sha256File
from pyinfra.operations import files

from gpufleet.config.failures import fail, fail_now
from gpufleet.operations import as_op

from gpufleet.facts.ssh import (
    AuthorizedKeys,
    GroupMembers,
    SmallModuli,
    SshdConfig,
    SshdEffectiveConfig,
    SshdPending,
    moduli_awk_small,
)

if TYPE_CHECKING:
    from paramiko import SSHClient as ParamikoClient
    from pyinfra.connectors.ssh import SSHConnector

BACKUP_DIR = "/var/lib/gpufleet/backup"
# The dead-man switch: a transient timer on the host puts the previous drop-in back unless a
# fresh login confirmed the new one; the marker (on disk) names a drop-in still unconfirmed,
# so the next run verifies or reverts what an interrupted run left.
REVERT_UNIT = "gpufleet-sshd-revert"
REVERT_SCRIPT = "/var/lib/gpufleet/sshd-revert.sh"
PENDING = "/var/lib/gpufleet/sshd.pending"

# Run by the timer (and at boot, before sshd, by gpufleet-sshd-revert-at-boot.service) as
# `sh REVERT_SCRIPT dest backup pending` (a file: systemd would expand the $ of an inline
# script). Puts the previous drop-in back (or removes ours), reloads a running sshd.
_REVERT = r"""
set -u
dest=$1 prev=$2 pending=$3
if [ -e "$prev.absent" ]; then rm -f "$dest"; elif [ -e "$prev" ]; then cp -p "$prev" "$dest"; fi
rm -f "$pending"
if systemctl is-active --quiet ssh; then
  sshd -t && if systemctl is-active --quiet ssh.socket; then systemctl try-restart ssh.service; else systemctl reload ssh; fi
fi
"""

# $1 staged candidate, $2 destination, $3 backup path, $4 pending marker, $5 revert script
# file, $6 its text, $7 timer unit, $8 seconds. Keeps a copy of the previous file (or a marker
# that there was none), puts the candidate in place, and lets `sshd -t` judge the whole
# configuration; a rejected candidate is replaced by the previous file at once. An accepted
# one is marked pending and the revert timer armed, before anything reloads sshd.
_INSTALL_SCRIPT = r"""
set -u
umask 077
new=$1 dest=$2 prev=$3 pending=$4 script=$5 revert=$6 unit=$7 after=$8
nobackup() { rm -f "$new"; echo "gpufleet: could not keep a copy of $dest in $prev ($1); nothing was changed" >&2; exit 1; }
mkdir -p "$(dirname "$prev")" || nobackup "no folder for it"
rm -f "$prev" "$prev.absent"
# without the copy neither the revert timer nor a failed check could put the file back
if [ -e "$dest" ]; then cp -p "$dest" "$prev" && cmp -s "$dest" "$prev" || nobackup "the copy failed"
else : > "$prev.absent" || nobackup "the marker could not be written"; fi
chmod 600 "$new"
mv -f "$new" "$dest"
if ! out=$(sshd -t 2>&1); then
  if [ -e "$prev.absent" ]; then rm -f "$dest"; else cp -p "$prev" "$dest"; fi
  echo "gpufleet: sshd -t rejected the new configuration; the previous one is back in place, sshd was not reloaded: $out" >&2
  exit 1
fi
printf '%s\n' "$revert" > "$script.new" && mv -f "$script.new" "$script"
printf '%s\n' "$dest" > "$pending"
systemctl stop "$unit.timer" >/dev/null 2>&1
systemctl reset-failed "$unit.timer" "$unit.service" >/dev/null 2>&1
if ! systemd-run --quiet --unit="$unit" --on-active="$after" --timer-property=AccuracySec=1s \
    /bin/sh "$script" "$dest" "$prev" "$pending"; then
  if [ -e "$prev.absent" ]; then rm -f "$dest"; else cp -p "$prev" "$dest"; fi
  rm -f "$pending"
  echo "gpufleet: could not arm the automatic revert of sshd's configuration; the previous one is back in place" >&2
  exit 1
fi
"""

# $1 destination, $2 backup path, $3 pending marker, $4 timer unit: put the previous drop-in
# back (or remove ours if there was none), check, reload, disarm.
_RESTORE_SCRIPT = r"""
set -u
dest=$1 prev=$2 pending=$3 unit=$4
if [ -e "$prev.absent" ]; then rm -f "$dest"; elif [ -e "$prev" ]; then cp -p "$prev" "$dest"; fi
rm -f "$pending"
systemctl stop "$unit.timer" >/dev/null 2>&1
sshd -t && if systemctl is-active --quiet ssh.socket; then systemctl try-restart ssh.service; else systemctl reload ssh.service; fi
"""

# How new logins get sshd's current configuration, decided on the host at the moment it runs
# (the revert timer may fire long after planning). A plain daemon is reloaded (SIGHUP: sshd
# re-executes itself and binds its ports again). A socket-activated one (ssh.socket active) is
# never sent SIGHUP: the re-executed sshd has lost the listening sockets systemd passed it and
# dies ("fatal: Cannot bind any address", ssh.service failed: seen on Debian 13's 10.0p2);
# instead a running ssh.service is restarted (KillMode=process: only the listener, sessions
# stay; ssh.socket keeps the port open meanwhile, so no connection is refused) and an idle
# one is left to start with the new configuration at the next connection. ssh.service, never
# sshd.service: Ubuntu 24.04 has no sshd.service alias while ssh.socket is in use.
RELOAD_SSHD_SCRIPT = ("if systemctl is-active --quiet ssh.socket; then systemctl try-restart ssh.service; "
                      "else systemctl reload ssh.service; fi")
RELOAD_SSHD = ("sh", "-c", QuoteString(RELOAD_SSHD_SCRIPT))

# $1 pending marker, $2 timer unit: the new configuration is confirmed.
_DISARM = 'systemctl stop "$2.timer" >/dev/null 2>&1; rm -f "$1"'



def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def backup_path(dest: str) -> str:
    return f"{BACKUP_DIR}{dest}.previous"


def connecting_user() -> str | None:
    """The user pyinfra logged in as (not the sudo target)."""
    connector = host.connector
    client: ParamikoClient | None = getattr(connector, "client", None)
    transport = client.get_transport() if client is not None else None
    if transport is not None and transport.get_username():
        return transport.get_username()
    return cast("str | None", host.data.get("ssh_user"))  # HostData.get is not annotated


# ------------------------------------------------------------------------------------------

@operation(is_idempotent=True)
def require_authorized_keys(users: list[str], groups: list[str] | None = None
                            ) -> Generator[FunctionCommand, None, None]:
    """
    Fail this host, before anything is changed, when one of `users` (or a member of one of
    `groups`) has no authorized key: with passwords off, that user could not log in again.
    """
    wanted = list(dict.fromkeys(u for u in users if u))
    for group in groups or []:
        wanted += [u for u in host.get_fact(GroupMembers, group=group) if u not in wanted]
    missing = []
    for user in wanted:
        keys = host.get_fact(AuthorizedKeys, user=user)
        if not keys.exists:
            missing.append(f"{user} (no such user)")
        elif keys.key_count == 0 and not keys.command:
            where = ", ".join(keys.keys_by_file) or "no AuthorizedKeysFile"
            missing.append(f"{user} (no key in {where})")
    if not missing:
        host.noop(f"every user who must still log in has an authorized key: {', '.join(wanted)}")
        return
    yield fail(host, "hardening_password_auth",
               "SSH passwords would be turned off, and these users have no authorized key and would be locked "
               f"out: {'; '.join(missing)}; nothing was changed",
               "add a key for each (or set hardening_password_auth: true) and run again")


@operation()
def sshd_dropin(dest: str, content: str, revert_after: int = 60
                ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """
    Install `content` as the sshd drop-in `dest`, accepted only if ``sshd -t`` accepts the
    whole resulting configuration; otherwise the previous file stays and the host fails.
    An accepted drop-in is marked pending and a timer on the host puts the previous one back
    after `revert_after` seconds; then sshd is told (RELOAD_SSHD_SCRIPT, decided on the host:
    a plain daemon reloaded, a running socket-activated one restarted, never by SIGHUP, with
    ssh.socket and its ports left alone; an idle one reads it at the next connection) and a
    fresh login proves it, which disarms the timer, or the previous drop-in is restored.
    """
    if host.get_fact(Sha256File, path=dest) == _sha256(content):
        host.noop(f"{dest} is already the hardened configuration")
        return
    staged = f"{BACKUP_DIR}/staged-{dest.strip('/').replace('/', '_')}"
    yield from files.directory._inner(path=BACKUP_DIR, mode="700")
    yield from files.put._inner(src=StringIO(content), dest=staged, mode="600")
    yield StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_INSTALL_SCRIPT), "gpufleet-sshd-install",
        QuoteString(staged), QuoteString(dest), QuoteString(backup_path(dest)), QuoteString(PENDING),
        QuoteString(REVERT_SCRIPT), QuoteString(_REVERT), QuoteString(REVERT_UNIT),
        QuoteString(f"{int(revert_after)}s"),
    )
    yield StringCommand(*RELOAD_SSHD)
    yield FunctionCommand(_verify_or_restore, (dest, backup_path(dest)), {})


#: pyinfra connectors (entry-point names) whose commands never pass through an sshd: a change to
#: sshd or the firewall cannot cut gpufleet's own connection there, so there is no login to prove.
NO_SSHD_CONNECTORS = ("local", "docker", "podman", "chroot")


def connector_kind(host: Host) -> str:
    """`@name` of the host's connector, as pyinfra registers it (its `pyinfra.connectors`
    entry points), else the class's module path (a third-party connector)."""
    from gpufleet.pyinfra_private import connector_name

    name = connector_name(host)
    return name if "." in name else "@" + name


def login_proof(host: Host) -> tuple[str, str]:
    """How a fresh login is proven on `host`: ("ssh", "") by logging in afresh as pyinfra's ssh
    connector does (also the hosts @vagrant and @terraform list: they are reached over SSH);
    ("nothing", why) when the connector never goes through sshd (NO_SSHD_CONNECTORS), named;
    ("refused", why) for any other connector (@dockerssh, @podmanssh, a third-party one):
    gpufleet cannot tell which sshd its commands go through, so it proves nothing there and
    says so, never "nothing to prove"."""
    from pyinfra.connectors.ssh import SSHConnector

    if issubclass(host.connector_cls, SSHConnector):
        return "ssh", ""
    kind = connector_kind(host)
    if kind.removeprefix("@") in NO_SSHD_CONNECTORS:
        return "nothing", (f"nothing to prove on {host.name}: the {kind} connector does not go through "
                           "sshd, so no sshd or firewall change can cut this connection")
    return "refused", (f"refused on {host.name}: it is reached through the {kind} connector, and gpufleet "
                       "can prove that a fresh login still works only over SSH (pyinfra's ssh connector, "
                       "also used by @vagrant and @terraform hosts); sshd and firewall changes are kept "
                       "only with that proof. Allowed connector: ssh. Run this deploy over SSH.")


def login_proof_refusal(host: Host) -> str | None:
    """Why sshd and firewall changes are refused on `host` at planning (None: they are not).
    The hardening deploy changes sshd only where a fresh SSH login can prove the change: over
    @local, @docker, @chroot there is nothing to prove for gpufleet's own connection, but
    nothing would prove that the hosts' SSH users can still log in either, so those are
    refused too, by name."""
    how, why = login_proof(host)
    if how == "ssh":
        return None
    if how == "nothing":
        return (f"refused on {host.name}: the {connector_kind(host)} connector does not go through sshd, so "
                "no fresh login can prove that SSH users can still log in after an sshd or firewall change; "
                "gpufleet makes those changes only on hosts it reaches over SSH. Allowed connector: ssh. "
                "Run this deploy over SSH.")
    return why


def fresh_login(host: Host, attempts: int = 5, delay: float = 1.0) -> str | None:
    """
    Open a *new* SSH session exactly as pyinfra does (its paramiko client and this host's
    connection data: user, key, port, paramiko options) and run `true`.
    Returns None on success, else why it failed. Fails safe (login_proof): over a connector
    that never goes through sshd there is nothing to prove, and it is said by name; over any
    other connector that is not SSH the answer is a refusal, never "nothing to prove".
    """
    from pyinfra.connectors.sshuserclient import SSHClient

    how, why = login_proof(host)
    if how == "nothing":
        logger.info(f"{host.print_prefix}{why}")
        return None
    if how == "refused":
        return why
    connector = cast("SSHConnector", host.connector)  # login_proof said "ssh": an SSHConnector (subclass)
    error = "no attempt made"
    for attempt in range(attempts):
        kwargs = connector.make_paramiko_kwargs()
        hostname = kwargs.pop("hostname")
        kwargs.setdefault("timeout", 10)
        kwargs.setdefault("banner_timeout", 10)
        kwargs.setdefault("auth_timeout", 10)
        client = SSHClient()
        try:
            client.connect(hostname, **kwargs)
            _, stdout, _ = client.exec_command("true", timeout=15)
            status = stdout.channel.recv_exit_status()
            if status == 0:
                return None
            error = f"`true` exited with {status}"
        except Exception as exc:  # noqa: BLE001 - any failure to log in is the answer
            error = f"{type(exc).__name__}: {exc}"
        finally:
            client.close()
        if attempt + 1 < attempts:
            time.sleep(delay)
    return error


def _verify_or_restore(state: State, host: Host, dest: str, backup: str) -> bool:
    error = fresh_login(host)
    if error is None:
        disarmed, _ = as_op.run(host, StringCommand(
            "sh", "-c", QuoteString(_DISARM), "gpufleet-sshd-confirm", QuoteString(PENDING),
            QuoteString(REVERT_UNIT),
        ))
        if disarmed:
            host.log_styled("a fresh SSH login with the new sshd configuration works", fg="green")
            return True
        error = "the login worked, but disarming the automatic revert failed"
    host.log_styled(
        f"a fresh SSH login failed after the sshd reload ({error}); restoring the previous "
        "configuration", fg="red", log_func=logger.error,
    )
    restored, output = as_op.run(host, StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_RESTORE_SCRIPT), "gpufleet-sshd-restore",
        QuoteString(dest), QuoteString(backup), QuoteString(PENDING), QuoteString(REVERT_UNIT),
    ))
    again = fresh_login(host) if restored else "restore command failed"
    return fail_now(state, host, "hardening", (
        f"gpufleet did not keep the hardened sshd configuration: a new SSH login as "
        f"{connecting_user()} failed with it ({error}). "
        + ("The previous configuration was restored and sshd reloaded; new logins work again"
           if again is None else
           f"Restoring the previous configuration did not bring logins back ({again})")
    ), ("" if again is None else f"check {dest} on the console; then ")
        + "adjust the hardening_* settings (e.g. hardening_extra_kex for clients without "
        "post-quantum key exchange, hardening_allow_users) and run again",
    )


@operation()
def settle_pending(dest: str) -> Generator[StringCommand | FunctionCommand, None, None]:
    """A drop-in an interrupted run left unconfirmed (its revert timer may still be armed):
    reload sshd with it and prove a fresh login, else put the previous one back and fail."""
    pending = host.get_fact(SshdPending, path=PENDING)
    if pending is None:
        host.noop("no sshd configuration is waiting for confirmation")
        return
    yield StringCommand("PATH=$PATH:/usr/sbin", "sshd", "-t", "&&", *RELOAD_SSHD)
    yield FunctionCommand(_verify_or_restore, (dest, backup_path(dest)), {})


def effective_differences(config: SshdConfig, expected: dict[str, str | list[str]]) -> list[str]:
    return [f"{key}: sshd -T says {_said(got)}, gpufleet wants {_said(want)}"
            for key, got, want in config.differences(expected)]


def _said(value: object) -> str:
    if isinstance(value, list):  # multi-valued: one sshd -T line per value
        return "[" + ", ".join(repr(v) for v in value) + "]" if value else "none"
    return repr(value)


@operation(is_idempotent=True)
def expect_effective(expected: dict[str, str | list[str]]) -> Generator[FunctionCommand, None, None]:
    """Fail the host when ``sshd -T`` does not report the values the drop-in sets (an earlier
    drop-in or a line before the Include in sshd_config wins over ours)."""
    diffs = effective_differences(host.get_fact(SshdEffectiveConfig), expected)
    if not diffs:
        host.noop(f"sshd -T reports all {len(expected)} hardened settings")
        return
    yield fail(host, "hardening",
               "sshd's effective configuration (sshd -T) is not the hardened one, something read "
               "before gpufleet's drop-in wins: " + "; ".join(diffs),
               "remove or change that setting (a drop-in read before gpufleet's, or a line before the "
               "Include in sshd_config) and run again")


@operation()
def prune_moduli(min_bits: int = 3072, path: str = "/etc/ssh/moduli"
                 ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """Remove Diffie-Hellman moduli smaller than `min_bits` (once; a copy is kept)."""
    moduli = host.get_fact(SmallModuli, min_bits=min_bits, path=path)
    if moduli is None:
        host.noop(f"{path} does not exist")
        return
    if moduli.small == 0:
        host.noop(f"{path} has no moduli below {min_bits} bits")
        return
    if moduli.small == moduli.total:
        yield fail(host, "hardening_moduli_min_bits",
                   f"every modulus in {path} is below {min_bits} bits: refusing to empty it",
                   "regenerate it with ssh-keygen -M generate, or lower hardening_moduli_min_bits")
        return
    yield StringCommand(
        "sh", "-c", QuoteString(
            'set -e; mkdir -p "$(dirname "$3")"; [ -e "$3" ] || cp -p "$1" "$3"; '
            'awk "!($2)" "$1" > "$1.gpufleet-new"; chmod 644 "$1.gpufleet-new"; '
            'mv -f "$1.gpufleet-new" "$1"'
        ), "gpufleet-prune-moduli", QuoteString(path), QuoteString(moduli_awk_small(min_bits)),
        QuoteString(f"{BACKUP_DIR}{path}.original"),
    )
