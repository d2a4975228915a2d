"""Sandbox inventory: local, disposable test hosts with SIMULATED GPUs, for trying gpufleet
without owning a GPU server.

    sudo tools/sandbox            # brings the hosts up, then runs deploys/all.py against them
    pyinfra inventories/sandbox.py deploys/all.py

The hosts are real Debian systems (systemd-nspawn containers with their own sshd on
127.0.X.Y); their GPUs are the project's GPU simulator, a test double that answers like
`nvidia-smi` on the recorded real hosts. NVIDIA's repositories are out of reach from here, so
the sandbox serves a signed local stand-in on 127.0.0.1 (testing/aptrepo.py: NVIDIA's package
names and versions, packages that install nothing real) and points the hosts at it, the way an
air-gapped fleet points gpufleet at its mirror. Nothing here reaches a real GPU.
"""
import os

from testing.aptrepo import load
from testing.inventory import environment_data
from testing.testhosts import list_hosts, pool_dir

POOL = os.environ.get("GPUFLEET_SANDBOX_POOL", "sandbox")

# simulated GPUs (without the @driver suffix) -> (tier, overrides)
SANDBOX = {
    # Debian's own driver (tier dev: driver_source distro), installed from the Debian archive
    "t4": ("dev", {}),
    "a100x4": ("research", {}),
    # an HGX tier expects 8 GPUs on NVSwitch with RDMA and a bond0 interface; the sandbox has
    # 2 H200s over NVLink and eth0, so the mismatch is reported instead of refusing the host
    "h200x2": ("hgx", {"tier_mismatch": "warn", "tuning_nccl_socket_ifname": "auto"}),
}

_running = list_hosts(POOL)
_repo = load(pool_dir(POOL) / "aptrepo.json")
if not _running or _repo is None:
    raise SystemExit("the sandbox is not running: bring it up with `sudo tools/sandbox`")


def _group(model: str) -> list:
    tier, overrides = SANDBOX[model]
    return [
        (h.name, {**h.pyinfra_data(), **environment_data(h, tier, _repo), **overrides})
        for h in _running
        if (h.gpu or "").split("@")[0] == model
    ]


dev = _group("t4")
research = _group("a100x4")
hgx = _group("h200x2")
