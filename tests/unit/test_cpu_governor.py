"""tuning_cpu_governor: the CpuFreq fact run against fake /sys trees, the core plan, the exact
commands and no-op messages of operations/cpu.governor, the boot record and the gate's check.
(Test hosts are containers without cpufreq: there the e2e test sees the no-op; here canned facts
prove what a host with cpufreq gets.)"""
from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
from pyinfra.context import ctx_host

from gpufleet.facts.cpu import CpuFreq, CpuFreqData, cpufreq_command, parse_cpufreq
from gpufleet.plans import tuning as t
from gpufleet.checks.validation import FAIL, PASS, SKIP, cpu_governor_as_set
from gpufleet.operations.cpu import governor
from tests.unit.test_facts_hosts import build_tree, run

pytestmark = pytest.mark.unit

# intel_pstate as Linux 6.x lays it out: cpuN/cpufreq is a symlink to the policy directory
PSTATE = [
    "cpufreq/policy0/scaling_governor = powersave",
    "cpufreq/policy0/scaling_available_governors = performance powersave",
    "cpufreq/policy1/scaling_governor = performance",
    "cpufreq/policy1/scaling_available_governors = performance powersave",
    "cpufreq/policy2/scaling_governor = powersave",
    "cpufreq/policy2/scaling_available_governors = performance powersave",
    "cpu0/cpufreq -> ../cpufreq/policy0",
    "cpu1/cpufreq -> ../cpufreq/policy1",
    "cpu10/cpufreq -> ../cpufreq/policy2",
    "dir cpu0/cpuidle",
    "cpu0/online = 1",
]
# a container or a VM without frequency scaling: CPUs, no cpufreq
NO_CPUFREQ = ["dir cpu0/cpuidle", "dir cpu1/topology", "possible = 0-1"]

ACPI = CpuFreqData(governors={"cpu0": "ondemand", "cpu1": "schedutil", "cpu2": "performance"},
                   available=["conservative", "ondemand", "userspace", "powersave", "performance", "schedutil"])


def test_fact_reads_every_cpu_with_cpufreq(tmp_path):
    root = build_tree(tmp_path / "cpu", PSTATE)
    data = CpuFreq().process(run(cpufreq_command(str(root))))
    assert data == CpuFreqData(governors={"cpu0": "powersave", "cpu1": "performance", "cpu10": "powersave"},
                               available=["performance", "powersave"])
    assert data.present


def test_fact_without_cpufreq_is_empty(tmp_path):
    root = build_tree(tmp_path / "cpu", NO_CPUFREQ)
    assert run(cpufreq_command(str(root))) == []
    assert not CpuFreq().process([]).present


def test_fact_keeps_only_governors_every_cpu_offers_and_rejects_garbage():
    data = parse_cpufreq(["cpu0|ondemand|ondemand performance", "cpu1|performance|performance"])
    assert data.available == ["performance"]
    with pytest.raises(ValueError, match="cpuN"):
        parse_cpufreq(["cpu0 performance"])


def test_plan_sets_only_the_cpus_not_on_the_governor():
    plan = t.plan_governor("performance", ACPI)
    assert plan.governor == "performance" and plan.cpus == ("cpu0", "cpu1")
    assert plan.files == ["/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
                          "/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor"]
    assert t.plan_governor("schedutil", ACPI).cpus == ("cpu0", "cpu2")


def test_plan_refuses_a_governor_the_host_does_not_offer():
    pstate = CpuFreqData(governors={"cpu0": "powersave"}, available=["performance", "powersave"])
    with pytest.raises(t.Refused) as refused:
        t.plan_governor("schedutil", pstate)
    assert str(refused.value) == ("key 'tuning_cpu_governor': this host's cpufreq driver offers no schedutil "
                                  "governor; allowed: performance | powersave | unmanaged")


def test_plan_leaves_hosts_without_cpufreq_and_unmanaged_alone():
    none = t.plan_governor("performance", CpuFreqData())
    assert none.governor is None and none.cpus == ()
    assert "no cpufreq on this host" in none.reason and "tuning_cpu_governor: performance" in none.reason
    assert t.plan_governor("unmanaged", ACPI).governor is None


