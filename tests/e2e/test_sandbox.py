"""The README's first quick-start command, exactly as an operator runs it: `tools/sandbox`
brings up local hosts with SIMULATED GPUs (test double), runs deploys/all.py, shows the result;
`tools/sandbox down` stops them."""
import os
import shlex
import subprocess

import pytest

from testing import testhosts
from tests.e2e.pyinfra_cli import REPO

pytestmark = pytest.mark.e2e
# the session's own pool name (tests/conftest.py's) with -sandbox: two sessions, two sandboxes
POOL = os.environ.get("GPUFLEET_TESTHOSTS_POOL", "pytest") + (
    f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "") + "-sandbox"


def exact_stack(h, sandbox: dict) -> dict[str, str]:
    """Each CUDA toolkit / cuDNN package the resolver wants on the sandbox host `h` (its tier and
    the inventory's overrides, its simulated GPUs as nvidia-smi names them, its OS) -> the
    version dpkg says is installed, asserted to be exactly the resolved release although the
    stand-in repository offers older and newer ones."""
    from gpufleet.config.resolver import resolve
    from gpufleet.catalog.tiers import tier_defaults
    from testing.aptrepo import load
    from testing.inventory import OS_RELEASE, environment_data

    tier, overrides = sandbox[h.gpu.split("@")[0]]
    repo = load(testhosts.pool_dir(POOL) / "aptrepo.json")
    wishes = {**tier_defaults(tier), **environment_data(h, tier, repo), **overrides}
    names = testhosts.ssh(h, "nvidia-smi --query-gpu=name --format=csv,noheader").stdout.split("\n")
    res = resolve([n.strip() for n in names if n.strip()], wishes, OS_RELEASE[h.release])
    found = {}
    for package, release in sorted(res.stack_versions.items()):
        installed = testhosts.ssh(h, "dpkg-query -W -f='${Version}' " + shlex.quote(package), check=False).stdout.strip()
        offered = testhosts.ssh(h, "apt-cache madison " + shlex.quote(package) + " | cut -d'|' -f2",
                                check=False).stdout.split()
        assert installed.split(":")[-1].rsplit("-", 1)[0] == release, (h.name, package, installed, release)
        assert any(v != installed for v in offered), (h.name, package, offered)  # a choice was made
        found[package] = installed
    return found


def test_sandbox_quick_start(hostpool, monkeypatch):
    # the deploy user's sudo password: this process's, which tools/sandbox then uses (its own
    # random one otherwise), so that the checks below get through that user's sudo
    password = testhosts.sudo_password()
    env = dict(os.environ, GPUFLEET_SANDBOX_POOL=POOL)
    try:
        up = subprocess.run(["tools/sandbox"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=1800)
        out = up.stdout + up.stderr
        assert up.returncode == 0, out[-5000:]
        assert password not in out
        assert "pyinfra inventories/sandbox.py deploys/all.py" in out
        for tier, gpu in (("dev", "Tesla T4"), ("research", "NVIDIA A100-SXM4-40GB"), ("hgx", "NVIDIA H200")):
            assert f"tier: {tier}" in out and gpu in out
        hosts = testhosts.list_hosts(POOL)
        assert sorted(h.gpu.split("@")[0] for h in hosts) == ["a100x4", "h200x2", "t4"]
        for h in hosts:
            assert testhosts.ssh(h, "systemctl is-system-running").stdout.strip() == "running"
            # the operator's shape: reached as the sudo user, root's login off after hardening
            assert h.ssh_user == testhosts.SSH_USER != "root"
            sshd = testhosts.ssh(h, "sshd -T").stdout.splitlines()
            assert "permitrootlogin no" in sshd, sshd
            allowed = sorted(line.split()[1] for line in sshd if line.startswith("allowusers "))
            if h.gpu.startswith("a100x4"):  # research: the lab's second user may log in too
                assert allowed == sorted([testhosts.SSH_USER, testhosts.LAB_USER]), sshd
                lab = testhosts.ssh(h, "id -un", user=testhosts.LAB_USER, check=False)
                assert lab.stdout.strip() == testhosts.LAB_USER, lab
            nobody = testhosts.ssh(h, "id -un", user=testhosts.LOCAL_USER, check=False)
            assert nobody.returncode == 255 if allowed else nobody.returncode == 0, nobody
        monkeypatch.setenv("GPUFLEET_SANDBOX_POOL", POOL)
        from inventories.sandbox import SANDBOX  # the sandbox's tiers and overrides, as deployed

        exact = {h.gpu.split("@")[0]: exact_stack(h, SANDBOX) for h in hosts}
        # the tiers that install CUDA and cuDNN from NVIDIA's repository: exactly the resolved releases
        assert exact["a100x4"] and exact["h200x2"], exact
        # hgx's PyTorch runtime is gpufleet's venv (the stand-in index's TEST DOUBLE wheel here): the
        # gate's PyTorch check and probe ran with it, the simulated GPUs no CUDA device to it
        (hgx,) = [h for h in hosts if h.gpu.startswith("h200x2")]
        gate = [" ".join(ln.split()) for ln in out.splitlines() if ln.strip().startswith(f"[{hgx.name}]")]
        venv = "runtime venv /opt/gpufleet/pytorch (gpufleet's, pytorch_runtime)"
        assert any("[PASS] pytorch: " in ln and ln.endswith(f"({venv})") for ln in gate), gate
        assert any("[SKIP] probe: bf16 matmul" in ln and f"{venv}): matmul: no CUDA device" in ln for ln in gate), gate
        assert "PyTorch not installed" not in out
    finally:
        down = subprocess.run(["tools/sandbox", "down"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
    assert down.returncode == 0, down.stderr
    assert testhosts.list_hosts(POOL) == [] and testhosts.leftovers(POOL) == []
