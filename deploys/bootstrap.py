"""A fresh host's first converge: every Debian package of the run in one apt transaction.

Story of a host, part 1.5 (all.py, after the package cache, before base): where the host still
lacks the run's packages (gpufleet/plans/bootstrap_packages.py decides, from the areas' own
plans and facts read before the run), every apt source and key the run writes is written first
(NVIDIA's CUDA repository or the archive's components, the container toolkit's, Docker's; the
package cache's proxy is already there: deploys/package_cache.py), the whole index is read once,
and the union goes in as one sanctioned package change at the versions each area's plan wants,
the driver stack held as its own change holds it. The areas then run as always: their
sources are left to this step (operations/source_steps.py: one writer per file), their install
operations find their packages present and do nothing, their holds and configuration follow.

A converged host plans nothing here (not one operation: the no-op run is unchanged), and so does
a host an area refuses (it stops at that area, as before, with nothing installed ahead of it).
What is left to its area's own transaction, and why, is the plan's `left`.
"""
from pyinfra import host, logger
from pyinfra.api import deploy
from pyinfra.facts.deb import DebPackages

from gpufleet.config.settings import host_settings
from gpufleet.explain import explained
from gpufleet.operations.apt_index import index_read
from gpufleet.operations.needrestart import quiet_needrestart
from gpufleet.operations.package_steps import first_install
from gpufleet.operations.source_steps import container_sources, cuda_sources, mark_written_early
from gpufleet.plans.base import plan_base
from gpufleet.plans.bootstrap_packages import plan_bootstrap
from gpufleet.plans.docker import DockerPlan, read_plan
from gpufleet.plans.driver import DriverPlan, plan_driver, read_driver_facts


@deploy("First install")
def bootstrap() -> None:
    settings = host_settings(host)
    driver = plan_driver(settings, read_driver_facts(host, settings))
    docker = read_plan(host, settings)
    planned = plan_bootstrap(driver, docker, plan_base(settings), host.get_fact(DebPackages),
                             driver_hold=settings.driver_hold,
                             node_exporter=settings.monitoring_node_exporter,
                             dcgm_exporter=settings.monitoring_dcgm_exporter)
    if planned is None:
        return
    assert isinstance(driver, DriverPlan) and isinstance(docker, DockerPlan)  # plan_bootstrap refuses the rest
    for what, why in planned.left:
        logger.info(f"{host.print_prefix}first install: {what} left to its area ({why})")
    quiet_needrestart()
    # every source first, the index read once, then the one change
    sources = [*cuda_sources(driver, refresh=False), *container_sources(docker, refresh=False)]
    mark_written_early(sources)
    index_read(name=explained("Read the package index, every source written",
                              "One apt-get update after every source and key of the run is written; the areas "
                              "then find the index fresh"))
    first_install(
        name=explained(f"Install the run's {len(planned.names)} packages in one transaction",
                       "Every Debian package of the first converge in one apt transaction, at the versions "
                       "each area's plan wants (" + ", ".join(planned.names) + ")"),
        releases=planned.releases, present=planned.present, pinning=planned.pinning, hold=planned.hold,
        exact=planned.exact, plain=planned.plain, first=planned.first, also_hold=planned.also_hold,
        keys=driver.change.keys)
