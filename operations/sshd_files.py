"""
sshd's files to the dev-sec ssh-baseline: modes of its configuration (sshd-04, sshd-05) and
its host key set (sshd-14, sshd-50).

* ``config_modes``: ``/etc/ssh`` and ``sshd_config.d`` root's and 0755, ``sshd_config``, every
  drop-in and the host keys root's and 0600 (only what differs is changed).
* ``host_keys``: an Ed25519 and an RSA host key, the RSA one at least ``min_rsa_bits``. A
  missing key is generated (no client can have pinned it). A too-small RSA key is replaced only
  when that cannot cut gpufleet off: this run's own SSH connection verified the host by its
  Ed25519 key (the one that stays offered besides RSA). Otherwise the host is left as it is and
  every run says why. A replacement is announced in the run's output with the old and new
  fingerprints (clients that pinned the old RSA key will see a changed host key); the old key is
  kept under /var/lib/gpufleet/backup. sshd is reloaded to use the new key and a fresh login
  (as pyinfra makes them) must work, or the old key is put back and the host fails. Runs after
  the drop-in is proven, so a refused configuration leaves the host's keys untouched.
"""

from __future__ import annotations

from collections.abc import Generator

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, Host, QuoteString, State, StringCommand, operation

from gpufleet.config.failures import fail_now
from gpufleet.operations import as_op
from gpufleet.operations.notice import say as _say

from gpufleet.facts.ssh import SshFactError
from gpufleet.facts.sshd_files import (
    HOST_KEY_FILES,
    SSH_DIR,
    SSHD_CONFIG,
    SSHD_DROPIN_DIR,
    SshdFiles,
    SshdFilesData,
    describe_public_key,
)
from gpufleet.operations.ssh import RELOAD_SSHD_SCRIPT, backup_path, fresh_login

RSA_KEY_TYPES = ("ssh-rsa", "rsa-sha2-256", "rsa-sha2-512")

# $1 key file, $2 type, $3 bits, $4 backup path. The previous key pair (if any) is copied to
# the backup first, the new one is made beside the old and moved over it, and its public half
# is printed for the fingerprint.
_KEYGEN_SCRIPT = r"""
set -eu
key=$1 type=$2 bits=$3 prev=$4
umask 077
mkdir -p "$(dirname "$prev")"; chmod 700 "$(dirname "$prev")"
if [ -e "$key" ]; then cp -p "$key" "$prev"; [ ! -e "$key.pub" ] || cp -p "$key.pub" "$prev.pub"; fi
rm -f "$key.gpufleet-new" "$key.gpufleet-new.pub"
if [ "$type" = rsa ]; then
  ssh-keygen -q -t rsa -b "$bits" -N '' -C "root@$(uname -n)" -f "$key.gpufleet-new" </dev/null
else
  ssh-keygen -q -t "$type" -N '' -C "root@$(uname -n)" -f "$key.gpufleet-new" </dev/null
fi
chmod 600 "$key.gpufleet-new"; chmod 644 "$key.gpufleet-new.pub"
mv -f "$key.gpufleet-new.pub" "$key.pub"
mv -f "$key.gpufleet-new" "$key"
echo "::gpufleet-new-key::$(cat "$key.pub")"
"""

# $1 key file, $2 backup path: the previous key pair back in place, sshd reloaded.
_RESTORE_KEY_SCRIPT = r"""
set -eu
cp -p "$2" "$1"; [ ! -e "$2.pub" ] || cp -p "$2.pub" "$1.pub"
sshd -t && if systemctl is-active --quiet ssh.socket; then systemctl try-restart ssh.service; else systemctl reload ssh.service; fi
"""


# Modes --------------------------------------------------------------------------------------

def wanted_mode(path: str) -> int | None:
    if path in (SSH_DIR, SSHD_DROPIN_DIR):
        return 0o755
    if path == SSHD_CONFIG or path.startswith(SSHD_DROPIN_DIR + "/") or path in HOST_KEY_FILES.values():
        return 0o600
    return None


def mode_fixes(data: SshdFilesData) -> dict[str, int]:
    """Path -> wanted mode for every file whose mode or owner (root:root) is not the baseline's."""
    fixes = {}
    for path, info in sorted(data.files.items()):
        want = wanted_mode(path)
        if want is not None and (info.mode != want or info.user != "root" or info.group != "root"):
            fixes[path] = want
    return fixes


@operation()
def config_modes() -> Generator[StringCommand, None, None]:
    """sshd's configuration readable by root only (0600), its folders 0755, all root's."""
    fixes = mode_fixes(host.get_fact(SshdFiles))
    if not fixes:
        host.noop("sshd's configuration files and host keys are root's, 0600 in 0755 folders")
        return
    yield StringCommand("chown", "root:root", *(QuoteString(p) for p in fixes))
    for mode in sorted(set(fixes.values())):
        yield StringCommand("chmod", oct(mode)[2:], *(QuoteString(p) for p, m in fixes.items() if m == mode))


# Host keys ----------------------------------------------------------------------------------

def connection_host_key_type() -> str | None:
    """The host key type this run's SSH connection verified the host with (None: not SSH)."""
    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    key = transport.get_remote_server_key() if transport is not None else None
    return key.get_name() if key is not None else None


