"""Sandbox inventory: local, disposable test hosts with SIMULATED GPUs, for trying gpufleet
without owning a GPU server.

    sudo tools/sandbox            # brings the hosts up, then runs deploys/all.py against them
    pyinfra inventories/sandbox.py deploys/all.py

The hosts are real Debian systems (systemd-nspawn containers with their own sshd on
127.0.X.Y); their GPUs are the project's GPU simulator, a test double that answers like
`nvidia-smi` on the recorded real hosts. Nothing here reaches a real GPU or a remote machine.
"""
from testing.testhosts import list_hosts

# host name suffix -> (tier, simulated GPUs): what tools/sandbox brings up
SANDBOX = {
    "dev": ("dev", "t4"),
    "research": ("research", "a100x4"),
    "hgx": ("hgx", "h200x2"),
}

_running = {h.name: h for h in list_hosts("sandbox")}
if not _running:
    raise SystemExit("no sandbox hosts are running: bring them up with `sudo tools/sandbox`")


def _hosts(role: str) -> list:
    tier, gpu = SANDBOX[role]
    return [
        (name, {**h.pyinfra_data(), "tier": tier, "sandbox_gpu": f"{gpu} (simulated)"})
        for name, h in _running.items()
        if h.gpu == gpu
    ]


dev = _hosts("dev")
research = _hosts("research")
hgx = _hosts("hgx")
