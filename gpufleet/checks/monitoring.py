"""The validation gate, monitoring: the exporters serve metrics."""
from __future__ import annotations

from typing import Any

from pyinfra.facts.systemd import SystemdStatus

from gpufleet.checks.gate import FAIL, PASS, SKIP, Context, Result, check
from gpufleet.facts.monitoring import MetricsEndpoint


def exporter_check_name(label: str) -> str:
    return f"the {label} serves metrics"


@check("monitoring")
def exporters_serve_metrics(ctx: Context) -> list[Result]:
    """Each exporter the tier turns on answers on the host with real metrics (curl on the host,
    to the address it is bound to); the DCGM exporter with a GPU temperature for every GPU."""
    from gpufleet.plans import monitoring

    found = monitoring.exporters(ctx.settings)
    if not found:
        return [Result("monitoring", "the tier's Prometheus exporters serve metrics", SKIP,
                       "monitoring_node_exporter and monitoring_dcgm_exporter are false")]
    results = []
    for exporter in found:
        name = exporter_check_name(exporter.label)
        url = monitoring.local_url(ctx.settings, exporter)
        fix = (f"systemctl status {exporter.service} and journalctl -u {exporter.service}; "
               "deploys/monitoring.py installs and starts it")
        dcgm = exporter.key == "monitoring_dcgm_exporter"
        if dcgm and not (ctx.gpu.ok and ctx.gpu.gpus):
            results.append(Result("monitoring", name, SKIP, f"nvidia-smi: {ctx.gpu.status} (DCGM needs a working driver)"))
            continue
        if ctx.scrape_skip:
            results.append(_exporter_not_scraped(ctx, exporter, name, fix))
            continue
        data = ctx.fact(MetricsEndpoint, url=url, family=exporter.family, sample=exporter.sample)
        if data.status == "no-curl":
            results.append(Result("monitoring", name, FAIL, "curl is not installed on the host",
                                  "apt-get install curl (deploys/monitoring.py installs it)"))
            continue
        if data.status != "ok":
            results.append(Result("monitoring", name, FAIL, f"{url}: {data.error}", fix))
            continue
        if not data.samples:
            results.append(Result("monitoring", name, FAIL, f"{url} answered without any {exporter.family}* metric", fix))
            continue
        found_text = f"{url}: {data.samples} {exporter.family}* samples"
        if dcgm:
            want = sorted(str(g.index) for g in ctx.gpu.gpus)
            have = sorted(set(data.label_values("gpu")))
            if have != want:
                results.append(Result("monitoring", name, FAIL, f"{found_text}, but {exporter.sample} for GPU "
                                      f"{', '.join(have) or 'none'} of {', '.join(want)}",
                                      f"systemctl status {monitoring.DCGM_SERVICE} {exporter.service}; dcgmi discovery -l"))
                continue
            found_text += f", {exporter.sample} for {len(want)} GPUs"
        results.append(Result("monitoring", name, PASS, found_text))
    return results


def _exporter_not_scraped(ctx: Context, exporter: Any, name: str, fix: str) -> Result:
    """A run that does not scrape (all.py's re-run that changed nothing): systemd must still
    report the exporter running. On that run deploys/monitoring.py read this very fact (a
    stopped exporter would have been started, and the run then scrapes), so it costs no command."""
    running = ctx.fact(SystemdStatus, services=[exporter.service]).get(exporter.service)
    if not running:
        return Result("monitoring", name, FAIL, f"{exporter.service} is not running (systemd)", fix)
    return Result("monitoring", name, SKIP, f"not scraped: {ctx.scrape_skip}; systemd reports {exporter.service} running")


