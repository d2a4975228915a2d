"""gpufleet/controller/factbatch.py: one `systemctl show` for many units answers each SystemdStatus /
SystemdEnabled exactly as that fact's own command would. The output was recorded on a Debian 12
test host (systemd 252) for: docker.service sshd nonexistent-unit.service sysstat.service.
(File facts are checked against real files in test_factcache.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus

from gpufleet.controller import factbatch
from gpufleet.controller import factcache

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


# The dpkg family: one `dpkg-query -W '*'` answers PackageVersions, StackPackages, HeldPackages
# and pyinfra's DebPackages. Each case under tests/unit/facts/dpkg_batch/ holds the section's
# output and, for each fact, its own command and what that command printed on the same host at
# the same moment: the answer built from the section must be the fact's own process() of it.
DPKG_CASES = Path(__file__).parent / "facts" / "dpkg_batch"


def _load(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", sorted(DPKG_CASES.glob("*.json")), ids=lambda p: p.stem)
def test_dpkg_batch_answers_each_fact_as_its_own_command(path):
    from tests.unit.test_fact_cases import as_json

    case = json.loads(path.read_text())
    assert factbatch.command("dpkg", []) == case["section_command"]  # still the command recorded
    missing, found = factbatch.split("dpkg", [], case["section_output"])
    assert case["facts"]
    for item in case["facts"]:
        cls, kwargs = _load(item["fact_class"]), item["kwargs"]
        assert factbatch.family(cls, kwargs) == "dpkg", item
        assert factcache._command_text(cls(), kwargs) == item["command"]  # its own command, as recorded
        known, value = factbatch.answer(cls(), factbatch.keys("dpkg", kwargs), missing, found)
        own = cls().process(item["output"]) if item["output"] else cls().default()
        assert known and value == own, item["fact_class"]
        assert as_json(value) == item["fact"], item["fact_class"]  # and what that is, spelled out


def _section(rows, status=0, dpkg=True, record=("cuda-toolkit-13-0 13.0.2",), end=True):
    mark = "::gpufleet-dpkg::"
    lines = [mark + "rows", *rows, f"{mark}status {status}", *([mark + "dpkg"] if dpkg else []),
             mark + "record", *record]
    return lines + [mark + "end"] if end else lines


ROWS = ["ii \tbash\tbash\t5.2.15-2+b8\tbase-files (>= 2.1.12), debianutils (>= 5.6-0.1)",
        "hi \tcuda-toolkit-13-0\tcuda-toolkit-13-0\t13.0.2-1\tcuda-compiler-13-0 (>= 13.0.2)",
        "ii \tcuda-compiler-13-0\tcuda-compiler-13-0\t13.0.2-1\t",
        "un \tdocker-ce\tdocker-ce\t\t",
        "ii \tlibc6\tlibc6:amd64\t2.36-9+deb12u14\tlibgcc-s1",
        "hn \tlibnccl2\tlibnccl2\t\t",
        "rc \told-thing\told-thing\t1.0-1\t"]


def test_dpkg_rows_give_each_fact_its_own_commands_output():
    from pyinfra.facts.deb import DebPackages

    from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages

    missing, found = factbatch.split("dpkg", [], _section(ROWS))
    asked = ["bash", "docker-ce", "nosuch", "cuda-toolkit-[0-9]*"]
    assert factbatch._dpkg_output(PackageVersions(), asked, found) == [
        "::gpufleet:: want bash docker-ce nosuch", "::gpufleet:: begin dpkg",
        "bash 5.2.15-2+b8 ii ", "cuda-toolkit-13-0 13.0.2-1 hi ", "docker-ce  un "]
    assert factbatch.answer(PackageVersions(), asked, missing, found) == (True, {
        "bash": "5.2.15-2+b8", "docker-ce": None, "nosuch": None, "cuda-toolkit-13-0": "13.0.2-1"})
    # held: a hold on a package that is not installed is not listed (no-argument dpkg-query)
    assert factbatch.answer(HeldPackages(), [], missing, found) == (True, ["cuda-toolkit-13-0"])
    # dpkg -l: the name as it shows it (libc6:amd64), pyinfra's pattern takes the arch off
    assert factbatch.answer(DebPackages(), [], missing, found) == (True, {
        "bash": {"5.2.15-2+b8"}, "cuda-toolkit-13-0": {"13.0.2-1"}, "cuda-compiler-13-0": {"13.0.2-1"},
        "libc6": {"2.36-9+deb12u14"}})
    known, stack = factbatch.answer(StackPackages(), ["cuda-toolkit-13-0"], missing, found)
    assert known and stack.recorded == {"cuda-toolkit-13-0": "13.0.2"} and stack.components == {
        "cuda-compiler-13-0": ["13.0.2-1", "13.0.2", False]}


@pytest.mark.parametrize("section", [
    _section(ROWS, status=2),                     # dpkg-query failed
    _section(ROWS, status=1),                     # '*' matched nothing
    _section(ROWS + ["ii \tbad name\tx\t1\t"]),  # a row of another shape
    _section(["ii \tbash\tbash\t5.2\tx", "::gpufleet-prefetch::x"]),
    _section(ROWS)[:-3],                          # cut short
])
def test_a_dpkg_section_it_cannot_vouch_for_answers_nothing(section):
    from pyinfra.facts.deb import DebPackages

    from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages

    missing, found = factbatch.split("dpkg", [], section)
    for fact, asked in ((PackageVersions(), ["bash"]), (StackPackages(), ["bash"]), (HeldPackages(), []),
                        (DebPackages(), [])):
        assert factbatch.answer(fact, asked, missing, found) == (False, None)


def test_without_dpkg_query_only_the_facts_that_then_print_nothing_are_answered():
    from pyinfra.facts.deb import DebPackages

    from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages

    mark = "::gpufleet-dpkg::"
    missing, found = factbatch.split("dpkg", [], [mark + "record", "cuda-toolkit-13-0 13.0.2", mark + "end"])
    assert factbatch.answer(PackageVersions(), ["bash"], missing, found) == (True, {"bash": None})
    known, stack = factbatch.answer(StackPackages(), ["cuda-toolkit-13-0"], missing, found)
    assert known and stack.installed == {"cuda-toolkit-13-0": None} and stack.record_found
    assert factbatch.answer(HeldPackages(), [], missing, found) == (False, None)  # apt-mark's, then
    assert factbatch.answer(DebPackages(), [], missing, found) == (False, None)   # pyinfra's own


def test_an_installed_package_without_a_version_leaves_dpkg_l_to_its_own_command():
    from pyinfra.facts.deb import DebPackages

    missing, found = factbatch.split("dpkg", [], _section(ROWS + ["ii \tweird\tweird\t\t"]))
    assert factbatch.answer(DebPackages(), [], missing, found) == (False, None)
    missing, found = factbatch.split("dpkg", [], _section(ROWS, end=False))  # record without its end
    from gpufleet.facts.packages import PackageVersions, StackPackages

    assert factbatch.answer(StackPackages(), ["bash"], missing, found) == (False, None)
    assert factbatch.answer(PackageVersions(), ["bash"], missing, found)[0]


@pytest.mark.parametrize("spec", ["cuda-toolkit-[0-9]*", "libcudnn[0-9]*", "cuda-*-13-0", "lib*-13-0",
                                  "nsight-systems-20*", "x?z", "a[a-c0-9.+]b", "bash", "g++"])
def test_globs_in_the_grammar_match_as_fnmatch_does(spec):
    import fnmatch

    pattern = factbatch._glob_regex(spec)
    assert pattern is not None
    for name in ["cuda-toolkit-13-0", "cuda-toolkit-x", "libcudnn9-cuda-13", "cuda-nvcc-13-0", "libcublas-13-0",
                 "nsight-systems-2025.3.2", "xyz", "x.z", "abb", "a.b", "a+b", "aBb", "bash", "g++", "gxx", "lib-13-0"]:
        assert bool(pattern.fullmatch(name)) == fnmatch.fnmatchcase(name, spec), (spec, name)


@pytest.mark.parametrize("spec", ["[!a]*", "a[z-a]", "a\\*", "a[-]", "*foo", "a[]", "libc6:amd64", "A*"])
def test_other_globs_keep_their_own_command(spec):
    from gpufleet.facts.packages import PackageVersions

    assert factbatch.family(PackageVersions, {"packages": ["bash", spec]}) is None


def test_a_component_pattern_outside_the_grammar_leaves_stackpackages_to_its_own_command(monkeypatch):
    from gpufleet.facts.packages import StackPackages

    missing, found = factbatch.split("dpkg", [], _section(ROWS))
    assert factbatch.answer(StackPackages(), ["cuda-toolkit-13-0"], missing, found)[0]
    # StackPackages' Depends walk asked with a glob whose match the batch cannot reproduce
    monkeypatch.setattr(factbatch, "stack_component_patterns", lambda packages: ["cuda-[!x]*-13-0"])
    assert factbatch.answer(StackPackages(), ["cuda-toolkit-13-0"], missing, found) == (False, None)


def test_which_dpkg_questions_join_the_batch():
    from pyinfra.facts.deb import DebPackages

    from gpufleet.facts.packages import HeldPackages, PackageChange, PackageVersions, StackPackages

    assert factbatch.family(PackageVersions, {"packages": ["bash", "libc6"]}) == "dpkg"
    assert factbatch.family(PackageVersions, {"packages": "bash"}) == "dpkg"
    assert factbatch.family(PackageVersions, {"packages": ["cuda-toolkit-[0-9]*"]}) == "dpkg"
    assert factbatch.family(PackageVersions, {"packages": []}) is None
    assert factbatch.family(StackPackages, {"packages": ["cuda-toolkit-13-0", "libcudnn[0-9]*"]}) == "dpkg"
    assert factbatch.family(StackPackages, {"packages": "cuda-toolkit-13-0"}) is None  # read as characters
    assert factbatch.family(HeldPackages, {}) == "dpkg" and factbatch.family(DebPackages, {}) == "dpkg"
    assert factbatch.family(PackageChange, {}) is None  # dpkg --audit reads more than the status file
    # the command holds no name: the same text whatever was asked
    assert factbatch.command("dpkg", ["bash"]) == factbatch.command("dpkg", ["x", "cuda-*-13-0"])
