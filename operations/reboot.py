"""Reboot a host and wait until it is back, booted for real (not just answering SSH)."""
from __future__ import annotations

import time
import uuid

from pyinfra.api import FunctionCommand, QuoteString, StringCommand, operation

# /run is a tmpfs on every systemd host: a marker written there is gone after a real reboot.
# (Uptime and boot_id do not change when a container reboots; this works for both.)
MARKER = "/run/gpufleet-reboot-marker"


def _wait_for_reboot(state, host, nonce: str, timeout: float, delay: float) -> bool:
    time.sleep(delay)
    host.disconnect()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            ok, out = host.run_shell_command(StringCommand("cat", MARKER, "2>/dev/null", "||", "echo", "gone"))
            lines = [line.line for line in out] if out else []
            if ok and lines and lines[-1].strip() != nonce:
                # booted again: wait for systemd to finish (units that apply settings at boot)
                host.run_shell_command(StringCommand("timeout 120 systemctl is-system-running --wait || true"))
                return True
            host.disconnect()
        time.sleep(1)
    return False


@operation(is_idempotent=False)
def rebooted(reason: str = "", timeout: int = 600, delay: int = 2):
    """Reboot now and wait for the host to come back (checked with a marker in /run).

    + reason: logged in the journal before the reboot
    + timeout: seconds to wait for the host to be back
    + delay: seconds before the first reconnection attempt
    """
    nonce = uuid.uuid4().hex
    yield StringCommand("echo", QuoteString(nonce), ">", MARKER)
    if reason:
        yield StringCommand("logger", "-t", "gpufleet", QuoteString(f"reboot: {reason}"))
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(_wait_for_reboot, (nonce, timeout, delay), {})
