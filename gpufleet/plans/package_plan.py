"""What the one sanctioned package change installs, decided on the controller from facts before it
runs: exact Debian versions for the upstream releases the inventory resolves to, a CUDA toolkit's
components at the versions its release names, what is held afterwards, and what the sources do
not offer (then nothing changes). deploys/driver.py and deploys/monitoring.py reach it through
operations/package_steps.py, the rollout through gpufleet/rollout/moves.py (deploys/upgrade.py):
one decision for both; all of them change packages with operations/driver_upgrade.py's
packages_at_versions.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.facts.packages import TOOLKIT, toolkit_closure
from gpufleet.versions import offered_at


@dataclass(frozen=True)
class ToolkitReleasePlan:
    """A toolkit meta package's components at the release it names."""
    versions: dict[str, str | None]  # component -> the exact version offered for its >= bound; None: not offered
    bounds: dict[str, str]           # component -> that bound (for messages)
    loose: tuple[str, ...]           # components named without a version: apt brings them, they are held with it


def toolkit_release(index: Mapping[str, Mapping[str, str]], meta: str, version: str) -> ToolkitReleasePlan:
    """The components of toolkit `meta` at Debian version `version`, from a ToolkitIndex fact:
    each at the version whose upstream part (or whole version) is the lower bound its parent
    names with >= (NVIDIA's meta packages ask so, and apt alone would bring the newest)."""
    def at(name: str, bound: str | None) -> str | None:
        return version if name == meta else offered_at(bound, index.get(name, {})) if bound else None

    def depends_of(name: str, bound: str | None) -> str:
        chosen = at(name, bound)
        return index.get(name, {}).get(chosen, "") if chosen else ""

    versions: dict[str, str | None] = {}
    bounds: dict[str, str] = {}
    loose: list[str] = []
    for name, bound in toolkit_closure(meta, depends_of).items():
        if bound is None:
            loose.append(name)
        else:
            versions[name], bounds[name] = at(name, bound), bound
    return ToolkitReleasePlan(versions, bounds, tuple(loose))


@dataclass(frozen=True)
class PackageChangePlan:
    """The arguments of one packages_at_versions change, or why there is none."""
    install: dict[str, str | None]   # package -> exact Debian version; None: as the sources offer it
    first: tuple[str, ...] = ()      # installed in an apt run of their own first (the version lock)
    remove: tuple[str, ...] = ()     # other version locks, released and removed
    hold: tuple[str, ...] = ()       # held afterwards (re-held, when holding is off: what was held)
    # (package the inventory asks for, "package release" the sources do not offer): nothing changes
    missing: tuple[tuple[str, str], ...] = ()


def at_release(installed: str | None, release: str) -> bool:
    """Whether an installed Debian version is the upstream release `release` (any epoch or
    revision; a version that only starts like it is not)."""
    return installed is not None and offered_at(release, [installed]) is not None


def moving_packages(releases: Mapping[str, str], present: Iterable[str],
                    installed: Mapping[str, str | None]) -> list[str]:
    """What a change has to bring: packages not at their release, and wanted ones not installed."""
    return sorted({*(p for p, r in releases.items() if not at_release(installed.get(p), r)),
                   *(p for p in present if not installed.get(p))})


def plan_package_change(releases: Mapping[str, str], present: Sequence[str], pinning: str | None, hold: bool,
                        old_pins: Sequence[str], installed: Mapping[str, str | None], held: Iterable[str],
                        offered: Mapping[str, Sequence[str]],
                        toolkits: Mapping[str, Mapping[str, Mapping[str, str]]]) -> PackageChangePlan:
    """The change that brings `releases` (package -> upstream release) and `present` (and the
    version lock `pinning`) in, from the installed versions, the holds, what the sources offer
    (AptVersions of the moving packages) and the toolkit index of each moving cuda-toolkit-X-Y
    (ToolkitIndex). Pure: the same facts give the same plan."""
    wanted = [*present, *([pinning] if pinning else [])]
    moving = moving_packages(releases, wanted, installed)
    install: dict[str, str | None] = {}
    missing: list[tuple[str, str]] = []
    components: list[str] = []
    for package in moving:
        release = releases.get(package)
        if release is None:
            install[package] = None
            continue
        exact = offered_at(release, offered.get(package, ()))
        if exact is None:
            missing.append((package, f"{package} {release}"))
            continue
        install[package] = exact
        if TOOLKIT.match(package):
            walk = toolkit_release(toolkits.get(package, {}), package, exact)
            for component, at in walk.versions.items():
                if at is None:
                    missing.append((package, f"{component} {walk.bounds[component]} (named by {package} {release})"))
                elif component in releases and not at_release(at, releases[component]):
                    # an exact pin (Nsight's, compat.yaml) against the build the toolkit names:
                    # apt would get two answers; neither is chosen behind the operator's back
                    missing.append((component, f"{component} {releases[component]} (the toolkit {package} "
                                               f"{release} names {walk.bounds[component]})"))
                else:
                    install.setdefault(component, at)
            components += [*walk.versions, *walk.loose]
    names = {*releases, *wanted}
    keep_held = sorted({*names, *components}) if hold else sorted(set(held) & names)
    first = (pinning,) if pinning and pinning in install and len(install) > 1 else ()
    return PackageChangePlan(
        install={} if missing else install,
        first=() if missing else first,
        remove=tuple(sorted(p for p in old_pins if p != pinning)) if install and not missing else (),
        hold=tuple(p for p in keep_held if p not in old_pins),
        missing=tuple(missing),
    )
