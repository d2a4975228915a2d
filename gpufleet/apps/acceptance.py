"""The acceptance of hosts before they take jobs (gpufleet/plans/acceptance.py judges; this runs).

One function, `accept(source, names, peer)`, shared by tools/rollout (per batch, before the
hosts are resumed) and tools/health --burn-in (a host or a group on its own):

1. read each host, all at once: its InfiniBand/RoCE ports (before), the performance probe with
   the tier's PyTorch runtime, its GPU health (and DCGM's diagnostic at acceptance_diag_level);
2. a multi-node all-reduce between each host and the known-good `peer`, one pair at a time (a
   failure is that host's, not the batch's): both ranks asked at once, NCCL on GPUs, gloo on the
   CPU where there is no CUDA device (the test hosts' simulated GPUs: said so in the finding);
3. the ports again (after), and the verdict per host.

Without a peer, the hosts of the group pair with the first of them (tools/health --burn-in of a
new rack): the first host is the reference, and the plan says no known-good peer was used.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from gpufleet.facts.gpu import GpuState
from gpufleet.facts.gpu_checks import AllReduceRank, PerfProbe
from gpufleet.facts.health import GpuHealth
from gpufleet.facts.network import IbCounters, IbPortCounters
from gpufleet.config.settings import Settings
from gpufleet.controller.inventory_source import InventorySource
from gpufleet.plans import acceptance as plan

#: Test double only: where the hosts' /sys is read for the InfiniBand ports. The e2e points it at
#: a fake sysfs tree inside each test host (a port that counts symbol errors); unset: /sys.
TEST_SYSFS_ROOT = "GPUFLEET_TEST_SYSFS_ROOT"


@dataclasses.dataclass
class HostReading:
    name: str
    address: str
    settings: Settings | None = None
    before: list[IbPortCounters] = dataclasses.field(default_factory=list)
    after: list[IbPortCounters] = dataclasses.field(default_factory=list)
    findings: list[plan.Finding] = dataclasses.field(default_factory=list)
    allreduce: plan.AllReduce | None = None
    error: str = ""


def sys_root() -> str:
    root = os.environ.get(TEST_SYSFS_ROOT, "")
    return root if root.startswith("/") and ".." not in root.split("/") else "/sys"


def ports(found: list[IbPortCounters]) -> list[plan.IbPort]:
    return [plan.IbPort(p.device, p.port, p.state or "", p.phys_state or "", tuple(sorted(p.counters.items())))
            for p in found]


def _python(settings: Settings) -> str:
    from gpufleet.plans.pytorch_runtime import runtime_of

    return runtime_of(settings).python or "python3"


def read_host(host: Any, reading: HostReading, probe: bool, diag_level: int | None = None) -> None:
    """Step 1 on one host (in its pyinfra context)."""
    from gpufleet.plans import perf
    from gpufleet.plans.health import assess
    from gpufleet.config.settings import host_settings

    settings = reading.settings = host_settings(host)
    reading.before = host.get_fact(IbCounters, sys_root=sys_root())
    gpus = host.get_fact(GpuState, processes=False)
    models = {g.index: g.name for g in getattr(gpus, "gpus", [])}
    if probe:
        lines = host.get_fact(PerfProbe, device="cuda", python=_python(settings))
        result = perf.parse_probe_output(lines, models, nvlink=settings.validate_nvlink == "required")
        reading.findings += plan.judge_probe(result, models, nvlink=settings.validate_nvlink == "required")
    diag = None
    level = settings.acceptance_diag_level if diag_level is None else diag_level
    if level:
        from gpufleet.facts.dcgm_diag import DcgmDiag

        diag = host.get_fact(DcgmDiag, level=level)
    verdict = assess(host.get_fact(GpuHealth), nvlink=settings.validate_nvlink, diag=diag)
    reading.findings.append(health_finding(verdict, level))


def health_finding(verdict: Any, level: int) -> plan.Finding:
    from gpufleet.plans.health import summary_line

    name = "GPU health" + (f" and DCGM diagnostic level {level}" if level else "")
    if verdict.needs_action:
        return plan.Finding(name, plan.FAIL, summary_line(verdict), "tools/health HOST names the GPU and the fix")
    if level and verdict.diag_status != "pass":
        return plan.Finding(name, plan.FAIL, f"DCGM diagnostic {verdict.diag_status}: {verdict.diag_detail}",
                            "run it again once the host is idle and DCGM runs (deploys/monitoring.py installs it)")
    return plan.Finding(name, plan.PASS, f"{len(verdict.gpus)} GPU(s), nothing needs action")


def pair(state: Any, config: Any, ref: Any, host: Any, settings: Settings, peer_label: str) -> plan.AllReduce:
    """The all-reduce between `host` (rank 0, the rendezvous) and the reference `ref` (rank 1),
    both at once. The host under test hosts the rendezvous, so the peer connects in to it: a new
    host's firewall that drops its training peers fails here (its own connections out would pass)."""
    import gevent
    from pyinfra.context import ctx_config, ctx_host

    address = str(host.data.get("ssh_hostname") or host.name)
    common = {"master": address, "port": settings.acceptance_port, "world": 2, "mib": settings.acceptance_allreduce_mib,
              "timeout": settings.acceptance_timeout}

    def rank(h: Any, r: int) -> list[str]:
        with ctx_config.use(config.copy()), ctx_host.use(h):
            lines: list[str] = h.get_fact(AllReduceRank, rank=r, python=_python(settings), **common)
            return lines

    jobs = [gevent.spawn(rank, host, 0), gevent.spawn(rank, ref, 1)]
    gevent.joinall(jobs, timeout=settings.acceptance_timeout + 60)
    job = jobs[0]
    if not job.ready():
        gevent.killall(jobs)
        return plan.AllReduce(peer_label, False, detail=f"no answer within {settings.acceptance_timeout + 60} s")
    if job.exception is not None:
        return plan.AllReduce(peer_label, False, detail=f"{type(job.exception).__name__}: {job.exception}")
    return plan.parse_allreduce(job.value, peer_label)


