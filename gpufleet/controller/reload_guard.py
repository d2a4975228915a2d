"""Every systemd daemon-reload of a run safe for running GPU containers, whoever does it.

A daemon-reload re-applies every unit's device policy. runc (systemd cgroup driver) writes a
container's devices into its scope as `DeviceAllow=/dev/char/MAJ:MIN` and skips a device whose
/dev/char link is missing, which NVIDIA's nodes lack until `nvidia-ctk system
create-dev-char-symlinks` makes them: such a container loses its GPUs at the next reload
("Failed to initialize NVML: Unknown Error", NVIDIA/nvidia-docker#1730). Links made later do not
help it: its scope still does not name them (facts/devchar.py).

gpufleet is not the only one to reload: `systemctl enable` reloads, and so does the postinst of
every package that ships a unit (sysstat, the exporters, DCGM, Fabric Manager, the driver's
persistenced). So before the first command of a run that changes a host (gpufleet/controller/hostlock.py,
with the lock, again after a reboot), the guard makes the reload safe:

1. the /dev/char links of every NVIDIA device node (nvidia-ctk's, or `ln -s` as udev does for
   any other device where the toolkit is not installed);
2. each running container scope (a system scope whose processes live in a mount namespace of
   their own) that sees an NVIDIA device its DeviceAllow does not name gets that device named,
   `systemctl set-property --runtime SCOPE "DeviceAllow=/dev/char/MAJ:MIN rw"`: the device it
   already uses, never another (only through a link that resolves to a node of that number;
   runc's own device program stays attached, so nothing is allowed that runc refused);
3. a scope it could not fix (a link is someone else's, or set-property failed) is left as it is
   (all its devices are named in one call, or none: set-property applies the scope's whole
   policy, so naming some would cut it off the others) and fails the host before any change,
   naming the scope: stop it, then re-run.

gpufleet's own reloads (operations/daemon_reload.py) run the same script in `reload` mode: fix,
then reload, or defer the reload while a scope is still unfixable.
"""
from __future__ import annotations

from typing import Any

from pyinfra.api.command import QuoteString, StringCommand

from gpufleet.facts.devchar import PENDING_MARKER
from gpufleet.printable import printable

# $1: hold | reload; $2: the pending marker. Run as root. Prints `REPAIRED SCOPE MAJ:MIN...` per
# scope it fixed, then (hold) SAFE or UNSAFE and the scopes it could not fix, or (reload)
# RELOADED or PENDING and those scopes.
GUARD_SCRIPT = r"""
mode=$1; marker=$2
majmin() { set -- $(stat $2 -c '%t %T' "$1" 2>/dev/null) && [ $# = 2 ] && echo "$((0x$1)):$((0x$2))"; }   # decimal
nodes() { for d in "$1"/dev/nvidia* "$1"/dev/nvidia-caps/nvidia-cap*; do [ -c "$d" ] && echo "$d"; done; }
linked() { [ "$(majmin "/dev/char/$1" -L)" = "$1" ]; }   # /dev/char/MM resolves to a node of number MM
need_links=0
for d in $(nodes ""); do linked "$(majmin "$d")" || need_links=1; done
if [ "$need_links" = 1 ]; then
  if command -v nvidia-ctk >/dev/null 2>&1; then
    nvidia-ctk system create-dev-char-symlinks --create-all >/dev/null 2>&1 || true
  fi
  mkdir -p /dev/char
  for d in $(nodes ""); do   # where the toolkit is not installed (or left one out): as udev links any device
    mm=$(majmin "$d"); [ -e "/dev/char/$mm" ] || ln -sfn "..${d#/dev}" "/dev/char/$mm"
  done
fi
host_mnt=$(readlink /proc/1/ns/mnt)
unsafe=""; seen=" "
for p in /proc/[0-9]*; do
  # its cgroup (the unified one; on a v1 host name=systemd's): a scope of the system
  # manager's (Docker's docker-ID.scope, Kubernetes' cri-containerd-ID.scope), never a user's
  # (a pure v2 host's one line read without a fork: this runs for every process)
  l=""; IFS= read -r l 2>/dev/null < "$p/cgroup"
  case "$l" in 0::*) cg=${l#0::};; *) cg=$(sed -n 's/^0:://p' "$p/cgroup" 2>/dev/null);; esac
  case "$cg" in ''|/) cg=$(sed -n 's/^[0-9]*:name=systemd://p' "$p/cgroup" 2>/dev/null | head -n 1);; esac
  case "$cg" in /user.slice/*|'') continue;; */*.scope) unit=${cg##*/};; *) continue;; esac
  case "$seen" in *" $unit "*) continue;; esac
  mnt=$(readlink "$p/ns/mnt" 2>/dev/null) || continue
  [ "$mnt" != "$host_mnt" ] || continue
  seen="$seen$unit "
  policy=$(systemctl show -p DevicePolicy --value -- "$unit" 2>/dev/null)
  allow=" $(systemctl show -p DeviceAllow --value -- "$unit" 2>/dev/null | tr '\n' ' ') "
  if [ "$policy" = auto ] && [ "$allow" = "  " ]; then continue; fi
  missing=""
  for d in $(nodes "$p/root"); do
    mm=$(majmin "$d") || continue
    case "$allow" in *" /dev/char/$mm rw"*|*" char-* rw"*|*" char-nvidia"*" rw"*) ;; *) missing="$missing $mm";; esac
  done
  [ -n "$missing" ] || continue
  # all of them in one call, or none: set-property applies the scope's whole device policy at
  # once, as a reload would, so naming only some would cut the container off the others
  ok=1; set --
  for mm in $missing; do linked "$mm" || ok=0; set -- "$@" "DeviceAllow=/dev/char/$mm rw"; done
  if [ "$ok" = 1 ] && systemctl set-property --runtime -- "$unit" "$@" >/dev/null 2>&1; then
    echo "REPAIRED $unit$missing"
  else
    unsafe="$unsafe $unit"
  fi
done
if [ "$mode" = hold ]; then
  if [ -n "$unsafe" ]; then echo "UNSAFE$unsafe"; else echo SAFE; fi
  exit 0
fi
if [ -n "$unsafe" ]; then
  mkdir -p -m 755 /run/gpufleet && t=$(mktemp /run/gpufleet/.reload.XXXXXX) && printf '%s\n' $unsafe > "$t" && mv -f "$t" "$marker"
  echo "PENDING$unsafe"; exit 0
fi
systemctl daemon-reload || exit 1
rm -f "$marker"
echo RELOADED
"""


