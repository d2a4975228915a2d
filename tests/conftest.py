"""Shared fixtures. End-to-end tests get real systemd test hosts from testing/testhosts.py."""
from __future__ import annotations

import os
import shutil

import pytest

from testing import testhosts

# Under pytest-xdist (tools/test runs the end-to-end tests on two workers), each worker has a pool
# of its own: a pool is one process's hosts, torn down whole when its session ends.
POOL = os.environ.get("GPUFLEET_TESTHOSTS_POOL", "pytest") + (
    f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")


def pytest_configure(config) -> None:
    # the tools ask before changing hosts when stdin is a terminal (tools/rollout): a suite
    # started from a shell would wait at every question, so the tools it starts get no terminal,
    # as in CI (a test that wants one gives them a pseudo-terminal of its own)
    if os.isatty(0) and not config.getoption("usepdb", False):
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)


class HostPool:
    """Session-wide pool of test hosts, brought up on first use and torn down at the end."""

    def __init__(self, pool: str):
        self.pool = pool
        self._by_key: dict[tuple, list[testhosts.Host]] = {}

    def get(self, key: str, count: int = 1, release: str = "bookworm", gpu: str | None = None,
            private_network: bool = False, forward: tuple[int, ...] = (), containers: bool = False,
            ssh_user: str = testhosts.SSH_USER) -> list[testhosts.Host]:
        """`count` hosts reserved for `key`, shared by the tests that ask for the same key;
        `containers` (with `private_network`): hosts where Docker can start containers;
        `ssh_user`: the sudo user of the operator's shape (default) or "root"."""
        k = (key, count, release, gpu, private_network, tuple(forward), containers, ssh_user)
        if k not in self._by_key:
            self._by_key[k] = testhosts.up(count, release=release, gpu=gpu, pool=self.pool,
                                           private_network=private_network, forward=forward,
                                           containers=containers, ssh_user=ssh_user)
        return self._by_key[k]

    def down(self) -> None:
        testhosts.down(self.pool)


def _e2e_possible() -> str | None:
    if os.geteuid() != 0:
        return "end-to-end tests need root"
    for tool in ("systemd-nspawn", "debootstrap", "ssh"):
        if not shutil.which(tool):
            return f"end-to-end tests need {tool} (run tools/bootstrap)"
    return None


@pytest.fixture(scope="session")
def hostpool():
    reason = _e2e_possible()
    if reason:
        if os.environ.get("GPUFLEET_REQUIRE_E2E"):
            pytest.fail(reason)
        pytest.skip(reason)
    # Whatever an earlier, killed run left in this pool goes first.
    testhosts.down(POOL)
    pool = HostPool(POOL)
    yield pool
    pool.down()


# The slowest end-to-end files (CI's "seconds per test file") start first: on two workers
# (tools/test) the run ends with the short files, not with one worker alone on a long one.
_SLOWEST_FIRST = ("test_storage_raid.py", "test_rollout.py", "test_gate.py", "test_firewall_private.py",
                  "test_package_cache.py", "test_rollout_lvm_vm.py", "test_acceptance.py", "test_sandbox.py",
                  "test_health_watch.py", "test_health_watch_slurm.py",
                  "test_exact_stack.py", "test_driver.py", "test_rollout_directions.py", "test_docker_gpu.py",
                  "test_daemon_reload_gpu.py", "test_secrets.py", "test_tuning.py", "test_rollout_slurm.py",
                  "test_bad_input.py", "test_report.py", "test_firewall_docker.py", "test_pytorch_runtime.py")


def pytest_collection_modifyitems(items) -> None:
    def rank(item) -> int:
        name = item.path.name
        return _SLOWEST_FIRST.index(name) if name in _SLOWEST_FIRST else len(_SLOWEST_FIRST)
    items.sort(key=rank)   # stable: a file's own tests keep their order


# Where the suite's time goes, a line per test file (setup, call and teardown added up): CI's
# output is what a later session reads to keep the suite under its time limit, and --durations
# shows only the slowest few tests.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"seconds per test file ({total:.0f} s in all)")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:60]:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
