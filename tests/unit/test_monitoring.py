"""The exporters' settings, listen addresses, firewall rules, the endpoint fact and the gate's
check: pure parts, on settings from the real tiers and on the fact's real output shape."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from pyinfra.api import StringCommand
from pyinfra.facts.systemd import SystemdStatus

from gpufleet.plans.hardening import firewall_plan
from gpufleet.facts.monitoring import MetricsEndpoint, parse_metrics_endpoint
from gpufleet.plans import monitoring as m
from gpufleet.checks import validation as v
from gpufleet.config.settings import validate_inventory
from tests.unit.nft_check import assert_nft_accepts
from tests.unit.test_settings import inventory, problems_of


def settings(**data):
    from gpufleet.config.settings import host_settings

    return host_settings(inventory({"tier": "research", **data}).get_host("gpu-a01"))


def test_research_and_hgx_turn_both_exporters_on_and_dev_none():
    s = settings()
    assert [(e.label, e.port, e.service) for e in m.exporters(s)] == [
        ("node exporter", 9100, "prometheus-node-exporter.service"),
        ("DCGM exporter", 9400, "nvidia-dcgm-exporter.service")]
    assert m.exporters(settings(tier="hgx")) and not m.exporters(settings(tier="dev"))
    assert s.plan is not None and "datacenter-gpu-manager-4-core" in s.plan.dcgm_packages  # DCGM with the driver


SCRAPERS = ["10.0.0.0/24", "fd00::/64"]


@pytest.mark.parametrize("listen,node,url,rule", [
    ("all", ":9100", "http://127.0.0.1:9100/metrics",
     {"port": "9100", "proto": "tcp", "comment": "node exporter", "saddr": "10.0.0.0/24", "daddr": ""}),
    ("10.0.0.5", "10.0.0.5:9100", "http://10.0.0.5:9100/metrics",
     {"port": "9100", "proto": "tcp", "comment": "node exporter", "saddr": "10.0.0.0/24", "daddr": "10.0.0.5"}),
    ("fd00::5", "[fd00::5]:9100", "http://[fd00::5]:9100/metrics",
     {"port": "9100", "proto": "tcp", "comment": "node exporter", "saddr": "fd00::/64", "daddr": "fd00::5"}),
    ("127.0.0.1", "127.0.0.1:9100", "http://127.0.0.1:9100/metrics", None),
])
def test_listen_address_binds_the_exporters_and_the_firewall_alike(listen, node, url, rule):
    s = settings(monitoring_listen_address=listen, monitoring_allowed_cidrs=SCRAPERS)
    node_exporter = m.exporters(s)[0]
    assert m.listen(s, 9100) == node
    assert m.local_url(s, node_exporter) == url
    assert f'ARGS="--web.listen-address={node}"' in m.node_exporter_defaults(s)
    assert f"DCGM_EXPORTER_LISTEN={m.listen(s, 9400)}" in m.dcgm_exporter_dropin(s)
    assert "DCGM_REMOTE_HOSTENGINE_INFO=localhost:5555" in m.dcgm_exporter_dropin(s)
    assert m.firewall_rules(s)[:1] == ([rule] if rule else [])


def test_the_exporters_are_open_only_to_the_scrapers_networks():
    # by default to no other network: the host itself (lo) and the trusted peers reach every port
    assert m.firewall_rules(settings()) == []
    # one rule per exporter and network; a listen address takes only its own family's networks
    both = m.firewall_rules(settings(monitoring_allowed_cidrs=SCRAPERS))
    assert [(r["port"], r["saddr"]) for r in both] == [("9100", "10.0.0.0/24"), ("9100", "fd00::/64"),
                                                       ("9400", "10.0.0.0/24"), ("9400", "fd00::/64")]
    v4 = m.firewall_rules(settings(monitoring_allowed_cidrs=SCRAPERS, monitoring_listen_address="10.0.0.5"))
    assert {r["saddr"] for r in v4} == {"10.0.0.0/24"}


def test_the_firewall_opens_exactly_the_ports_of_the_exporters_that_are_on():
    def table(**data):
        return firewall_plan(settings(**data), [22]).rules()

    assert "9100" not in table() and "9400" not in table()    # no scraper named: no network but lo
    text = table(monitoring_allowed_cidrs=SCRAPERS)
    assert 'ip saddr 10.0.0.0/24 tcp dport 9100 accept comment "node exporter"' in text
    assert 'ip6 saddr fd00::/64 tcp dport 9400 accept comment "DCGM exporter"' in text
    text = table(monitoring_dcgm_exporter=False, monitoring_node_exporter_port=9101, monitoring_allowed_cidrs=SCRAPERS)
    assert "dport 9101 accept" in text and "9400" not in text and "9100" not in text
    text = table(monitoring_listen_address="10.0.0.5", monitoring_allowed_cidrs=SCRAPERS)
    assert 'ip saddr 10.0.0.0/24 ip daddr 10.0.0.5 tcp dport 9100 accept comment "node exporter"' in text
    assert "fd00::/64" not in text
    text = table(monitoring_listen_address="fd00::5", monitoring_allowed_cidrs=SCRAPERS)
    assert 'ip6 saddr fd00::/64 ip6 daddr fd00::5 tcp dport 9400 accept' in text
    text = table(monitoring_listen_address="127.0.0.1", monitoring_allowed_cidrs=SCRAPERS)
    assert "9100" not in text and "9400" not in text
    # an operator who still lists the port keeps one rule, open to all
    text = table(firewall_open_ports=["22/tcp", "9100/tcp"])
    assert text.count("dport 9100 accept") == 1


def test_nft_accepts_the_rendered_table_when_nft_is_here():
    text = firewall_plan(settings(monitoring_listen_address="10.0.0.5", monitoring_allowed_cidrs=SCRAPERS),
                         [22]).rules()
    assert_nft_accepts(text)


@pytest.mark.parametrize("data,key,fragment", [
    ({"monitoring_listen_address": "eth0"}, "monitoring_listen_address", "not an IP address"),
    ({"monitoring_listen_address": "0.0.0.0"}, "monitoring_listen_address", "use all for every address"),
    ({"monitoring_allowed_cidrs": ["10.0.0.0/33"]}, "monitoring_allowed_cidrs", "CIDRs"),
    ({"monitoring_allowed_cidrs": "10.0.0.0/8"}, "monitoring_allowed_cidrs", "list of CIDRs"),
    ({"monitoring_node_exporter_port": 0}, "monitoring_node_exporter_port", "out of range"),
    ({"monitoring_dcgm_exporter_version": "4.5"}, "monitoring_dcgm_exporter_version", "malformed"),
    ({"monitoring_dcgm_exporter_port": 9100}, "monitoring_dcgm_exporter_port", "also monitoring_node_exporter_port"),
    ({"tier": "dev", "monitoring_dcgm_exporter": True}, "monitoring_dcgm_exporter", "debian-12 does not package DCGM"),
])
def test_bad_monitoring_settings_stop_the_run_naming_the_key(data, key, fragment):
    problems = problems_of(inventory({"tier": "research", **data}))
    assert any(p.startswith(f"host gpu-a01: key '{key}': ") and fragment in p for p in problems), problems


NODE_OK = ["::gpufleet:: rc 0", "::gpufleet:: begin error", "", "::gpufleet:: samples 812",
           "::gpufleet:: begin sample", "node_boot_time_seconds 1.764e+09"]
DCGM_OK = ["::gpufleet:: rc 0", "::gpufleet:: begin error", "", "::gpufleet:: samples 16", "::gpufleet:: begin sample",
           'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",pci_bus_id="00000000:07:00.0",device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="h"} 31',
           'DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-b",pci_bus_id="00000000:0F:00.0",device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",Hostname="h"} 33']
REFUSED = ["::gpufleet:: rc 7", "::gpufleet:: begin error",
           "curl: (7) Failed to connect to 127.0.0.1 port 9400 after 0 ms: Couldn't connect to server",
           "::gpufleet:: samples 0", "::gpufleet:: begin sample"]


def test_endpoint_fact_parses_answers_refusals_and_no_curl():
    node = parse_metrics_endpoint(NODE_OK)
    assert (node.status, node.samples, node.lines) == ("ok", 812, ["node_boot_time_seconds 1.764e+09"])
    assert parse_metrics_endpoint(DCGM_OK).label_values("gpu") == ["0", "1"]
    refused = parse_metrics_endpoint(REFUSED)
    assert refused.status == "error" and "Failed to connect" in refused.error
    assert parse_metrics_endpoint(["::gpufleet:: no-curl"]).status == "no-curl"


def test_endpoint_fact_takes_its_values_as_variables_and_refuses_odd_ones():
    command = MetricsEndpoint().command(url="http://127.0.0.1:9100/metrics", family="node_", sample="node_boot_time_seconds")
    assert isinstance(command, StringCommand)
    assert "url=http://127.0.0.1:9100/metrics" in str(command.get_raw_value())
    for url, family in (("http://x/$(reboot)", "node_"), ("file:///etc/shadow", "node_"),
                        ("http://127.0.0.1:9100/metrics", "node_;rm")):
        with pytest.raises(ValueError):
            MetricsEndpoint().command(url=url, family=family, sample="node_boot_time_seconds")


class FakeContext(v.Context):
    def __init__(self, settings, answers, gpus=2, ok=True, scrape_skip="", units=None):
        super().__init__(SimpleNamespace(), settings, scrape_skip=scrape_skip)
        self.answers = answers
        self.units = units or {}  # systemd's answer: unit -> running
        self.asked = []
        self._gpu = SimpleNamespace(ok=ok, status="ok" if ok else "no-nvidia-smi",
                                    gpus=[SimpleNamespace(index=i) for i in range(gpus)])

    @property
    def gpu(self):
        return self._gpu

    def fact(self, cls, **kwargs):
        self.asked.append(cls.__name__)
        if cls is SystemdStatus:
            return {unit: self.units[unit] for unit in kwargs["services"] if unit in self.units}
        assert cls is MetricsEndpoint
        return parse_metrics_endpoint(self.answers[kwargs["url"]])


def test_gate_passes_serving_exporters_and_fails_with_a_fix_otherwise():
    s = settings()
    node_url, dcgm_url = "http://127.0.0.1:9100/metrics", "http://127.0.0.1:9400/metrics"
    ok = v.exporters_serve_metrics(FakeContext(s, {node_url: NODE_OK, dcgm_url: DCGM_OK}))
    assert [(r.name, r.status) for r in ok] == [("the node exporter serves metrics", "pass"),
                                                ("the DCGM exporter serves metrics", "pass")]
    assert "DCGM_FI_DEV_GPU_TEMP for 2 GPUs" in ok[1].message
    bad = v.exporters_serve_metrics(FakeContext(s, {node_url: REFUSED, dcgm_url: DCGM_OK}, gpus=3))
    assert bad[0].status == "fail" and "Failed to connect" in bad[0].message
    assert "systemctl status prometheus-node-exporter.service" in bad[0].fix
    assert bad[1].status == "fail" and "for GPU 0, 1 of 0, 1, 2" in bad[1].message
    no_gpu = v.exporters_serve_metrics(FakeContext(s, {node_url: NODE_OK}, ok=False))
    assert [r.status for r in no_gpu] == ["pass", "skip"]
    none = v.exporters_serve_metrics(FakeContext(settings(tier="dev"), {}))
    assert [r.status for r in none] == ["skip"]


def test_a_run_that_changed_nothing_scrapes_no_exporter_but_fails_one_that_is_not_running():
    """all.py's no-op re-run: no scrape (each made the exporter collect everything), a SKIP
    saying why, systemd's word that each exporter runs; a stopped one still fails the gate."""
    s = settings()
    why = "this run changed nothing on the host"
    node, dcgm = "prometheus-node-exporter.service", "nvidia-dcgm-exporter.service"
    running = FakeContext(s, {}, scrape_skip=why, units={node: True, dcgm: True})
    results = v.exporters_serve_metrics(running)
    assert [(r.name, r.status, r.message) for r in results] == [
        ("the node exporter serves metrics", "skip", f"not scraped: {why}; systemd reports {node} running"),
        ("the DCGM exporter serves metrics", "skip", f"not scraped: {why}; systemd reports {dcgm} running")]
    assert running.asked == ["SystemdStatus", "SystemdStatus"]  # no MetricsEndpoint: nothing scraped
    stopped = v.exporters_serve_metrics(FakeContext(s, {}, scrape_skip=why, units={node: True, dcgm: False}))
    assert [r.status for r in stopped] == ["skip", "fail"]
    assert stopped[1].message == f"{dcgm} is not running (systemd)"
    assert f"systemctl status {dcgm}" in stopped[1].fix
    unknown = v.exporters_serve_metrics(FakeContext(s, {}, scrape_skip=why, units={}))  # systemd said nothing
    assert [r.status for r in unknown] == ["fail", "fail"]
    no_gpu = v.exporters_serve_metrics(FakeContext(s, {}, ok=False, scrape_skip=why, units={node: True}))
    assert [r.status for r in no_gpu] == ["skip", "skip"] and "nvidia-smi" in no_gpu[1].message
    # the same context without the reason scrapes: the control
    scraped = FakeContext(s, {"http://127.0.0.1:9100/metrics": NODE_OK, "http://127.0.0.1:9400/metrics": DCGM_OK})
    assert [r.status for r in v.exporters_serve_metrics(scraped)] == ["pass", "pass"]
    assert scraped.asked == ["MetricsEndpoint", "MetricsEndpoint"]


