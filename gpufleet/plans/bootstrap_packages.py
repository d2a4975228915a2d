"""A fresh host's first converge: every Debian package the run installs, in one apt transaction.

Area by area, a first converge paid apt's index read and resolution and dpkg's database read and
triggers (man-db, ldconfig, systemd) seven times: diagnostics (base), driver stack, container
toolkit, Docker engine, node exporter, DCGM exporter, nftables and unattended-upgrades
(hardening): 151 s of package operations against 56 s for the same packages in one plain
`apt-get install` (bench/bootstrap.py, docs/performance.md). deploys/bootstrap.py writes every
apt source and key of the run first (operations/source_steps.py: the same writers the areas use,
each file written once), reads the index once, and installs this plan's union in one
sanctioned package change (operations/driver_upgrade.py's transient unit). The areas come after
it unchanged: their operations find their packages present and do nothing for that part, and
they stay the path of upgrades and re-runs.

The union is the areas' own plans, never a list of its own: the driver stack is the DriverPlan's
change (its releases, decided to exact Debian versions by gpufleet/plans/package_plan.py from
the index once the sources are read, exactly as the driver's own change decides them), the
container toolkit at the DockerPlan's pinned version, the engine, the BasePlan's diagnostics,
hardening's and monitoring's packages. It is decided at planning on facts this run does not
change (what is installed, the driver's state before the run), and it is only a first install:
a package already installed is never in it (its area moves it, or not, by its own rules).

What it leaves to its area's own transaction, and why (`left`, said in the run's plan):

- the driver stack, when any NVIDIA driver package or user-space library is present, or a
  kernel module of another version than the plan's is loaded: moving a driver is the guarded
  path's alone (the gate: GPUs idle right before, tools/rollout); likewise when
  the driver plan moves something in place, leaves something pending, or DKMS must sign with a
  Secure Boot key (its signing configuration is written by the driver area, before its install);
- the node exporter and NVIDIA's DCGM exporter: their packages start their services, and the
  monitoring area writes their listen address first on purpose (a first start on the default
  address would expose them before the firewall);
- gpg (checks the repository keys before any source is written), apt-cacher-ng (the cache host's
  own, installed before any host's apt points at it), and the tuning, storage and PyTorch areas'
  packages (tier- and hardware-dependent; none of them installs on the benchmark's host).

Inside the one change, the driver's version lock and the running kernel's headers go in an apt
run of their own first (`first`): the lock's preferences choose the versions of what the
transaction asks for without one, and DKMS builds the module against the headers while the
driver is configured, which dpkg's configure order inside one transaction would not guarantee.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.config.failures import Refusal
from gpufleet.plans.base import BasePlan
from gpufleet.plans.docker import DockerPlan
from gpufleet.plans.driver import DriverPlan
from gpufleet.plans.package_plan import PackageChangePlan, plan_package_change

#: hardening's packages (deploys/hardening.py installs them, Debian ships nftables.service disabled)
HARDENING_PACKAGES = ("nftables", "unattended-upgrades")
#: monitoring's package the early transaction may take: curl starts nothing
MONITORING_PACKAGES = ("curl",)


@dataclass(frozen=True)
class BootstrapPackages:
    """One first-install change: the driver stack's releases (exact versions decided once the
    sources are read), packages at exact versions, plain packages, and what is left out, why."""
    releases: dict[str, str]          # driver stack: package -> upstream release
    present: tuple[str, ...]          # driver stack: wanted at any version (cuDNN's, DCGM, modules)
    pinning: str | None               # the driver's version lock
    hold: bool                        # driver_hold: the driver stack held afterwards, as its change holds it
    exact: dict[str, str]             # package -> exact Debian version (the container toolkit's)
    plain: tuple[str, ...]            # as the sources offer them
    first: tuple[str, ...]            # in an apt run of their own, before the rest (kernel headers)
    also_hold: tuple[str, ...]        # the engine and toolkit, held by the same change (DockerPlan.hold)
    left: tuple[tuple[str, str], ...]  # (what, why): left to its area's own transaction

    @property
    def names(self) -> list[str]:
        return sorted({*self.releases, *self.present, *([self.pinning] if self.pinning else []),
                       *self.exact, *self.plain, *self.first})


def _driver_left(driver: DriverPlan) -> str | None:
    """Why the driver stack stays on its own guarded path; None: a first install it may take."""
    before = driver.before
    if before.userspace_version or before.packages:
        return "an NVIDIA driver is present: it moves only through the guarded package change"
    # A module loaded without any user-space driver (no package, no library: no GPU job can run
    # on it) is taken only at the version the plan installs: the install then matches it, and
    # the driver's own path would make this change without the gate too (it gates in-place
    # moves). A module of another version is left to that path (its reboot is gated).
    if before.module_loaded and before.module_version != driver.res.driver_version:
        return (f"an NVIDIA module {before.module_version or '?'} is loaded: it moves only through the guarded "
                "package change")
    if driver.change.in_place or driver.pending or driver.stack_pending or driver.drifted:
        return "the driver plan moves or leaves a stack already there"
    if driver.signing_key is not None:
        return "DKMS signs with a Secure Boot key: its configuration is written before the driver's install"
    if not driver.change.releases:
        return "no driver release to install"
    return None


def plan_bootstrap(driver: DriverPlan | Refusal, docker: DockerPlan | Refusal, base: BasePlan,
                   installed: Collection[str], *, driver_hold: bool, node_exporter: bool,
                   dcgm_exporter: bool) -> BootstrapPackages | None:
    """The first-install union of one host, from its areas' plans and the packages installed
    before the run (DebPackages' names); None: nothing to install early (a converged host, or an
    area refuses the host: then it stops there as before, and nothing is installed ahead of it)."""
    if isinstance(driver, Refusal) or isinstance(docker, Refusal):
        return None
    left: list[tuple[str, str]] = []
    releases: dict[str, str] = {}
    present: tuple[str, ...] = ()
    pinning: str | None = None
    first: list[str] = []
    why = _driver_left(driver)
    if why is None:
        releases, present, pinning = dict(driver.change.releases), driver.change.present, driver.change.pinning
        first = [p for p in (driver.headers, driver.headers_meta) if p and p not in installed]
    else:
        left.append(("driver stack", why))
    toolkit = dict(spec.split("=", 1) for spec in docker.toolkit_packages)
    exact = {} if any(p in installed for p in toolkit) else toolkit
    if not exact:
        left.append(("container toolkit", "installed: its version moves through the docker area"))
    plain = sorted({p for p in (*base.packages, *docker.engine_packages, *HARDENING_PACKAGES, *MONITORING_PACKAGES)
                    if p not in installed} - set(exact) - set(releases))
    if node_exporter:
        left.append(("node exporter", "its listen address is written before its package starts it"))
    if dcgm_exporter:
        left.append(("DCGM exporter", "its listen address is written before its package starts it"))
    if not (releases or exact or plain):
        return None
    # Held as the docker area holds them, but by the change itself: no moment in which the
    # security updates this same change turns on could move the engine under it.
    also_hold = docker.hold if set(docker.engine_packages) & set(plain) or exact else ()
    return BootstrapPackages(releases=releases, present=tuple(present), pinning=pinning, hold=driver_hold,
                             exact=exact, plain=tuple(plain), first=tuple(first), also_hold=tuple(also_hold),
                             left=tuple(left))


def union_change(plan: BootstrapPackages, installed: Mapping[str, str | None], held: Iterable[str],
                 offered: Mapping[str, Sequence[str]],
                 toolkits: Mapping[str, Mapping[str, Mapping[str, str]]]) -> PackageChangePlan:
    """The one change's arguments, from the index as it is once the sources are read: the driver
    stack exactly as its own change decides it (package_plan.plan_package_change, the same
    versions, version lock and holds), with the other areas' packages added to its install."""
    driver = plan_package_change(plan.releases, plan.present, plan.pinning, plan.hold, (), installed, held,
                                 offered, toolkits) if plan.releases else PackageChangePlan(install={})
    if driver.missing:
        return driver  # a release the sources do not offer: nothing changes (the host fails, naming it)
    install: dict[str, str | None] = dict(driver.install)
    for package, version in plan.exact.items():
        if installed.get(package) != version:
            install.setdefault(package, version)
    for package in (*plan.first, *plan.plain):
        if not installed.get(package):
            install.setdefault(package, None)
    first = tuple(p for p in (*driver.first, *plan.first) if p in install)
    hold = sorted({*(driver.hold if driver.install else ()), *plan.also_hold})
    return PackageChangePlan(install=install, first=first if len(install) > len(first) else (), hold=tuple(hold))