def host_key_plan(data: SshdFilesData, min_rsa_bits: int, verified_by: str | None
                  ) -> tuple[list[tuple[str, str, int, str]], list[str]]:
    """([(path, type, bits, why)] keys to generate, [reason] keys left alone), pure."""
    todo, left = [], []
    ed25519 = data.keys.get(HOST_KEY_FILES["ed25519"])
    rsa = data.keys.get(HOST_KEY_FILES["rsa"])
    if ed25519 is None:
        todo.append((HOST_KEY_FILES["ed25519"], "ed25519", 256, "missing"))
    if rsa is None:
        todo.append((HOST_KEY_FILES["rsa"], "rsa", min_rsa_bits, "missing"))
    elif rsa.bits is None:
        left.append(f"the RSA host key's size is unknown (no readable {HOST_KEY_FILES['rsa']}.pub): "
                    "not replaced")
    elif rsa.bits < min_rsa_bits:
        blocker = None
        if verified_by is None:
            blocker = "this run does not connect over SSH, so it cannot tell which host key its clients pinned"
        elif verified_by in RSA_KEY_TYPES:
            blocker = ("this run verified the host by that RSA key (the controller's known_hosts pins "
                       "it): replacing it would cut gpufleet off")
        elif verified_by != "ssh-ed25519":
            blocker = (f"this run verified the host by its {verified_by} key, not by its Ed25519 key, "
                       "so the controller may need the RSA key next (sshd offers only Ed25519 and RSA)")
        elif ed25519 is None:
            blocker = "the host has no Ed25519 key yet for clients to fall back on (run again)"
        if blocker:
            left.append(f"the RSA host key is {rsa.bits} bits, below hardening_rsa_host_key_bits "
                        f"{min_rsa_bits}, and is NOT replaced: {blocker}. Add the host's Ed25519 key to the "
                        "controller's known_hosts (check its fingerprint: ssh-keygen -lf "
                        f"{HOST_KEY_FILES['ed25519']}.pub on the host) and run again, or set "
                        f"hardening_rsa_host_key_bits: {rsa.bits}")
        else:
            todo.append((HOST_KEY_FILES["rsa"], "rsa", min_rsa_bits, f"{rsa.bits} bits, {rsa.fingerprint}"))
    return todo, left


def _generate(state: State, host: Host, todo: list[tuple[str, str, int, str]]) -> bool:
    replaced = []
    for path, key_type, bits, why in todo:
        ok, output = as_op.run(host, StringCommand(
            "sh", "-c", QuoteString(_KEYGEN_SCRIPT), "gpufleet-host-key",
            QuoteString(path), QuoteString(key_type), QuoteString(str(bits)),
            QuoteString(backup_path(path)),
        ))
        lines = [line for line in output.stdout_lines if line.startswith("::gpufleet-new-key::")]
        if not ok or not lines:
            return fail_now(state, host, "hardening", f"generating the {key_type} host key {path} failed: "
                                   + " ".join(output.stderr_lines), "look at ssh-keygen's message above on the "
                                   "host and run again (the previous key is in place)")
        try:
            _type, new_bits, fingerprint = describe_public_key(lines[0].removeprefix("::gpufleet-new-key::"))
        except SshFactError as exc:
            return fail_now(state, host, "hardening", f"the new host key {path} is unreadable: {exc}",
                                   f"check {path} on the host (its previous key is in {backup_path(path)}) and "
                                   "run again")
        if why == "missing":
            logger.warning(f"{host.print_prefix}generated the missing {key_type} host key {path}: "
                           f"{new_bits} bits, {fingerprint}")
        else:
            replaced.append(path)
            logger.warning(
                f"{host.print_prefix}HOST KEY CHANGED: the RSA host key {path} ({why}) was replaced by a "
                f"new one ({new_bits} bits, {fingerprint}) for the dev-sec ssh-baseline (sshd-50). Clients that "
                "pinned the old RSA key will report a changed host identification: check the new "
                "fingerprint, then `ssh-keygen -R HOST` and `ssh-keyscan -t rsa HOST`. Clients using the "
                f"Ed25519 key (this run did) are not affected. The old key is kept in {backup_path(path)}.")
    return _reload_and_prove(state, host, replaced)


def _reload_and_prove(state: State, host: Host, replaced: list[str]) -> bool:
    """sshd reads its host keys at start and reload: reload (restart a running
    socket-activated one; an idle one reads them at the next login), then log in afresh; if
    that fails, put the replaced keys back."""
    reloaded, output = as_op.run(host, StringCommand(
        "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString("sshd -t && " + RELOAD_SSHD_SCRIPT),
        "gpufleet-sshd-reload"))
    error = fresh_login(host) if reloaded else "sshd -t or the reload failed: " + " ".join(output.stderr_lines)
    if error is None:
        host.log_styled("a fresh SSH login with the new host keys works", fg="green")
        return True
    for path in replaced:
        as_op.run(host, StringCommand(
            "PATH=$PATH:/usr/sbin", "sh", "-c", QuoteString(_RESTORE_KEY_SCRIPT), "gpufleet-host-key-restore",
            QuoteString(path), QuoteString(backup_path(path))))
    return fail_now(state, host, "hardening_rsa_host_key_bits",
                           f"gpufleet did not keep the new host keys: a new SSH login failed with them ({error}); "
                           + ("the previous RSA key was put back and sshd reloaded" if replaced
                              else "nothing was replaced"),
                           "set hardening_rsa_host_key_bits to the key's size to leave it alone",
                           )


@operation()
def host_keys(min_rsa_bits: int) -> Generator[FunctionCommand, None, None]:
    """An Ed25519 and an RSA host key, the RSA one at least `min_rsa_bits` (when safe)."""
    todo, left = host_key_plan(host.get_fact(SshdFiles), min_rsa_bits, connection_host_key_type())
    for reason in left:
        _say(reason)
    if not todo:
        host.noop(f"the host has its Ed25519 key and an RSA key of at least {min_rsa_bits} bits"
                  if not left else "no host key to generate")
        return
    yield FunctionCommand(_generate, (todo,), {})

