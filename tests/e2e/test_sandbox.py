"""The README's first quick-start command, exactly as an operator runs it: `tools/sandbox`
brings up local hosts with SIMULATED GPUs (test double), runs deploys/all.py, shows the result;
`tools/sandbox down` stops them."""
import os
import subprocess

import pytest

from testing import testhosts
from tests.e2e.pyinfra_cli import REPO

pytestmark = pytest.mark.e2e
POOL = "pytest-sandbox"


def test_sandbox_quick_start(hostpool):
    env = dict(os.environ, GPUFLEET_SANDBOX_POOL=POOL)
    try:
        up = subprocess.run(["tools/sandbox"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=1800)
        out = up.stdout + up.stderr
        assert up.returncode == 0, out[-5000:]
        assert "pyinfra inventories/sandbox.py deploys/all.py" in out
        for tier, gpu in (("dev", "Tesla T4"), ("research", "NVIDIA A100-SXM4-40GB"), ("hgx", "NVIDIA H200")):
            assert f"tier: {tier}" in out and gpu in out
        hosts = testhosts.list_hosts(POOL)
        assert sorted(h.gpu.split("@")[0] for h in hosts) == ["a100x4", "h200x2", "t4"]
        for h in hosts:
            assert testhosts.ssh(h, "systemctl is-system-running").stdout.strip() == "running"
    finally:
        down = subprocess.run(["tools/sandbox", "down"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)
    assert down.returncode == 0, down.stderr
    assert testhosts.list_hosts(POOL) == [] and testhosts.leftovers(POOL) == []
