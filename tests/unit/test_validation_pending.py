"""The validation gate on a host whose driver the inventory has moved on from: a rollout's job
(WARN), a failure only when the operator asks (driver_upgrade_pending: fail) or when all.py
itself should have changed it (driver_upgrade_in_place)."""
from types import SimpleNamespace

from gpufleet.checks import validation as v


class Ctx(v.Context):
    def __init__(self, installed, loaded, want, **settings):
        self.settings = SimpleNamespace(**{"driver_upgrade_in_place": False, "driver_upgrade_pending": "report",
                                           **settings})
        self._driver = SimpleNamespace(module_version=loaded, userspace_version=installed, module_flavour="open")
        self._want = want

    @property
    def driver(self):
        return self._driver

    def resolution(self):
        return SimpleNamespace(driver_version=self._want)


def test_pending_upgrade_is_a_warning_naming_tools_rollout():
    r = v.driver_versions_agree(Ctx("580.95.05", "580.95.05", "580.126.09"))
    assert r.status == v.WARN
    assert "driver upgrade pending: 580.95.05 -> 580.126.09, run tools/rollout" in r.message
    assert "tools/rollout INVENTORY" in r.fix


def test_pending_upgrade_fails_when_asked_or_when_all_py_may_change_it():
    assert v.driver_versions_agree(Ctx("580.95.05", "580.95.05", "580.126.09",
                                       driver_upgrade_pending="fail")).status == v.FAIL
    r = v.driver_versions_agree(Ctx("580.95.05", "580.95.05", "580.126.09", driver_upgrade_in_place=True))
    assert r.status == v.FAIL and r.fix == v.FIX_DEPLOY


def test_agreeing_and_missing_drivers_are_unchanged():
    assert v.driver_versions_agree(Ctx("580.126.09", "580.126.09", "580.126.09")).status == v.PASS
    assert v.driver_versions_agree(Ctx(None, None, "580.126.09")).status == v.FAIL   # not installed: all.py's job
