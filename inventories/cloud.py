"""Example gpufleet inventory (pyinfra 3): run `pyinfra inventories/cloud.py deploys/all.py`.

Every module-level list or (hosts, data) tuple is a pyinfra group; helper variables start with "_"
so pyinfra ignores them. Each host needs a `tier` (see gpufleet/data/tiers.yaml); any other tier key
can be overridden here per group or per host. Precedence: host data > group data > tier defaults.
If a host sits in two groups that set the same key, the later group wins, so overlay groups
(like `canary` below) set only the keys they change.

Hostnames are placeholders under example.internal; addresses come from DNS or ssh_hostname.
"""

# Shared connection settings for every group (pyinfra's own keys; gpufleet ignores them).
_ssh = {"ssh_user": "gpufleet", "_sudo": True}

# --- HGX training pods: 8 x H100/H200/B200 on NVSwitch, InfiniBand between nodes --------------
hgx_ib = (
    [
        "gpu-a01.example.internal",
        "gpu-a02.example.internal",
        "gpu-a03.example.internal",
        # B200 node: same tier, the resolver adds the NVLink Subnet Manager for its 4th-gen NVSwitch
        ("gpu-a04.example.internal", {"validate_min_ram_gb": 2048}),
    ],
    {**_ssh, "tier": "hgx"},
)

# --- HGX pod on a RoCE fabric: only the NCCL profile and its traffic class differ --------------
hgx_roce = (
    ["gpu-b01.example.internal", "gpu-b02.example.internal"],
    {
        **_ssh,
        "tier": "hgx",
        "nccl_profile": "roce",  # RoCE v2; GID picked automatically by NCCL >= 2.21
        "tuning_nccl_socket_ifname": "=eth0",  # this pod bootstraps over eth0, not bond0
    },
)

# --- Rented HGX capacity: Ethernet only, no RDMA ------------------------------------------------
hgx_cloud = (
    ["gpu-c01.example.internal", "gpu-c02.example.internal"],
    # the VPC subnet the nodes train over: torchrun's rendezvous and NCCL's sockets, all TCP
    {**_ssh, "tier": "hgx-cloud", "firewall_cluster_cidrs": ["198.51.100.0/24"]},
)

# --- Canary overlay: first hosts to take the next production branch ----------------------------
# R595 (PB, EOL 2027-03) with the same CUDA 13.0 toolkit; the rest of the fleet stays on R580.
canary = (
    ["gpu-a03.example.internal"],
    {"driver_branch": "595", "driver_reboot": "allowed"},
)

# --- Research group servers: 2-4 x A100 / RTX 6000 ---------------------------------------------
research = (
    [
        "gpu-r01.example.internal",
        "gpu-r02.example.internal",
        # the lab's RTX A6000 box: two cards, and the lab wants boost behaviour, not pinned clocks
        ("gpu-r03.example.internal", {"validate_gpu_count": [2, 2], "clock_policy": "default"}),
    ],
    {**_ssh, "tier": "research", "hardening_allow_users": ["gpufleet", "lab-admin"],
     "firewall_cluster_cidrs": ["203.0.113.0/24"]},  # the lab's RoCE network: multi-node jobs between the boxes
)

# --- Inference: L4 / A10 serving nodes behind a load balancer ----------------------------------
inference = (
    ["inf-01.example.internal", "inf-02.example.internal", "inf-03.example.internal"],
    {**_ssh, "tier": "inference", "tuning_omp_threads": 2, "rollout_batch_size": 1},
)

# --- Render farm ----------------------------------------------------------------------------------
render = (
    ["rnd-01.example.internal", "rnd-02.example.internal"],
    {**_ssh, "tier": "render", "validate_nvlink": "required"},  # scenes share memory over NVLink bridges
)

# --- Developer boxes: Debian's own driver, CUDA only in containers ------------------------------
dev = (
    [
        "dev-01.example.internal",
        # trixie box: Debian 13 ships R550 and CUDA 12.4 instead of R535 / 11.8
        ("dev-02.example.internal", {"validate_os_release": "debian-13"}),
    ],
    {**_ssh, "tier": "dev", "firewall_open_ports": ["22/tcp", "8888/tcp"]},  # Jupyter on the office LAN
)
