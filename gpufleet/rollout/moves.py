"""What one host's package change in a rollout installs, removes and holds, decided on the
controller from facts read before it (deploys/upgrade.py's `upgrade` step applies it).

The exact versions come from the same packages plan as all.py's
(gpufleet/plans/package_plan.py:plan_package_change): the driver packages installed at another
release than the target, the version lock of the target, the CUDA toolkit / cuDNN packages the
inventory moves (or renames) and, with a moving toolkit, its components and tuning_profiling
users' Nsight, each at the release they resolve to. What only a rollout moves is added here:
Ubuntu's prebuilt modules and the kernels they follow (the newest build the archive offers), the
packages a renamed toolkit / cuDNN replaces, and the holds the host had before.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpufleet.facts.packages import TOOLKIT
from gpufleet.plans.package_plan import plan_package_change
from gpufleet.rollout.manifest import (DRIVER_PACKAGE, NOT_DRIVER, PINNING_PACKAGE, _stack_family, prebuilt_plan,
                                       renamed_packages, stack_moves, upstream, version_pinning_package)


@dataclass(frozen=True)
class MoveRefusal:
    """Why the host's packages do not move (nothing changed): reason, fix and the setting."""
    reason: str
    fix: str
    area: str


@dataclass(frozen=True)
class RolloutMove:
    """The one package change of a host's rollout step."""
    install: dict[str, str]          # package -> exact Debian version
    remove: tuple[str, ...]          # the old version lock, packages a renamed toolkit / cuDNN replaces
    hold: tuple[str, ...]            # held afterwards
    what: tuple[str, ...]            # what moves, package by package, in words (the log)
    stack_present: tuple[str, ...]   # CUDA toolkit / cuDNN packages of the inventory there afterwards
    short: str = "nothing"           # what moves, in a few words (the operation's name)


def driver_releases(installed: Mapping[str, str | None], target: str) -> tuple[dict[str, str], str | None]:
    """({package: target} for the installed driver packages and the target's version lock, the
    version lock it replaces or None)."""
    releases = {name: target for name, ver in installed.items()
                if ver and DRIVER_PACKAGE.match(name) and not NOT_DRIVER.match(name)}
    pin, new_pin = version_pinning_package(installed), f"nvidia-driver-pinning-{target}"
    if pin and pin != new_pin:
        releases[new_pin] = target
        return releases, pin
    return releases, None


def stack_targets(installed: Mapping[str, str | None], wanted: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """({package: release} of the CUDA toolkit / cuDNN packages the rollout moves or brings under
    their new name, [the packages those new names replace])."""
    new, replaced = renamed_packages(dict(installed), dict(wanted))
    return {**{p: want for p, (_, want) in stack_moves(dict(installed), dict(wanted)).items()}, **new}, replaced


def toolkit_moves(installed: Mapping[str, str | None], wanted: Mapping[str, str]) -> bool:
    """Whether a CUDA toolkit moves (then its Nsight moves with it)."""
    return any(TOOLKIT.match(p) for p in stack_targets(installed, wanted)[0])


def rollout_move(installed: Mapping[str, str | None], holds: Sequence[str], available: Mapping[str, list[str]],
                 target: str, wanted: Mapping[str, str], toolkits: Mapping[str, Mapping[str, Mapping[str, str]]],
                 nsight: Mapping[str, str], driver_hold: bool) -> RolloutMove | MoveRefusal:
    """The change that brings the driver to `target` and the CUDA toolkit / cuDNN to `wanted`
    (`holds`: held now, and what the manifest recorded held; `available`: AptVersions of every
    package that may move; `toolkits`: ToolkitIndex of each moving toolkit; `nsight`: users'
    Nsight releases of the new toolkit release). Pure."""
    driver, old_pin = driver_releases(installed, target)
    stack, replaced = stack_targets(installed, wanted)
    plan = plan_package_change({**driver, **stack, **nsight}, (), None, driver_hold, (old_pin,) if old_pin else (),
                               installed, holds, available, toolkits)
    refused = _refusal(plan.missing, driver, target)
    if refused:
        return refused
    install = {p: v for p, v in plan.install.items() if v is not None}
    moving_driver = any(p in driver for p in install)
    prebuilt, prebuilt_missing = prebuilt_plan(installed, available) if moving_driver else ({}, [])
    if prebuilt_missing:
        return MoveRefusal("the configured sources offer no " + ", ".join(prebuilt_missing)
                           + f": the prebuilt NVIDIA modules and the kernels move together; driver {target} not installed",
                           "wait until Ubuntu's archive publishes the modules for this driver and kernel "
                           "(linux-restricted-modules), or roll out a driver it offers them for (--driver-version)",
                           "driver_version")
    stack_install = {p: v for p, v in install.items() if p not in driver}
    return RolloutMove(
        install={**install, **prebuilt}, remove=(*plan.remove, *replaced),
        hold=_holds(installed, holds, old_pin, target, replaced, stack_install, plan.hold if driver_hold else (), driver),
        what=tuple(([f"the driver packages to {target}"] if moving_driver else [])
                   + [f"{p} to {v}" for p, v in sorted(prebuilt.items())]
                   + [f"{p} to {upstream(v)}" for p, v in sorted(stack_install.items())]
                   + [f"without {p}" for p in replaced]),
        stack_present=tuple(p for p in wanted if installed.get(p) or p in stack_install),
        short=", ".join([*([f"driver to {target}"] if moving_driver else []), *(["prebuilt modules"] if prebuilt else []),
                         *(["CUDA/cuDNN"] if stack_install or replaced else [])]) or "nothing")


def _refusal(missing: Sequence[tuple[str, str]], driver: Mapping[str, str], target: str) -> MoveRefusal | None:
    """What the sources do not offer, named by the setting it comes from: the driver first."""
    gone = [package for package, _ in missing if package in driver]
    if gone:
        return MoveRefusal(f"driver {target} is not available from the configured repositories for: {', '.join(gone)}",
                           "add a package source that has this release (driver_source), or roll out one they "
                           "offer (--driver-version)", "driver_version")
    if missing:
        return MoveRefusal("the configured repositories offer no " + ", ".join(text for _, text in missing)
                           + ": CUDA toolkit / cuDNN not moved",
                           "add a package source with those releases, or set cuda_version / cudnn_version to "
                           "releases the sources offer", "cuda_version")
    return None


def _holds(installed: Mapping[str, str | None], holds: Sequence[str], old_pin: str | None, target: str,
           replaced: Sequence[str], stack_install: Mapping[str, str], moved_held: Sequence[str],
           driver: Mapping[str, str]) -> tuple[str, ...]:
    """Held afterwards: what was held (the new version lock for the old one), less a CUDA toolkit
    / cuDNN package replaced by its new name (or gone since the manifest held it); with
    driver_hold, what moves of the CUDA toolkit / cuDNN (a toolkit's components named without a
    version too, as all.py holds them)."""
    hold = set(holds)
    if old_pin and old_pin in hold:
        hold.discard(old_pin)
        hold.add(f"nvidia-driver-pinning-{target}")
    kept = {p for p in hold - set(replaced) if installed.get(p) or p in stack_install or not _stack_family(p)}
    return tuple(sorted(kept | {p for p in moved_held if p not in driver}))


def recorded_holds(held: Sequence[str], recorded: Sequence[str]) -> list[str]:
    """What is held now and what the manifest recorded as held (held again, even if an
    interrupted change released it), but no version lock the host no longer holds."""
    return sorted(set(held) | {p for p in recorded if not PINNING_PACKAGE.match(p) or p in held})