class FakeHost:
    def __init__(self, cpufreq: CpuFreqData):
        self.cpufreq, self.noops, self.asked = cpufreq, [], []

    def get_fact(self, cls, *args, **kwargs):
        assert cls is CpuFreq
        self.asked.append(cls)
        return self.cpufreq

    def noop(self, description):
        self.noops.append(description)


def _operation(cpufreq: CpuFreqData, setting: str) -> tuple[list[str], list[str]]:
    fake = FakeHost(cpufreq)
    with ctx_host.use(fake):
        commands = [str(c) for c in governor._inner(setting=setting)]
    return commands, fake.noops


def test_operation_writes_the_governor_to_the_cpus_not_on_it():
    commands, noops = _operation(ACPI, "performance")
    assert commands == [
        "sh -c 'g=$1; shift; for f in \"$@\"; do echo \"$g\" > \"$f\"; done' gpufleet-cpu-governor performance "
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor /sys/devices/system/cpu/cpu1/cpufreq/scaling_governor"]
    assert noops == []


def test_the_command_really_sets_the_governor(tmp_path):
    """The exact command, run by sh against a fake cpufreq tree, leaves every CPU on the governor."""
    root = build_tree(tmp_path / "cpu", PSTATE)
    data = CpuFreq().process(run(cpufreq_command(str(root))))
    plan = t.plan_governor("performance", data)
    files = [str(root / cpu / "cpufreq" / "scaling_governor") for cpu in plan.cpus]
    subprocess.run(["sh", "-c", 'g=$1; shift; for f in "$@"; do echo "$g" > "$f"; done', "x", "performance", *files],
                   check=True)
    after = CpuFreq().process(run(cpufreq_command(str(root))))
    assert set(after.governors.values()) == {"performance"}
    assert t.plan_governor("performance", after).cpus == ()


def test_operation_noops_say_why():
    commands, noops = _operation(CpuFreqData(governors={"cpu0": "performance", "cpu1": "performance"},
                                             available=["performance", "powersave"]), "performance")
    assert commands == [] and noops == ["all 2 CPUs already run the performance governor"]
    commands, noops = _operation(CpuFreqData(), "performance")
    assert commands == [] and noops[0].startswith("no cpufreq on this host (no /sys/devices/system/cpu/cpu*/cpufreq")


def test_boot_record_is_a_tmpfiles_write_of_the_governor():
    text = t.render("etc/tmpfiles.d/gpufleet-cpu-governor.conf.j2", tier="hgx", governor="performance")
    assert text.splitlines()[-1] == "w /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor - - - - performance"
    unit = t.render("etc/systemd/system/gpufleet-cpu-governor.service.j2", tier="hgx", governor="performance")
    assert "ExecStart=/usr/bin/systemd-tmpfiles --create /etc/tmpfiles.d/gpufleet-cpu-governor.conf" in unit


@pytest.mark.parametrize("cpufreq, setting, status, message", [
    (ACPI, "performance", FAIL, "2 CPU(s) (cpu0, cpu1) run ondemand, schedutil, not performance"),
    (CpuFreqData(governors={"cpu0": "performance"}, available=["performance"]), "performance", PASS,
     "1 CPUs on performance"),
    (CpuFreqData(), "performance", SKIP, "no cpufreq on this host"),
    (ACPI, "unmanaged", SKIP, "tuning_cpu_governor: unmanaged"),
    (CpuFreqData(governors={"cpu0": "powersave"}, available=["powersave"]), "performance", FAIL,
     "offers no performance governor"),
])
def test_gate_checks_the_governor_against_the_same_plan(cpufreq, setting, status, message):
    ctx = SimpleNamespace(host=FakeHost(cpufreq), settings=SimpleNamespace(tuning_cpu_governor=setting))
    result = cpu_governor_as_set(ctx)
    assert result.status == status and message in result.message, result