def accept(source: InventorySource | str, names: list[str], peer: str | None = None, probe: bool = True,
           say: Callable[[str], None] = lambda line: None, rollout: bool = False,
           diag_level: int | None = None) -> dict[str, plan.Verdict]:
    """{host: verdict} of the hosts `names`, the all-reduce with `peer` (a known-good host) or,
    without one, with the first of `names`. `diag_level`: DCGM's level (None: the tier's)."""
    from gpufleet import deploys
    from gpufleet.controller.fleet_read import connected_fleet, read_each

    src = source if isinstance(source, InventorySource) else InventorySource(str(source))
    everyone = [*names, *([peer] if peer and peer not in names else [])]
    src = dataclasses.replace(src, limit=everyone, exclude=[])
    readings: dict[str, HostReading] = {}
    with connected_fleet(src, max(1, len(everyone)), Path(deploys.FOLDER).parent, prefetch=False) as fleet:
        by_name = {h.name: h for h in fleet.hosts}

        def first(host: Any) -> dict[str, Any]:
            reading = readings[host.name] = HostReading(host.name, str(host.data.get("ssh_hostname") or host.name))
            read_host(host, reading, probe and host.name in names, diag_level)
            return {"status": "ok"}

        rows = read_each(fleet, first, len(everyone))
        ref_name = peer or names[0]
        for name in names:
            reading = readings.setdefault(name, HostReading(name, name))
            if rows.get(name, {}).get("status") != "ok":
                reading.error = str(rows.get(name, {}).get("error") or "not read")
                continue
            if name == ref_name or rows.get(ref_name, {}).get("status") != "ok" or reading.settings is None:
                continue
            label = ref_name if peer else f"{ref_name} (first of the group, not a known-good peer)"
            say(f"{name}: all-reduce with {ref_name}")
            reading.allreduce = pair(fleet.state, fleet.config, by_name[ref_name], by_name[name], reading.settings, label)

        def last(host: Any) -> dict[str, Any]:
            readings[host.name].after = host.get_fact(IbCounters, sys_root=sys_root())
            return {"status": "ok"}

        read_each(dataclasses.replace(fleet, hosts=[by_name[n] for n in names if n in by_name and not readings[n].error]),
                  last, len(names))
    out = {name: verdict_of(readings[name], peer, ref_name, alone=len(names) == 1) for name in names}
    for name, reading in readings.items():
        if rollout and name in out and reading.settings is not None and not reading.settings.acceptance_rollout:
            out[name] = plan.verdict(name, [plan.Finding("acceptance", plan.SKIP, "acceptance_rollout: false")])
    return out


def verdict_of(reading: HostReading, peer: str | None, ref_name: str, alone: bool) -> plan.Verdict:
    if reading.error or reading.settings is None:
        return plan.verdict(reading.name, [plan.Finding("host read", plan.FAIL, reading.error or "settings not read",
                                                       "bring the host back and re-run")])
    profile = reading.settings.nccl_profile
    if reading.name == ref_name and not alone:
        fabric = [plan.Finding("multi-node all-reduce with a known-good peer", plan.SKIP,
                               "this host is the reference the others of its group ran with")]
    elif reading.name == ref_name:
        fabric = plan.judge_allreduce(None, profile)   # the first host of a rollout: no peer yet
    else:
        fabric = plan.judge_allreduce(reading.allreduce, profile)
        if reading.allreduce is not None and not peer:
            fabric.append(plan.Finding("a known-good peer", plan.WARN, f"ran with {ref_name}, the first of the group",
                                       "name a host already in service with --peer"))
    return plan.verdict(reading.name, reading.findings, fabric, plan.judge_ports(ports(reading.before),
                                                                                ports(reading.after)))