def test_report_lists_each_exporters_endpoint_with_what_the_gate_found():
    from gpufleet.apps.report.gather import endpoints
    from gpufleet.apps.report.render import cell

    host = SimpleNamespace(name="gpu-a01", data={"ssh_hostname": "10.1.2.3"})
    by_name = {"the node exporter serves metrics": v.Result("monitoring", "the node exporter serves metrics", "pass"),
               "the DCGM exporter serves metrics": v.Result("monitoring", "the DCGM exporter serves metrics", "fail", "refused")}
    rows = endpoints(host, settings(), by_name)
    assert rows == [
        {"name": "node exporter", "url": "http://10.1.2.3:9100/metrics", "status": "pass", "message": ""},
        {"name": "DCGM exporter", "url": "http://10.1.2.3:9400/metrics", "status": "fail", "message": "refused"}]
    assert cell({"endpoints": rows}, "endpoints") == ("node exporter http://10.1.2.3:9100/metrics, "
                                                       "DCGM exporter http://10.1.2.3:9400/metrics (fail)")


def test_inventory_validation_still_accepts_every_shipped_tier():
    for tier in ("dev", "research", "inference", "render", "hgx", "hgx-cloud"):
        validate_inventory(inventory({"tier": tier}))


def test_all_py_runs_monitoring_after_tuning_and_before_the_firewall():
    from pathlib import Path

    calls = [line.strip() for line in (Path(__file__).resolve().parents[2] / "deploys" / "all.py").read_text().splitlines()
             if line.strip().endswith("()") and not line.startswith(("#", "from", "import"))]
    order = [c for c in calls if c in ("tuning()", "monitoring()", "hardening()")]
    assert order == ["tuning()", "monitoring()", "hardening()"], calls


