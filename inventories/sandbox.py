"""Sandbox inventory: local, disposable test hosts with SIMULATED GPUs, for trying gpufleet
without owning a GPU server.

    sudo tools/sandbox            # brings the hosts up, then runs deploys/all.py against them
    pyinfra inventories/sandbox.py deploys/all.py

The hosts are real Debian systems (systemd-nspawn containers with their own sshd on
127.0.X.Y); their GPUs are the project's GPU simulator, a test double that answers like
`nvidia-smi` on the recorded real hosts. Nothing here reaches a real GPU or a remote machine.
"""
import os

from testing.testhosts import list_hosts

OS_RELEASE = {"bookworm": "debian-12", "trixie": "debian-13"}

# simulated GPUs -> (group, tier, overrides): what tools/sandbox brings up
SANDBOX = {
    "t4": ("dev", "dev", {}),
    "a100x4": ("research", "research", {}),
    # an HGX tier expects 8 GPUs on NVSwitch with RDMA; the sandbox has 2 H200s over NVLink,
    # so the mismatch is reported as a warning instead of refusing the host
    "h200x2": ("hgx", "hgx", {"tier_mismatch": "warn"}),
}

_running = list_hosts(os.environ.get("GPUFLEET_SANDBOX_POOL", "sandbox"))
if not _running:
    raise SystemExit("no sandbox hosts are running: bring them up with `sudo tools/sandbox`")


def _group(gpu: str) -> list:
    _, tier, overrides = SANDBOX[gpu]
    return [
        (h.name, {**h.pyinfra_data(), "tier": tier, "validate_os_release": OS_RELEASE[h.release],
                  **overrides})
        for h in _running
        if h.gpu == gpu
    ]


dev = _group("t4")
research = _group("a100x4")
hgx = _group("h200x2")
