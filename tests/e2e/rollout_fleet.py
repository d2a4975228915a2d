"""A small fleet for the rollout tests: test hosts with simulated A100s at driver 580.95.05,
installed from the stand-in NVIDIA repository, pinned and held, optionally Slurm nodes of a real
Slurm cluster (testing/slurm.py). The simulator loads the installed driver's version at every
boot (testing/gpusim/gpusim-load-module)."""
from __future__ import annotations

import base64
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from testing import slurm as slurm_cluster
from testing import testhosts
from testing.aptrepo import DRIVERS
from testing.inventory import write_inventory

OLD, NEW = DRIVERS[0], DRIVERS[1]
OLD_DEB, NEW_DEB = f"{OLD}-1", f"{NEW}-1"
GPU = f"a100x2@{OLD}"
KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"
APT = "DEBIAN_FRONTEND=noninteractive apt-get -q -o Dpkg::Use-Pty=0"
# CUDA 13.0 and cuDNN 9.17.0 at the exact releases the tiers resolve to (the stand-in repo offers newer)
STACK = ("cuda-toolkit-13-0=13.0.2-1", "libcudnn9-cuda-13=9.17.0.29-1", "libcudnn9-dev-cuda-13=9.17.0.29-1",
         "libcudnn9-headers-cuda-13=9.17.0.29-1")
HELD = ("nvidia-open", "nvidia-driver-cuda", "nvidia-kernel-open-dkms", "nvidia-fabricmanager", "libcudnn9-cuda-13")
SLURMCTLD_LOG = "/var/log/slurm/slurmctld.log"


def sh(host, cmd: str, check: bool = True, timeout: float = 300):
    r = testhosts.ssh(host, cmd, check=False, timeout=timeout)
    if check:
        assert r.returncode == 0, f"{host.name}: {cmd}\n--- rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def version(host, pkg: str) -> str:
    """'ii 580.95.05-1' when installed (held or not: holds are checked on their own), else dpkg's status."""
    out = sh(host, f"dpkg-query -W -f='${{db:Status-Abbrev}}${{Version}}' {pkg} 2>/dev/null || true").stdout.strip()
    return "ii" + out[2:] if out.startswith("hi") else out


def holds(host) -> set[str]:
    return set(sh(host, "apt-mark showhold").stdout.split())


def loaded(host) -> str:
    text = sh(host, "cat /proc/driver/nvidia/version").stdout
    return re.search(r"Kernel Module.*?\s(\d+\.\d+\.\d+)\s", text).group(1)


def prepare(host, aptrepo) -> None:
    """Old driver + CUDA + cuDNN + FM from the stand-in repo, pinned and held, as issue 4's deploy leaves a host."""
    b64 = base64.b64encode(aptrepo.keyring.read_bytes()).decode()
    line = aptrepo.sources_line("debian12", KEYRING)
    sh(host, f"echo {b64} | base64 -d > {KEYRING} && chmod 644 {KEYRING} && "
             f"echo {shlex.quote(line)} > /etc/apt/sources.list.d/cuda-debian12-x86_64.list && "
             f"{APT} update -o Dir::Etc::SourceList=/dev/null >/dev/null && "
             f"{APT} install -y nvidia-driver-pinning-{OLD} >/dev/null && "
             f"{APT} install -y nvidia-open={OLD_DEB} nvidia-fabricmanager={OLD_DEB} {' '.join(STACK)} "
             f">/dev/null && apt-mark hold {' '.join(HELD)} >/dev/null")


def tune_gpus(host) -> tuple[int, int]:
    """Persistence on and non-default application clocks: the rollout must bring them back after its reboot."""
    sh(host, "nvidia-smi -pm 1 >/dev/null")
    pair = supported_pair(host)
    sh(host, f"nvidia-smi -ac {pair[0]},{pair[1]} >/dev/null")
    return pair


def supported_pair(host) -> tuple[int, int]:
    """A supported (memory, graphics) pair below the default, to tell 'set' from 'default'."""
    text = sh(host, "nvidia-smi -i 0 -q -d SUPPORTED_CLOCKS").stdout
    mem = int(re.search(r"Memory\s*:\s*(\d+) MHz", text).group(1))
    gfx = [int(g) for g in re.findall(r"Graphics\s*:\s*(\d+) MHz", text)]
    return mem, gfx[min(3, len(gfx) - 1)]


def prepare_all(hosts, aptrepo, slurmctld=None) -> None:
    """With `slurmctld` (a test host), the hosts become the nodes of a real Slurm cluster first
    (installed before the NVIDIA source's index refresh leaves only that source's lists)."""
    if slurmctld is not None:
        slurm_cluster.setup(slurmctld, hosts)
    with ThreadPoolExecutor(max_workers=3) as ex:
        list(ex.map(lambda h: prepare(h, aptrepo), hosts))
    # boot once with the installed driver loaded (what the simulator does at every boot)
    for h in hosts:
        testhosts.reboot(h)
        tune_gpus(h)
    if slurmctld is not None:
        slurm_cluster.wait_idle(slurmctld, len(hosts))


def slurm_updates(ctl, node: str) -> list[tuple[float, str]]:
    """slurmctld's record of the changes made to `node` (drain, reason, resume): (time, text)."""
    out = sh(ctl, f"grep -F 'update_node: node {node} ' {SLURMCTLD_LOG} || true").stdout
    found = []
    for line in out.splitlines():
        stamp, _, text = line.partition("] ")
        when = datetime.strptime(stamp.lstrip("[")[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
        found.append((when.timestamp() + float("0." + stamp.rstrip("]").split(".")[-1]), text))
    return found


def inventory(path: Path, hosts, aptrepo, extra: dict | None = None) -> Path:
    data = {h.name: {"tier": "research", "tier_mismatch": "warn", "validate_os_release": "debian-12",
                     "driver_version": "auto", "driver_repo_url": aptrepo.cuda_repos_url,
                     **(extra or {}).get(h.name, {})} for h in hosts}
    return write_inventory(path, hosts, data=data, groups={"gpu_fleet": [h.name for h in hosts]})
