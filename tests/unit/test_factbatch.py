"""gpufleet/factbatch.py: one `systemctl show` for many units answers each SystemdStatus /
SystemdEnabled exactly as that fact's own command would. The output was recorded on a Debian 12
test host (systemd 252) for: docker.service sshd nonexistent-unit.service sysstat.service.
(File facts are checked against real files in test_factcache.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from gpufleet import factbatch

pytestmark = pytest.mark.unit
UNITS = ["docker.service", "sshd", "nonexistent-unit.service", "sysstat.service"]
SHOW = (Path(__file__).parents[1] / "fixtures/systemd/show-4-units.txt").read_text().splitlines()
# What `systemctl show --all --property Id --property SubState <unit>` printed for each alone
ALONE = {"docker.service": ["Id=docker.service", "SubState=running"],
         "sshd": ["Id=ssh.service", "SubState=running"],
         "nonexistent-unit.service": ["Id=nonexistent-unit.service", "SubState=dead"],
         "sysstat.service": ["Id=sysstat.service", "SubState=exited"]}


@pytest.mark.parametrize("asked", [["sshd"], ["docker.service", "sysstat.service"], ["nonexistent-unit.service"]])
def test_each_fact_gets_its_own_answer(asked):
    missing, found = factbatch.split("systemctl", UNITS, SHOW)
    known, status = factbatch.answer(SystemdStatus(), asked, missing, found)
    assert known
    expected = SystemdStatus().process([line for unit in asked for line in [*ALONE[unit], ""]])
    assert status == expected
    known, enabled = factbatch.answer(SystemdEnabled(), asked, missing, found)
    assert known and set(enabled) == set(expected)


def test_answers_read_the_right_block():
    missing, found = factbatch.split("systemctl", UNITS, SHOW)
    assert factbatch.answer(SystemdStatus(), ["sshd"], missing, found)[1] == {"ssh.service": True}
    assert factbatch.answer(SystemdEnabled(), ["nonexistent-unit.service"], missing, found)[1] == {
        "nonexistent-unit.service": False}
    assert factbatch.answer(SystemdStatus(), ["sysstat.service"], missing, found)[1] == {"sysstat.service": True}


def test_a_block_count_that_does_not_match_trusts_nothing():
    missing, found = factbatch.split("systemctl", UNITS + ["one-more.service"], SHOW)
    assert factbatch.answer(SystemdStatus(), ["sshd"], missing, found) == (False, None)


def test_only_plain_questions_join_a_batch():
    assert factbatch.family(SystemdStatus, {"services": ["a.service"], "machine": None}) == "systemctl"
    assert factbatch.family(SystemdStatus, {"services": ["a.service"], "user_mode": True}) is None
    assert factbatch.family(SystemdStatus, {"services": ["a.service"], "machine": "box"}) is None
    assert factbatch.family(SystemdStatus, {"services": None}) is None  # every unit: its own command
    assert factbatch.family(File, {"path": "/etc/x"}) == "stat"
    assert factbatch.family(File, {"path": "~/x"}) is None
    assert factbatch.family(Sha1File, {"path": "/etc/x"}) == "sha1sum"


# `dpkg-query -W -f='${Package} ${Version} ${db:Status-Abbrev}\n' bash coreutils libc6
# nosuch-gpufleet-pkg` on a Debian 12 machine (the unknown name prints nothing on stdout)
DPKG = ["bash 5.2.15-2+b8 ii ", "coreutils 9.1-1 ii ", "libc6 2.36-9+deb12u14 ii "]
PACKAGES = ["bash", "coreutils", "libc6", "nosuch-gpufleet-pkg"]


@pytest.mark.parametrize("asked", [["bash"], ["libc6", "nosuch-gpufleet-pkg"], ["coreutils", "bash"]])
def test_package_versions_get_their_own_packages_lines(asked):
    from gpufleet.facts.packages import PackageVersions

    missing, found = factbatch.split("dpkg-query", PACKAGES, DPKG)
    known, versions = factbatch.answer(PackageVersions(), asked, missing, found)
    own = [line for line in DPKG if line.split()[0] in asked]  # what its own dpkg-query prints
    assert known and versions == PackageVersions().process(
        ["::gpufleet:: want " + " ".join(asked), "::gpufleet:: begin dpkg", *own])
    assert set(versions) == set(asked)
    assert versions.get("nosuch-gpufleet-pkg", "absent") in (None, "absent")
    assert versions.get("bash", "2") == "2" or versions["bash"] == "5.2.15-2+b8"


def test_package_versions_with_an_architecture_or_a_glob_keep_their_own_command():
    from gpufleet.facts.packages import PackageVersions

    assert factbatch.family(PackageVersions, {"packages": ["bash", "libc6"]}) == "dpkg-query"
    assert factbatch.family(PackageVersions, {"packages": "bash"}) == "dpkg-query"
    # dpkg-query prints "libc6 ..." for libc6:amd64, and other names for a glob
    assert factbatch.family(PackageVersions, {"packages": ["libc6:amd64"]}) is None
    assert factbatch.family(PackageVersions, {"packages": ["cuda-toolkit-[0-9]*"]}) is None
    assert factbatch.family(PackageVersions, {"packages": []}) is None
