"""Real Slurm (Debian's slurm-wlm 22.05 on bookworm) on test hosts: slurmctld on one, slurmd on
the others, munge with one shared key. Test infrastructure, not production code.

All test hosts share the machine's network namespace (each on its own loopback address) and
slurmd/slurmctld listen on every address, so each daemon gets its own port, from a block derived
from the controller's address so that clusters (in one pool or several) do not collide. Without cgroups in the containers the
cluster uses proctrack/linuxproc and task/none (plain process tracking: enough for jobs such as
`sbatch --wrap 'sleep 20'`). The Slurm node name of a host is its host name unless `names`
maps it to another one (NodeName=<name> NodeHostname=<host>), as a site's naming may differ.

`scontrol reboot` works for real (RebootProgram=/sbin/reboot: the container reboots). slurmctld
counts a node as rebooted when its slurmd reports an uptime younger than the reboot request, and
a container sees the machine's uptime; so slurmd runs with testing/slurm_uptime.c preloaded,
which makes sysinfo() count from the container's boot, as on a real machine.
"""
from __future__ import annotations

import base64
import shlex
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from testing import testhosts

APT = ("DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "
       "-o Dpkg::Use-Pty=0")
CTL_PACKAGES = ("slurmctld", "slurm-client", "munge")
NODE_PACKAGES = ("slurmd", "slurm-client", "munge")


def _sh(host, cmd: str, timeout: float = 300) -> str:
    r = testhosts.ssh(host, cmd, check=False, timeout=timeout)
    assert r.returncode == 0, f"{host.name}: {cmd}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stdout


PORTS_PER_CLUSTER = 16


def ports(ctl) -> tuple[int, int]:
    """(slurmctld port, first slurmd port): a block of 16 ports below the ephemeral range, by
    the controller's address (127.0.<net>.<last>), so that clusters in one pool or in several
    pools do not collide."""
    _, _, net, last = (int(x) for x in ctl.address.split("."))
    base = 20000 + ((net * 256 + last) % 760) * PORTS_PER_CLUSTER
    return base, base + 1


def config(ctl, nodes, names: dict[str, str] | None = None) -> str:
    names = names or {}
    assert len(nodes) < PORTS_PER_CLUSTER, f"at most {PORTS_PER_CLUSTER - 1} nodes per test cluster"
    ctl_port, node_port = ports(ctl)
    lines = [
        "# gpufleet test cluster (testing/slurm.py)",
        "ClusterName=gpufleet-test",
        f"SlurmctldHost={ctl.name}({ctl.address})",
        f"SlurmctldPort={ctl_port}",
        "AuthType=auth/munge", "CryptoType=crypto/munge",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none", "SelectType=select/cons_tres",
        "SlurmUser=root", "SlurmdUser=root", "MpiDefault=none",
        "StateSaveLocation=/var/lib/slurm/slurmctld", "SlurmdSpoolDir=/var/lib/slurm/slurmd",
        "ReturnToService=2", "SlurmctldTimeout=30", "SlurmdTimeout=60", "MinJobAge=3600",
        "RebootProgram=/sbin/reboot", "ResumeTimeout=300",
        "SlurmctldLogFile=/var/log/slurm/slurmctld.log", "SlurmdLogFile=/var/log/slurm/slurmd.log",
    ]
    for i, node in enumerate(nodes):
        name = names.get(node.name, node.name)
        host = f" NodeHostname={node.name}" if name != node.name else ""
        lines.append(f"NodeName={name}{host} NodeAddr={node.address} Port={node_port + i} CPUs=1 State=UNKNOWN")
    lines.append("PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def setup(ctl, nodes, names: dict[str, str] | None = None, timeout: float = 120) -> None:
    """Install, configure and start the cluster; return once every node is idle."""
    with ThreadPoolExecutor(max_workers=1 + len(nodes)) as ex:
        list(ex.map(lambda a: _sh(a[0], f"{APT} {' '.join(a[1])} >/dev/null"),
                    [(ctl, CTL_PACKAGES)] + [(n, NODE_PACKAGES) for n in nodes]))
    key = _sh(ctl, "base64 -w0 /etc/munge/munge.key").strip()
    conf = config(ctl, nodes, names)
    for host in [ctl, *nodes]:
        _sh(host, f"echo {shlex.quote(key)} | base64 -d > /etc/munge/munge.key && "
                  "chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key && "
                  f"printf %s {shlex.quote(conf)} > /etc/slurm/slurm.conf && "
                  "mkdir -p /var/log/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd && "
                  "systemctl restart munge")
    shim = base64.b64encode(uptime_shim()).decode()
    for node in nodes:
        _sh(node, f"echo {shim} | base64 -d > {SHIM} && mkdir -p /etc/systemd/system/slurmd.service.d && "
                  f"printf '[Service]\\nEnvironment=LD_PRELOAD={SHIM}\\n' "
                  "> /etc/systemd/system/slurmd.service.d/gpufleet-test-uptime.conf && systemctl daemon-reload")
    _sh(ctl, "systemctl enable slurmctld >/dev/null 2>&1; systemctl restart slurmctld")
    for node in nodes:
        _sh(node, "systemctl enable slurmd >/dev/null 2>&1; systemctl restart slurmd")
    wait_idle(ctl, len(nodes), timeout)


SHIM = "/usr/local/lib/gpufleet-test-uptime.so"


def uptime_shim() -> bytes:
    """testing/slurm_uptime.c built with the machine's compiler (it needs only glibc 2.7)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/uptime.so"
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", out, str(Path(__file__).with_name("slurm_uptime.c"))],
                       check=True, capture_output=True)
        return Path(out).read_bytes()


def wait_idle(ctl, count: int, timeout: float = 300) -> None:
    """Until the `count` nodes are idle (after a setup, after the nodes rebooted)."""
    deadline = time.monotonic() + timeout
    while True:
        states = _sh(ctl, "sinfo -h -N -o '%N %T'").split()
        if len(states) == 2 * count and all(s == "idle" for s in states[1::2]):
            return
        assert time.monotonic() < deadline, f"Slurm nodes not idle after {timeout} s: {states}"
        time.sleep(1)


def node_state(ctl, name: str) -> tuple[str, str]:
    """(sinfo's long state, reason) of a node, asked on the controller."""
    out = _sh(ctl, f"sinfo -h -N -n {shlex.quote(name)} -o '%T|%E'").strip().splitlines()[0]
    state, _, reason = out.partition("|")
    return state, ("" if reason == "none" else reason)


def settled_state(ctl, name: str, timeout: float = 180) -> tuple[str, str]:
    """node_state once slurmctld hears from the node's slurmd again: a trailing '*' (not
    responding, e.g. a ping lost while the machine is loaded) clears at its next ping."""
    deadline = time.monotonic() + timeout
    while True:
        state = node_state(ctl, name)
        if not state[0].endswith("*") or time.monotonic() > deadline:
            return state
        time.sleep(2)
