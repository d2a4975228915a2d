"""Issue 17 item 1: the CUDA toolkit and cuDNN resolve to exact package releases, from data with
sources, whatever precise form the user writes; the gate and the deploy compare whole releases."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from gpufleet.plans.driver import stack_drift, stack_groups, stack_pending
from gpufleet.facts.packages import STACK_RECORD, StackPackages, StackPackagesData
from gpufleet.catalog import cuda_stack as cs
from gpufleet.checks import validation as v
from gpufleet.catalog.compat import compat_data
from gpufleet.errors import Incompatible
from gpufleet.config.resolver import exact_cuda, exact_cudnn, resolve
from gpufleet.config.schema import BadValue, _check_cuda, _check_cudnn

pytestmark = pytest.mark.unit

DEBIAN = "debian-12"
H100, A100, B200, V100 = "0x2330", "0x20b0", "0x2901", "0x1db1"


def wish(**overrides) -> dict:
    return {"driver_source": "nvidia", "driver_branch": "580", "driver_version": "auto", "driver_flavour": "auto",
            "cuda_version": "none", "cuda_driver_compat": "toolkit", "cudnn_version": "none",
            "clock_policy": "default", **overrides}


@pytest.mark.parametrize("written", ["13.0", "13.0.2"])
@pytest.mark.parametrize("cudnn", ["9.17", "9.17.0"])
def test_precise_forms_resolve_to_the_same_exact_releases(written, cudnn):
    res = resolve([H100], wish(cuda_version=written, cudnn_version=cudnn), DEBIAN)
    assert (res.cuda_version, res.cuda_package, res.cuda_release) == ("13.0", "cuda-toolkit-13-0", "13.0.2")
    assert (res.cudnn_version, res.cudnn_release) == ("9.17.0", "9.17.0.29")
    assert res.cudnn_packages == ("libcudnn9-cuda-13", "libcudnn9-dev-cuda-13", "libcudnn9-headers-cuda-13")
    assert res.stack_versions == {"cuda-toolkit-13-0": "13.0.2", "libcudnn9-cuda-13": "9.17.0.29",
                                  "libcudnn9-dev-cuda-13": "9.17.0.29", "libcudnn9-headers-cuda-13": "9.17.0.29"}
    assert res.describe()["cuda"] == "13.0 (cuda-toolkit-13-0) at 13.0.2"
    assert res.describe()["cudnn"].endswith(" at 9.17.0.29")


@pytest.mark.parametrize("cuda, release", [("13.2", "13.2.2"), ("13.1", "13.1.1"), ("12.9", "12.9.1"),
                                           ("12.8", "12.8.1"), ("12.6", "12.6.3"), ("12.2", "12.2.2"),
                                           ("11.8", "11.8.0")])
def test_cuda_release_is_the_update_whose_driver_was_checked(cuda, release):
    # S1 Table 3: the toolkit driver of each minor is its newest update's; that update is pinned
    data = compat_data()
    assert data.cuda_releases[cuda].release == release
    branch, version = {"13.2": ("595", "595.71.05"), "13.1": ("590", "auto")}.get(cuda, ("580", "auto"))
    res = resolve([H100], wish(driver_branch=branch, driver_version=version, cuda_version=cuda), DEBIAN)
    assert res.cuda_release == release and res.stack_versions == {res.cuda_package: release}


@pytest.mark.parametrize("gpus, cuda, cudnn, build, package", [
    ([H100], "12.8", "9.10", "9.10.2.21", "libcudnn9-cuda-12"),
    ([A100], "11.8", "9.10.2", "9.10.2.21", "libcudnn9-cuda-11"),
    ([A100], "12.6", "9.5", "9.5.1.17", "libcudnn9-cuda-12"),
    ([V100], "12.2", "9.0.0", "9.0.0.312", "libcudnn9-cuda-12"),
    ([B200], "12.8", "9.10.2", "9.10.2.21", "libcudnn9-cuda-12"),
])
def test_cudnn_build_per_release_and_cuda_major(gpus, cuda, cudnn, build, package):
    res = resolve(gpus, wish(cuda_version=cuda, cudnn_version=cudnn), DEBIAN)
    assert res.cudnn_release == build and res.cudnn_packages[0] == package
    assert {res.stack_versions[p] for p in res.cudnn_packages} == {build}


def test_a_release_not_in_the_data_is_refused_with_what_is_allowed():
    with pytest.raises(Incompatible) as info:
        resolve([H100], wish(cuda_version="13.0.7"), DEBIAN)  # no such update in NVIDIA's Table 3
    assert info.value.key == "cuda_version" and "13.0.0, 13.0.1, 13.0.2" in info.value.reason
    assert "13.0" in info.value.allowed and "13.0.1" in info.value.allowed
    with pytest.raises(Incompatible) as info:
        resolve([H100], wish(cuda_version="13.0", cudnn_version="9.16"), DEBIAN)
    assert info.value.key == "cudnn_version" and "9.17.0" in info.value.allowed
    assert exact_cuda("12.8.1", compat_data()) == "12.8" and exact_cudnn("9.10", compat_data()) == "9.10.2"


def test_a_cudnn_release_without_a_package_build_is_refused():
    data = compat_data()
    stripped = dataclasses.replace(data, cudnn_builds=tuple(
        dataclasses.replace(b, package_version=None) if b.version == "9.17.0" else b for b in data.cudnn_builds))
    with pytest.raises(Incompatible) as info:
        resolve([H100], wish(cuda_version="13.0", cudnn_version="9.17.0"), DEBIAN, data=stripped)
    assert info.value.key == "cudnn_version" and "no known package build" in info.value.reason


def test_schema_accepts_the_precise_forms():
    # an update is kept as written: the resolver installs exactly it (13.0 = the newest the driver takes)
    assert _check_cuda("13.0.2") == "13.0.2" and _check_cuda("13.0.1") == "13.0.1" and _check_cuda("13.0") == "13.0"
    assert _check_cudnn("9.17") == "9.17.0"
    with pytest.raises(BadValue) as bad:
        _check_cuda("13.0.7")
    assert bad.value.allowed == "none, 13.0, 13.0.2, 13.0.1, 13.0.0"


def test_distro_cuda_is_not_pinned_to_an_nvidia_release():
    res = resolve([A100], wish(driver_source="distro", driver_branch="auto", cuda_version="11.8"), DEBIAN)
    assert res.cuda_package == "nvidia-cuda-toolkit" and res.cuda_release is None and res.stack_versions == {}


def test_exact_compares_the_whole_upstream_version():
    assert cs.is_exact("9.17.0.29-1", "9.17.0.29") and cs.is_exact("1:13.0.2-1", "13.0.2")
    for other in ("9.17.0.30-1", "9.17.1.4-1", "9.17.0.29", "", None):
        assert not cs.is_exact(other, "9.17.0.29")
    assert cs.upstream_of("9.16.0.29-1") == "9.16.0.29"


def _res(cuda="13.0", cudnn="9.17.0"):
    return resolve([H100], wish(cuda_version=cuda, cudnn_version=cudnn), DEBIAN)


def test_pending_when_an_installed_release_differs_and_only_then():
    res = _res()
    assert set(stack_groups(res)) == {"CUDA toolkit", "cuDNN"}
    exact = {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.17.0.29-1" for p in res.cudnn_packages}}
    assert stack_pending(res, exact) == {}
    assert stack_pending(res, {}) == {}  # nothing installed: a first install, not an upgrade
    by_hand = {**exact, "libcudnn9-dev-cuda-13": "9.16.0.29-1"}
    assert stack_pending(res, by_hand) == {"cuDNN": ("9.16.0.29", "9.17.0.29")}  # no record: pending
    older_toolkit = {**exact, "cuda-toolkit-13-0": "13.0.1-1"}
    assert stack_pending(res, older_toolkit) == {"CUDA toolkit": ("13.0.1", "13.0.2")}


def test_the_record_tells_an_inventory_change_from_a_hand_change():
    res = _res()
    older = {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.16.0.29-1" for p in res.cudnn_packages}}
    # gpufleet installed 9.16.0.29, the inventory now resolves to 9.17.0.29: pending
    recorded_old = {"cuda-toolkit-13-0": "13.0.2", **{p: "9.16.0.29" for p in res.cudnn_packages}}
    assert stack_pending(res, older, recorded_old) == {"cuDNN": ("9.16.0.29", "9.17.0.29")}
    assert stack_drift(res, older, recorded_old) == {}
    # gpufleet installed 9.17.0.29, someone put 9.16.0.29 back: drift, not pending
    recorded_new = {"cuda-toolkit-13-0": "13.0.2", **{p: "9.17.0.29" for p in res.cudnn_packages}}
    assert stack_pending(res, older, recorded_new) == {}
    drift = stack_drift(res, older, recorded_new)["cuDNN"]
    assert len(drift) == 3 and drift[0] == ("libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was changed by hand: "
                                            "gpufleet installed 9.17.0.29")


class Ctx(v.Context):
    def __init__(self, installed, res, recorded=None, **settings):
        self.settings = SimpleNamespace(**{"driver_upgrade_pending": "report", "driver_upgrade_in_place": False,
                                           **settings})
        self._installed, self._res, self._recorded = installed, res, recorded or {}

    def fact(self, cls, **kwargs):
        # as dpkg-query answers the names and the family globs: every installed member too
        names = {p: None for p in kwargs["packages"] if "*" not in p}
        return StackPackagesData({**names, **self._installed}, self._recorded, bool(self._recorded))

    def resolution(self):
        return self._res


def test_gate_fails_a_mismatch_with_its_fix_and_passes_exact_releases():
    res = _res()
    exact = {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.17.0.29-1" for p in res.cudnn_packages}}
    recorded = {p: cs.upstream_of(ver) for p, ver in exact.items()}
    ok = v.cuda_cudnn_releases_exact(Ctx(exact, res, recorded))
    assert ok.status == v.PASS and ok.message == "CUDA 13.0.2, cuDNN 9.17.0.29"
    bad = v.cuda_cudnn_releases_exact(Ctx({**exact, "libcudnn9-cuda-13": "9.16.0.29-1"}, res, recorded))
    assert bad.status == v.FAIL and "libcudnn9-cuda-13 9.16.0.29 (resolved 9.17.0.29) was changed by hand" in bad.message
    assert bad.fix == v.FIX_STACK_DRIFT and "tools/rollout" in bad.fix
    newer = v.cuda_cudnn_releases_exact(Ctx({**exact, "cuda-toolkit-13-0": "13.0.3-1"}, res, recorded))
    assert newer.status == v.FAIL and "cuda-toolkit-13-0 13.0.3 (resolved 13.0.2)" in newer.message
    missing = v.cuda_cudnn_releases_exact(Ctx({}, res))
    assert missing.status == v.FAIL and missing.fix == v.FIX_DEPLOY
    none = v.cuda_cudnn_releases_exact(Ctx({}, _res(cuda="none", cudnn="none")))
    assert none.status == v.SKIP


def test_gate_warns_a_pending_upgrade_like_the_driver():
    res = _res()
    older = {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.16.0.29-1" for p in res.cudnn_packages}}
    recorded = {p: cs.upstream_of(ver) for p, ver in older.items()}
    for args in ((older, res, recorded), (older, res)):   # recorded by gpufleet, or no record at all
        warn = v.cuda_cudnn_releases_exact(Ctx(*args))
        assert warn.status == v.WARN, warn
        assert warn.message == "cuDNN upgrade pending: 9.16.0.29 -> 9.17.0.29, run tools/rollout"
        assert warn.fix == v.FIX_ROLLOUT
    fail = v.cuda_cudnn_releases_exact(Ctx(older, res, recorded, driver_upgrade_pending="fail"))
    assert fail.status == v.FAIL and fail.fix == v.FIX_ROLLOUT
    in_place = v.cuda_cudnn_releases_exact(Ctx(older, res, recorded, driver_upgrade_in_place=True))
    assert in_place.status == v.FAIL and in_place.fix.startswith(v.FIX_DEPLOY)


def test_a_changed_package_name_is_pending_not_a_second_install():
    res = _res(cuda="12.8", cudnn="9.10")   # the host has CUDA 13.0 and cuDNN for CUDA 13
    on_13 = {"cuda-toolkit-13-0": "13.0.2-1", **{p: "9.17.0.29-1" for p in _res().cudnn_packages}}
    assert stack_pending(res, on_13) == {
        "CUDA toolkit": ("cuda-toolkit-13-0 13.0.2", "cuda-toolkit-12-8 12.8.1"),
        "cuDNN": ("libcudnn9-cuda-13 9.17.0.29", "libcudnn9-cuda-12 9.10.2.21")}
    warn = v.cuda_cudnn_releases_exact(Ctx(on_13, res))
    assert warn.status == v.WARN and warn.fix == v.FIX_ROLLOUT
    assert warn.message == ("CUDA toolkit upgrade pending: cuda-toolkit-13-0 13.0.2 -> cuda-toolkit-12-8 12.8.1, run "
                            "tools/rollout; cuDNN upgrade pending: libcudnn9-cuda-13 9.17.0.29 -> libcudnn9-cuda-12 "
                            "9.10.2.21, run tools/rollout")
    assert stack_pending(res, {}) == {}   # nothing of either family: a first install
    assert cs.stack_renames(res.stack_versions, {"cuda-toolkit-13-0-config-common": "13.0.96-1"}) == {}


def test_stack_packages_fact_reads_versions_and_the_record():
    fact = StackPackages()
    command = fact.command(["libcudnn9-cuda-13", "cuda-toolkit-13-0"])
    assert "dpkg-query" in command and STACK_RECORD in command
    out = ["::gpufleet:: want libcudnn9-cuda-13 cuda-toolkit-13-0", "::gpufleet:: begin dpkg",
           "libcudnn9-cuda-13 9.16.0.29-1 hi ", "::gpufleet:: begin record",
           "# Managed by gpufleet: the CUDA toolkit and cuDNN releases it installed. Do not edit.",
           "libcudnn9-cuda-13 9.17.0.29", "cuda-toolkit-13-0 13.0.2"]
    data = fact.process(out)
    assert data.installed == {"libcudnn9-cuda-13": "9.16.0.29-1", "cuda-toolkit-13-0": None}
    assert data.recorded == {"libcudnn9-cuda-13": "9.17.0.29", "cuda-toolkit-13-0": "13.0.2"} and data.record_found
    empty = fact.process(out[:4])
    assert empty.recorded == {} and not empty.record_found
    with pytest.raises(ValueError):
        fact.process([*out[:4], "libcudnn9-cuda-13 $(reboot)"])


def test_tools_compat_names_the_exact_releases(capsys):
    from gpufleet.apps.compat import main

    assert main(["--gpu", "NVIDIA H200", "--os", "ubuntu-24.04", "--cuda", "13.0.2", "--cudnn", "9.17", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["cuda"] == {"version": "13.0", "package": "cuda-toolkit-13-0", "release": "13.0.2"}
    assert out["cudnn"]["release"] == "9.17.0.29" and out["cudnn"]["packages"][1] == "libcudnn9-dev-cuda-13"
    assert main(["--gpu", "NVIDIA H200", "--os", "ubuntu-24.04", "--cuda", "13.0", "--cudnn", "9.17.0"]) == 0
    text = capsys.readouterr().out
    assert "cuda:    13.0 (cuda-toolkit-13-0) at 13.0.2" in text and "at 9.17.0.29" in text
