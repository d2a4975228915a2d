"""End-to-end: multi-node training through gpufleet's firewall (issue 30).

Two Debian 12 test hosts of the research tier, each in a network namespace of its own (nftables
really loads), joined by the pool's bridge; the pool's client namespace (10.232.N.1, where
pyinfra runs) is an address outside firewall_cluster_cidrs. The hosts have no GPU: the
hardening step runs as deploys/all.py runs it (tests/e2e/deploys/hardening_all_path.py; all.py's
driver step refuses a host without an NVIDIA GPU), so the firewall is gpufleet's own, research's
ports (SSH only) plus the two hosts as training peers.

Real PyTorch (the CPU build from PyPI, cached once on the machine by testing/torch_cpu.py and
copied into each host, as the probe's CPU mode does) runs `torchrun --nnodes=2` with the c10d
rendezvous on host 0's 29500 and the gloo backend: an all-reduce across the hosts through the
firewall gives the right sum. Gloo and torchrun's worker store connect on ephemeral ports, so
the sum also proves those pass. From the client namespace the same rendezvous (a c10d TCPStore
client to 29500, from the controller's copy of the same torch) and an ephemeral port are refused,
while host 1 reaches both. The second run changes nothing.

On a real fleet the same check with GPUs is nccl-tests' `all_reduce_perf` (docs/security.md, "Multi-node
training through the firewall").
"""
from __future__ import annotations

import concurrent.futures
import shlex
import subprocess
import sys
import time

import pytest

from testing import testhosts, torch_cpu
from testing.inventory import environment_data, write_inventory
from testing.netns import host_tcp_open
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_all_path.py"
RDZV_PORT = 29500
EPHEMERAL_PORT = 41234  # in Linux's ip_local_port_range (32768-60999), listed nowhere
IFACE = testhosts.HOST_IFACE
# Each rank adds [rank + 1, 10 * (rank + 1)]: the sum over two ranks is [3, 30].
ALL_REDUCE = """
import os, socket, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
dist.all_reduce(t)
print(f"rank {rank}/{dist.get_world_size()} on {socket.gethostname()}: sum {t.tolist()}", flush=True)
dist.destroy_process_group()
"""
LISTENER = (
    "import socket\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
    f"s.bind(('0.0.0.0',{EPHEMERAL_PORT})); s.listen(16)\n"
    "while True:\n"
    "    c,_=s.accept(); c.close()\n"
)


def torchrun(host, master, rank: int) -> str:
    """The operator's command on one node: torchrun, c10d rendezvous on the master's 29500.
    The hosts' names resolve nowhere, so each node says its address (--local-addr) and which
    one hosts the rendezvous store (is_host), as on a fleet without DNS for its nodes."""
    return (f"GLOO_SOCKET_IFNAME={IFACE} timeout 120 python3 -m torch.distributed.run --nnodes=2 --nproc-per-node=1 "
            f"--node-rank={rank} --rdzv-backend=c10d --rdzv-endpoint={master.address}:{RDZV_PORT} --rdzv-id=gf-e2e "
            f"--rdzv-conf=is_host={int(host is master)} --local-addr={host.address} /root/all_reduce.py")


def connects(host, address: str, port: int) -> bool:
    """A TCP handshake from inside `host` (its own network namespace) to address:port."""
    code = (f"import socket; s=socket.socket(); s.settimeout(3)\n"
            f"try:\n s.connect(({address!r},{port})); print('open')\nexcept OSError as e:\n print('closed', e)")
    return testhosts.ssh(host, "python3 -c " + shlex.quote(code)).stdout.startswith("open")