def guard_command(mode: str) -> StringCommand:
    """The guard, `hold` (make reloads safe, say whether they are) or `reload` (and do one)."""
    assert mode in ("hold", "reload"), mode
    return StringCommand("sh", "-c", QuoteString(GUARD_SCRIPT), "gpufleet-reload-guard", mode,
                         QuoteString(PENDING_MARKER))


def _units(words: list[str]) -> list[str]:
    return sorted({printable(w) for w in words})


def repaired(lines: list[str]) -> dict[str, list[str]]:
    """{scope: [MAJ:MIN...]} the guard named in a scope's DeviceAllow."""
    out: dict[str, list[str]] = {}
    for line in lines:
        words = line.split()
        if words[:1] == ["REPAIRED"] and len(words) > 2:
            out[printable(words[1])] = [printable(w) for w in words[2:]]
    return out


def parse_guard(lines: list[str]) -> tuple[bool, list[str]]:
    """(safe or reloaded, the scopes it could not fix) from the guard's answer (RELOADED,
    PENDING, SAFE or UNSAFE, its last line); ValueError when it said none."""
    for line in reversed(lines):
        words = line.split()
        if words[:1] in (["RELOADED"], ["SAFE"]):
            return True, []
        if words[:1] in (["PENDING"], ["UNSAFE"]):
            return False, _units(words[1:])
    raise ValueError(printable(" ".join(lines)[-300:]) or "no output")


def repaired_text(fixed: dict[str, list[str]]) -> str:
    return "; ".join(f"{unit} ({', '.join(mms)})" for unit, mms in sorted(fixed.items()))


class ReloadUnsafe(OSError):
    """A running container would lose its GPUs at the next daemon-reload and the guard could not
    prevent it (an OSError: pyinfra fails the command and the host with it, nothing changed)."""

    def __init__(self, reason: str, fix: str):
        super().__init__(f"{reason}; {fix}")
        self.reason, self.fix = reason, fix


def hold(host: Any) -> None:
    """Before the first change of a run on `host` (and after each reconnect): make every
    daemon-reload safe for running GPU containers, or raise ReloadUnsafe naming them. Runs as
    root on the run's own SSH connection, as the host lock does (gpufleet/controller/hostlock.py)."""
    from pyinfra import logger

    from gpufleet import pyinfra_private
    from gpufleet.config.hostcontext import host_context

    client = getattr(host.connector, "client", None)
    transport = client.get_transport() if client is not None else None
    context = host_context(host)  # the transport held on this run (a reboot means a new one: held again)
    if transport is None or context.reload_guard_transport is transport:
        return
    context.lock_in_fact += 1   # pyinfra may run a command to set sudo's askpass up: not a change
    try:
        text = pyinfra_private.root_command(host, guard_command("hold"))
    finally:
        context.lock_in_fact -= 1
    channel = transport.open_session()
    try:
        channel.exec_command(text)
        lines = channel.makefile("rb").read().decode("utf-8", "replace").splitlines()
        code = channel.recv_exit_status()
    finally:
        channel.close()
    try:
        safe, units = parse_guard(lines)
    except ValueError as exc:
        raise ReloadUnsafe(f"the systemd reload guard did not answer (exit {code}): {exc}",
                           "check sudo and /proc on the host, then re-run") from None
    fixed = repaired(lines)
    if fixed:
        logger.warning(f"{host.print_prefix}gpufleet: named the GPU devices of running containers in their systemd "
                       f"scopes (started before the /dev/char links existed), so that no daemon-reload of this run "
                       f"cuts them off: {repaired_text(fixed)}")
    if not safe:
        raise ReloadUnsafe(f"{', '.join(units)} would lose its GPU devices at the next systemd daemon-reload "
                           "(package installs and `systemctl enable` do one), and its scope could not be made to "
                           "name them (no /dev/char link to the same device); nothing was changed",
                           "stop that container (or make /dev/char/MAJ:MIN link to its device node), then re-run")
    context.reload_guard_transport = transport
