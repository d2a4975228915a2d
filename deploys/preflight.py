"""Preflight: is this host the hardware its tier says it is?

Story of a host, part 0: before anything is installed, the GPUs, NVSwitch, NVLink and RDMA
devices the host really has (read from PCI, so it works before any driver) are compared with
what its tier expects. A mismatch warns, or with `tier_mismatch: fail` stops this host (and
only this host) before anything on it changes.
"""
from pyinfra import host, logger
from pyinfra.api import deploy

from gpufleet.config.hostfacts import hardware, tier_mismatches
from gpufleet.config.settings import host_settings
from gpufleet.plans.preflight import plan_preflight


@deploy("Preflight")
def preflight() -> None:
    settings = host_settings(host)
    plan = plan_preflight(settings, hardware(host).summary, tier_mismatches(host, settings))
    if plan.refusal is not None:
        plan.refusal.stop(host)
    elif plan.warning is not None:
        logger.warning(f"{host.print_prefix}{plan.warning}")


# `pyinfra INVENTORY deploys/preflight.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
