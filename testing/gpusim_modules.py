"""Test helper: make the simulated NVIDIA module fail to load at the next boot, and undo it.

Test infrastructure, not production code. The GPU simulator loads the installed driver's version
at every boot (testing/gpusim/gpusim-load-module, a test double of the kernel loading the module
on disk). With that unit disabled the previous module stays loaded after a reboot, as when a new
module fails to build or load on a real host: validation then sees the old driver.
"""
from __future__ import annotations

UNIT = "gpusim-load-module.service"


def fail_module_load(host, fail: bool = True) -> None:
    """Disable (fail=True) or re-enable the simulator's module loading at boot on a test host."""
    from testing import testhosts

    testhosts.ssh(host, f"systemctl {'disable' if fail else 'enable'} --quiet {UNIT}")
