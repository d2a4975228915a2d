"""The gate's holds and OS checks (issue 46 item 4): an `apt-mark unhold` by hand FAILs naming the
package, a missing nvidia-driver-pinning-* warns; the OS against validate_os_release."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gpufleet.checks import validation as v
from gpufleet.facts.packages import HeldPackages, PackageVersions

pytestmark = pytest.mark.unit

DRIVER = {"nvidia-open": "580.126.09-1", "nvidia-driver-cuda": "580.126.09-1"}
STACK = {"cuda-toolkit-13-0": "13.0.2-1", "libcudnn9-cuda-13": "9.17.0.29-1"}
PIN = "nvidia-driver-pinning-580.126.09"


class Ctx(v.Context):
    def __init__(self, installed: dict[str, str], held: list[str], hold: bool = True, os: str = "debian-12",
                 planned: str = "debian-12", mismatch: str = "fail"):
        super().__init__(host=SimpleNamespace(name="gpu-1"), settings=SimpleNamespace(
            driver_hold=hold, validate_os_release=planned, tier_mismatch=mismatch))
        self.installed, self.held, self.os = installed, held, os

    def resolution(self):
        return SimpleNamespace(package_versions=DRIVER, stack_versions=STACK, pinning_package=PIN)

    def fact(self, cls, **kwargs):
        if cls is PackageVersions:
            return {p: self.installed.get(p) for p in kwargs["packages"]}
        assert cls is HeldPackages
        return sorted(self.held)


EVERYTHING = {**DRIVER, **STACK, PIN: "580.126.09-1"}


def test_held_stack_and_pinning_pass():
    result = v.stack_held(Ctx(EVERYTHING, [*DRIVER, *STACK]))
    assert result.status == "pass" and result.message == f"4 held, {PIN}", result


def test_an_unhold_by_hand_fails_naming_the_package():
    result = v.stack_held(Ctx(EVERYTHING, [p for p in [*DRIVER, *STACK] if p != "libcudnn9-cuda-13"]))
    assert result.status == "fail" and result.message == "not held: libcudnn9-cuda-13", result
    assert result.fix.startswith("apt-mark hold libcudnn9-cuda-13")


def test_a_missing_pinning_package_warns_naming_it():
    """A driver installed before gpufleet has no version lock, and all.py keeps a driver it would
    not install itself: a warning naming the package, not a gate failure (seen in the rollout e2e)."""
    installed = {k: val for k, val in EVERYTHING.items() if k != PIN}
    result = v.stack_held(Ctx(installed, [*DRIVER, *STACK]))
    assert result.status == "warn" and f"{PIN} is not installed" in result.message, result
    assert result.fix == f"apt-get install {PIN}"


def test_holding_off_skips():
    assert v.stack_held(Ctx(EVERYTHING, [], hold=False)).status == "skip"


def test_the_os_against_validate_os_release(monkeypatch):
    from gpufleet.config import hostfacts

    monkeypatch.setattr(hostfacts, "os_name", lambda host: "debian-13")
    moved = v.os_as_planned(Ctx(EVERYTHING, [], planned="debian-12"))
    assert moved.status == "fail" and moved.message.startswith("found debian-13, the tier is planned for debian-12")
    assert v.os_as_planned(Ctx(EVERYTHING, [], planned="debian-12", mismatch="warn")).status == "warn"
    assert v.os_as_planned(Ctx(EVERYTHING, [], planned="debian-13")).status == "pass"
