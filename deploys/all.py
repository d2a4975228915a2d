"""Bring a GPU host to the state its tier describes: the whole story, in order.

    pyinfra inventories/cloud.py deploys/all.py

0. validate   every host's inventory data, before anything is changed anywhere
1. preflight  the host's hardware against its tier
   packages   the fleet's package cache (apt-cacher-ng on the host that serves it) and every host's apt through it
2. base       diagnostics packages, the gpufleet record
3. driver     matching NVIDIA driver, CUDA toolkit, cuDNN, held
4. docker     Docker engine and the NVIDIA container toolkit
5. tuning     persistence, clocks, NCCL / OMP / PyTorch profiles
6. pytorch    the resolved PyTorch wheel in a shared venv, where the tier says so (pytorch_runtime: venv)
7. storage    local NVMe scratch (blank drives only), /dev/shm sized from the tier
8. monitoring Prometheus node exporter, DCGM and its exporter, where the tier says so
9. health    the node's own health watch, where the tier says so: timer, journal, metrics, Slurm
10. hardening SSH keys only, firewall (last change: it must not cut off the steps above)
11. validate  read-only gate: the host as it is now against its tier; a failed check fails it
"""
from pyinfra import host, state

from gpufleet.controller import factcache
from gpufleet.controller import hostlock
from gpufleet.controller import run_result
from gpufleet.controller import staging

factcache.install()  # no fact asked twice while nothing changed; last run's facts in one command
hostlock.install()  # one run at a time changes a host: its lock is taken at its first change
staging.install()  # sudo uploads stage in the login user's private folder, never /tmp
factcache.prefetch_all(state)  # every host starts on those while the rest of this is imported
run_result.install(state)  # under gpufleet-deploy: which hosts this run left converged, for their acceptance

from gpufleet.deploys.base import base  # noqa: E402
from gpufleet.deploys.bootstrap import bootstrap  # noqa: E402
from gpufleet.deploys.docker import docker  # noqa: E402
from gpufleet.deploys.driver import driver  # noqa: E402
from gpufleet.deploys.hardening import hardening  # noqa: E402
from gpufleet.deploys.health_watch import health_watch  # noqa: E402
from gpufleet.deploys.monitoring import monitoring  # noqa: E402
from gpufleet.deploys.package_cache import package_cache  # noqa: E402
from gpufleet.deploys.preflight import preflight  # noqa: E402
from gpufleet.deploys.pytorch import pytorch  # noqa: E402
from gpufleet.deploys.storage import storage  # noqa: E402
from gpufleet.deploys.tuning import tuning  # noqa: E402
from gpufleet.deploys.validate import validate  # noqa: E402
from gpufleet.config.failures import host_failed  # noqa: E402
from gpufleet.config.settings import validate_inventory  # noqa: E402

# pyinfra plans every host before it executes anything: a bad host stops the whole run here.
validate_inventory(state.inventory)
# Before any fact that decides: a run that took this host's lock since is seen when ours is taken.
hostlock.plan_on(host)

# One call per line, never a loop: pyinfra identifies an operation by the line numbers of its
# call stack (not file names), so deploys called from one shared line would share op ids and
# hosts on different paths (e.g. distro vs NVIDIA repository) would form an ordering cycle.
# A host refused by a step gets nothing more planned.
preflight()
if not host_failed(host):
    package_cache()
if not host_failed(host):
    bootstrap()
if not host_failed(host):
    base()
if not host_failed(host):
    driver()
if not host_failed(host):
    docker()
if not host_failed(host):
    tuning()
if not host_failed(host):
    pytorch()
if not host_failed(host):
    storage()
if not host_failed(host):
    monitoring()
if not host_failed(host):
    health_watch()
if not host_failed(host):
    hardening()
if not host_failed(host):
    validate(probe_only_if_changed=True)  # a no-op re-run leaves the GPUs to their jobs
