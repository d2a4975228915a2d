"""Packages at the upstream releases the inventory resolves to, through the one sanctioned change
(driver_upgrade.packages_at_versions): a step shared by deploys/driver.py and deploys/monitoring.py.

The exact Debian versions are decided on the controller (gpufleet/plans/package_plan.py) from what the
package index offers. When the sources the index is read from are already as this run leaves
them, that is at planning: a release they do not offer refuses the host before anything changes.
When this run itself adds or changes them (a new host: NVIDIA's repository and its key), the
index that offers the release exists only once the run has read it: the operation takes the
same decision again when its turn comes, on the index as it is then.
"""
from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence

from pyinfra import host
from pyinfra.api import FunctionCommand, Host, StringCommand, operation
from pyinfra.api.operation import OperationMeta

from gpufleet.facts.packages import TOOLKIT, AptVersions, HeldPackages, PackageVersions, ToolkitIndex
from gpufleet.config.failures import fail, refuse
from gpufleet.operations.driver_upgrade import packages_at_versions
from gpufleet.plans.bootstrap_packages import BootstrapPackages, union_change
from gpufleet.plans.package_plan import PackageChangePlan, moving_packages, plan_package_change

def _plan(h: Host, releases: Mapping[str, str], present: Sequence[str], pinning: str | None, hold: bool,
          old_pins: Sequence[str]) -> PackageChangePlan:
    wanted = [*present, *([pinning] if pinning else [])]
    installed = h.get_fact(PackageVersions, packages=[*releases, *wanted])
    moving = moving_packages(releases, wanted, installed)
    if not moving:
        return PackageChangePlan(install={})
    offered, toolkits, held = _index_facts(h, releases, moving)
    return plan_package_change(releases, present, pinning, hold, old_pins, installed, held, offered, toolkits)


def _index_facts(h: Host, releases: Mapping[str, str], moving: Sequence[str]
                 ) -> tuple[Mapping[str, Sequence[str]], dict[str, dict[str, dict[str, str]]], list[str]]:
    """What a change of the `moving` packages is decided on: the versions the index offers for
    those with a release, the CUDA toolkits' component indexes, and the holds."""
    with_release = [p for p in moving if p in releases]
    offered = h.get_fact(AptVersions, packages=with_release) if with_release else {}
    toolkits: dict[str, dict[str, dict[str, str]]] = {
        p: h.get_fact(ToolkitIndex, package=p) for p in moving if TOOLKIT.match(p)}
    held: list[str] = h.get_fact(HeldPackages)
    return offered, toolkits, held


def _missing(plan: PackageChangePlan, keys: Mapping[str, str], key: str) -> tuple[str, str, str]:
    """(area, reason, fix) for releases the sources do not offer, naming the settings they come from."""
    settings = sorted({keys.get(package, key) for package, _ in plan.missing})
    return (settings[0], f"the package sources offer no {', '.join(text for _, text in plan.missing)}; "
                         "nothing was changed",
            f"set {' / '.join(settings)} to a release the sources offer (apt-cache madison PACKAGE on the "
            "host lists them), or add a source that has it")


def packages_at_releases(name: str, releases: Mapping[str, str], present: Sequence[str] = (),
                         pinning: str | None = None, hold: bool = True, old_pins: Sequence[str] = (),
                         require_idle: bool = False, settled: bool = True, key: str = "driver_version",
                         keys: Mapping[str, str] | None = None) -> OperationMeta | None:
    """Bring `releases` (package -> upstream release), `present` and the version lock `pinning` in
    as one change, held afterwards (`hold`), other version locks `old_pins` removed; `key`: the
    setting a release the sources do not offer comes from (`keys`: per package, where another one).
    `settled`: the sources are as this run leaves them (false where this run, or another area of
    it, may add them first): then a release they do not offer refuses the host at planning (None)."""
    keys = dict(keys or {})
    if settled:
        plan = _plan(host, releases, present, pinning, hold, old_pins)
        if plan.missing:
            refuse(host, *_missing(plan, keys, key))
            return None
    return exact_packages(name=name, releases=releases, present=present, pinning=pinning, hold=hold,
                          old_pins=old_pins, require_idle=require_idle, key=key, keys=keys)


@operation()
def exact_packages(releases: Mapping[str, str], present: Sequence[str] = (), pinning: str | None = None,
                   hold: bool = True, old_pins: Sequence[str] = (), require_idle: bool = False,
                   key: str = "driver_version", keys: Mapping[str, str] | None = None,
                   ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """The exact versions for `releases` decided from the facts, then driver_upgrade's one
    sanctioned change. pyinfra runs an operation's body at planning and again when its turn
    comes: on a run that adds the sources, the second reads the index this run refreshed (the
    fact memo forgets a host's answers after any command), so the versions are those the
    sources offer then; a release they do not offer fails the host there, nothing changed."""
    plan = _plan(host, releases, present, pinning, hold, old_pins)
    if plan.missing:
        yield fail(host, *_missing(plan, dict(keys or {}), key))
        return
    yield from packages_at_versions._inner(install=plan.install, first=plan.first, remove=list(plan.remove),
                                           hold=list(plan.hold) if plan.install else [],
                                           require_idle=require_idle, recommends=False)


@operation()
def first_install(releases: Mapping[str, str], present: Sequence[str] = (), pinning: str | None = None,
                  hold: bool = True, exact: Mapping[str, str] | None = None, plain: Sequence[str] = (),
                  first: Sequence[str] = (), also_hold: Sequence[str] = (), keys: Mapping[str, str] | None = None,
                  ) -> Generator[StringCommand | FunctionCommand, None, None]:
    """A first converge's early install (gpufleet/plans/bootstrap_packages.py's BootstrapPackages,
    field by field): every package of the run in one sanctioned change. Like exact_packages, the
    body runs again when its turn comes, after the run wrote and read the sources: the driver
    stack's exact versions are those the index offers then, decided by the driver's own rules
    (union_change); a release it does not offer fails the host there, nothing changed. No GPU
    gate: the plan takes the driver stack only where the driver's own path would not gate it
    either (no user-space driver present), so no GPU job can be running on it.

    + releases, present, pinning, hold: the driver stack's change (DriverPlan.change)
    + exact: package -> exact Debian version (the container toolkit's)
    + plain: packages as the sources offer them; first: in an apt run of their own before the rest
    + also_hold: held by the same change (the engine and toolkit)
    + keys: the setting each driver stack release comes from, for a release not offered
    """
    plan = BootstrapPackages(releases=dict(releases), present=tuple(present), pinning=pinning, hold=hold,
                             exact=dict(exact or {}), plain=tuple(plain), first=tuple(first),
                             also_hold=tuple(also_hold), left=())
    installed = host.get_fact(PackageVersions, packages=plan.names)
    moving = moving_packages(plan.releases, [*plan.present, *([plan.pinning] if plan.pinning else [])], installed)
    offered, toolkits, held = _index_facts(host, plan.releases, moving)
    change = union_change(plan, installed, held, offered, toolkits)
    if change.missing:
        yield fail(host, *_missing(change, dict(keys or {}), "driver_version"))
        return
    yield from packages_at_versions._inner(install=change.install, first=change.first, hold=list(change.hold),
                                           recommends=False)