def outside_store_refused(host, torch_site) -> str:
    """The same rendezvous from the client namespace: a c10d TCPStore client to host:29500."""
    code = ("import datetime, sys\n"
            f"sys.path.insert(0, {str(torch_site)!r})\n"
            "import torch.distributed as dist\n"
            "try:\n"
            f"    dist.TCPStore({host.address!r}, {RDZV_PORT}, is_master=False, timeout=datetime.timedelta(seconds=5))\n"
            "    print('joined')\n"
            "except Exception as e:\n"
            "    print('refused', type(e).__name__, str(e).splitlines()[0] if str(e) else '')\n")
    out = subprocess.run(["ip", "netns", "exec", host.netns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=90)
    return out.stdout.strip() or out.stderr[-500:]


@pytest.fixture(scope="module")
def pod(hostpool):
    torch_site, why = torch_cpu.site()
    if torch_site is None:
        pytest.fail(f"no PyTorch CPU build: {why}")
    started = time.monotonic()
    hosts = hostpool.get("multinode", 2, private_network=True)
    print(f"\ntwo private-network hosts up in {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda h: torch_cpu.install(h, torch_site), hosts))
    for h in hosts:
        (h.root / "root/all_reduce.py").write_text(ALL_REDUCE)
    print(f"torch copied into both hosts in {time.monotonic() - started:.1f} s")
    return hosts, torch_site


def test_two_node_torchrun_all_reduce_through_the_firewall_and_nothing_from_outside(pod, tmp_path):
    (h0, h1), torch_site = pod
    peers = [f"{h.address}/32" for h in (h0, h1)]
    data = {h.name: {**environment_data(h, "research"), "firewall_cluster_cidrs": peers,
                     # no exporters on these GPU-less hosts: nothing else listens
                     "monitoring_node_exporter": False, "monitoring_dcgm_exporter": False} for h in (h0, h1)}
    inv = write_inventory(tmp_path / "pod.py", [h0, h1], data=data)
    outside = h0.address.rsplit(".", 1)[0] + ".1"  # the client namespace: pyinfra's, not a peer

    started = time.monotonic()
    first = pyinfra(inv, DEPLOY, netns=h0.netns)
    print(f"first hardening run: {time.monotonic() - started:.1f} s")
    assert first.returncode == 0, first.output[-6000:]
    assert "trains across hosts" not in first.output  # training peers set: no warning
    for h in (h0, h1):
        table = testhosts.ssh(h, "nft list table inet gpufleet").stdout
        for peer in peers:
            # nft lists the protocol by number (6: TCP)
            assert f"ip saddr {peer.removesuffix('/32')} meta l4proto 6 accept" in table, table
            assert f"ip saddr {peer.removesuffix('/32')} udp dport 4791 accept" in table, table  # roce profile
        assert f"saddr {outside} " not in table

    # the gate says which networks the host trusts for training (the GPU-less hosts fail its driver
    # checks: only these lines are read)
    started = time.monotonic()
    gate = pyinfra(inv, "deploys/validate.py", "--limit", h0.name, netns=h0.netns)
    print(f"gate: {time.monotonic() - started:.1f} s")
    line = next((ln.strip() for ln in gate.output.splitlines() if "the firewall lets the training peers in" in ln), "")
    assert line.startswith(f"[{h0.name}] [PASS] hardening: the firewall lets the training peers in: "
                           f"{peers[0]}, {peers[1]} (firewall_cluster_cidrs): all TCP (torchrun's rendezvous, 29500 "
                           "by default, and NCCL's ephemeral ports), RoCEv2 (4791/udp)"), gate.output[-6000:]
    assert f"[{h0.name}] [SKIP] tuning: GPUDirect RDMA: nvidia-peermem is loaded, matches the driver and loads at " \
        "boot: no RDMA device on this host" in gate.output, gate.output[-6000:]

    # the operator's command on both nodes at once; the all-reduce crosses the firewall both ways
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda hr: testhosts.ssh(hr[0], torchrun(hr[0], h0, hr[1]), check=False, timeout=150),
                             [(h0, 0), (h1, 1)]))
    print(f"2-node torchrun all-reduce: {time.monotonic() - started:.1f} s")
    for h, rank, run in zip((h0, h1), (0, 1), runs):
        assert run.returncode == 0, f"{h.name}: {run.stdout[-3000:]}{run.stderr[-3000:]}"
        assert f"rank {rank}/2 on " in run.stdout and "sum [3.0, 30.0]" in run.stdout, run.stdout + run.stderr

    # from outside firewall_cluster_cidrs: the rendezvous of a waiting node, and an ephemeral port
    testhosts.ssh(h0, "systemd-run --unit=gf-rdzv-wait --setenv=GLOO_SOCKET_IFNAME=" + IFACE + " "
                      + torchrun(h0, h0, 0).partition(" ")[2])  # rank 0 alone: waits for its peer on 29500
    testhosts.ssh(h0, "systemd-run --unit=gf-ephemeral /usr/bin/python3 -c " + shlex.quote(LISTENER))
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while not connects(h1, h0.address, RDZV_PORT):
            assert time.monotonic() < deadline, testhosts.ssh(h0, "journalctl -u gf-rdzv-wait -n 30", check=False).stdout
            time.sleep(0.5)
        assert connects(h1, h0.address, EPHEMERAL_PORT), "a training peer cannot reach an ephemeral port"
        assert not host_tcp_open(h0, RDZV_PORT, timeout=3), "the rendezvous port is open to a non-peer"
        assert not host_tcp_open(h0, EPHEMERAL_PORT, timeout=3), "an ephemeral port is open to a non-peer"
        refused = outside_store_refused(h0, torch_site)
        assert refused.startswith("refused"), refused
        assert host_tcp_open(h0, 22)  # SSH stays open to everyone
    finally:
        testhosts.ssh(h0, "systemctl stop gf-rdzv-wait gf-ephemeral; systemctl reset-failed gf-rdzv-wait gf-ephemeral",
                      check=False)

    print(f"refused from outside, open to the peer: {time.monotonic() - started:.1f} s")
    started = time.monotonic()
    second = pyinfra(inv, DEPLOY, netns=h0.netns)
    print(f"second hardening run: {time.monotonic() - started:.1f} s")
    assert second.returncode == 0, second.output[-6000:]
    assert changed_operations(second) == [], second.output[-6000:]