def test_html_report_links_each_endpoint_in_a_metrics_cell():
    from gpufleet.apps.report import render
    from gpufleet.apps.report.view import cells

    rows = [{"name": "node exporter", "url": "http://10.1.2.3:9100/metrics", "status": "pass", "message": "812 samples"},
            {"name": "DCGM exporter", "url": "http://10.1.2.3:9400/metrics", "status": "fail", "message": "refused"}]
    cell = cells({"status": "ok", "endpoints": rows})["endpoints"]
    assert cell.status == "fail" and [i["url"] for i in cell.items] == [r["url"] for r in rows]
    assert cells({"status": "ok", "endpoints": []})["endpoints"].status == "skip"
    doc = render.document([{"host": "gpu-a01", "address": "10.1.2.3", "status": "ok", "state": "changed", "tier": "research",
                            "seconds": 1.0, "drift": None, "endpoints": rows}], "inv.py", 1.0)
    page = render.html_page(doc)
    # the exporter's short name in the (narrow) cell, its full name and what the gate found in the title
    assert '<a class="endpoint" href="http://10.1.2.3:9100/metrics" title="node exporter: 812 samples">node</a>' in page
    assert 'href="http://10.1.2.3:9400/metrics"' in page


def test_no_tier_opens_tensorboard_or_another_unauthenticated_port_to_every_network():
    """TensorBoard (6006) has no login of its own: on a shared research host it is for each
    user's own `ssh -L`, and the trusted peers; opening it to all is the operator's choice."""
    def table(**data):
        return firewall_plan(settings(**data), [22]).rules()

    for tier in ("research", "dev", "hgx", "inference"):
        assert "6006" not in table(tier=tier), tier
    text = table(firewall_trusted_cidrs=["10.1.0.0/16"])
    assert 'ip saddr 10.1.0.0/16 accept comment "trusted"' in text and "6006" not in text
    assert "tcp dport 6006 accept" in table(firewall_open_ports=["22/tcp", "6006/tcp"])
