"""End-to-end: needrestart never restarts a service behind a running job, on a real host.

Ubuntu 22.04+ servers ship needrestart, which runs after every apt install (apt's
DPkg::Post-Invoke hook) and, depending on its mode and the frontend, asks which services to
restart or restarts them itself. Ubuntu hosts cannot be built here; on a Debian 13 test host
with Debian's needrestart 3.11 installed from Debian's archive, a conf.d file setting
`$nrconf{restart} = "a"` stands in for a default that restarts by itself, and a transient
service mapping a library that is then replaced stands in for Docker or Fabric Manager after a
library upgrade.

Proves:
- the stand-in really restarts it: needrestart run as apt's hook runs it restarts the service
  (its main PID changes), so the check below can fail;
- after the hardening deploy (whose own `apt-get install` of nftables and unattended-upgrades
  runs needrestart through the real hook), the service was not restarted although needrestart
  ran, in list mode 'l' (gpufleet's conf.d file is read after the stand-in's); a second run
  changes nothing;
- an area run on its own (`pyinfra INV deploys/monitoring.py`, through deploys/standalone.py)
  on a host whose gpufleet needrestart file is gone writes it again before its apt step; a
  second standalone run changes nothing.
"""
from __future__ import annotations

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory
from tests.e2e.pyinfra_cli import changed_operations, pyinfra

pytestmark = pytest.mark.e2e

DEPLOY = "tests/e2e/deploys/hardening_only.py"
LIB = "/usr/local/lib/gpufleet-test/libgft.so"
# conf.d files are Perl, evaluated in name order: this one records the mode each run ends with
PROBE = "/etc/needrestart/conf.d/99-gpufleet-test-probe.conf"
PROBE_TEXT = "open(my $f, q(>>), q(/run/gpufleet-needrestart-modes)); print $f \"$nrconf{restart}\\n\"; close($f);\\n"
OUTDATE = f"cp {LIB} {LIB}.new && mv -f {LIB}.new {LIB}"  # what an upgrade does to a mapped library


def victim_pid(host) -> str:
    return testhosts.ssh(host, "systemctl show gpufleet-victim -p MainPID --value").stdout.strip()


@pytest.fixture(scope="module")
def needrestart_host(hostpool, tmp_path_factory):
    [host] = hostpool.get("needrestart-trixie", 1, release="trixie")
    testhosts.ssh(host, "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends needrestart",
                  timeout=300)
    testhosts.ssh(host, (
        "set -e; printf '$nrconf{restart} = \"a\";\\n' > /etc/needrestart/conf.d/10-restart-by-itself.conf; "
        f"printf '{PROBE_TEXT}' > {PROBE}; "
        f"mkdir -p $(dirname {LIB}); cp /usr/lib/x86_64-linux-gnu/libz.so.1 {LIB}; "
        f"systemd-run --quiet --unit=gpufleet-victim -p Environment=LD_PRELOAD={LIB} /usr/bin/sleep infinity; "
        "sleep 0.5"))
    # control: with the stand-in alone, needrestart (as apt's hook runs it) restarts the service
    pid0 = victim_pid(host)
    testhosts.ssh(host, f"{OUTDATE}; mkdir -p /run/needrestart; touch /run/needrestart/unpacked; "
                        "DEBIAN_FRONTEND=noninteractive /usr/lib/needrestart/apt-pinvoke </dev/null")
    pid1 = victim_pid(host)
    testhosts.ssh(host, f"{OUTDATE}; rm -f /run/gpufleet-needrestart-modes")
    inv = write_inventory(tmp_path_factory.mktemp("needrestart") / "inventory.py", [host],
                          data={host.name: {"tier": "dev", "validate_os_release": OS_RELEASE[host.release]}})
    first = pyinfra(inv, DEPLOY)
    pid2 = victim_pid(host)
    modes = testhosts.ssh(host, "cat /run/gpufleet-needrestart-modes", check=False).stdout.split()
    second = pyinfra(inv, DEPLOY)
    return {"host": host, "pids": (pid0, pid1, pid2), "first": first, "second": second, "modes": modes}


def test_the_stand_in_restarts_services_by_itself(needrestart_host):
    pid0, pid1, _ = needrestart_host["pids"]
    assert pid0 and pid1 and pid0 != pid1, "the control did not restart the service: the test proves nothing"


def test_after_the_deploy_needrestart_lists_and_never_restarts(needrestart_host):
    host, first = needrestart_host["host"], needrestart_host["first"]
    _, pid1, pid2 = needrestart_host["pids"]
    assert first.returncode == 0, first.output
    assert pid2 == pid1, "needrestart restarted the service during the deploy's apt run"
    assert needrestart_host["modes"] and set(needrestart_host["modes"]) == {"l"}, needrestart_host["modes"]
    assert "Quiet needrestart" in first.output
    outdated = testhosts.ssh(host, "needrestart -b").stdout
    assert "NEEDRESTART-SVC: gpufleet-victim.service" in outdated  # still listed, left to the operator
    conf = testhosts.ssh(host, "stat -c '%a %U' /etc/needrestart/conf.d/50-gpufleet.conf; "
                               "cat /etc/needrestart/conf.d/50-gpufleet.conf").stdout
    assert conf.startswith("644 root") and "$nrconf{restart} = 'l';" in conf


def test_second_run_changes_nothing(needrestart_host):
    second = needrestart_host["second"]
    assert second.returncode == 0, second.output
    assert changed_operations(second) == [], second.output


@pytest.fixture(scope="module")
def standalone_run(needrestart_host, tmp_path_factory):
    host = needrestart_host["host"]
    testhosts.ssh(host, f"rm -f /etc/needrestart/conf.d/50-gpufleet.conf /run/gpufleet-needrestart-modes; {OUTDATE}")
    before = victim_pid(host)
    # the node exporter: a real apt install from Debian's archive, so needrestart's hook runs (bound to
    # the host's own loopback address: test hosts share the network namespace)
    inv = write_inventory(tmp_path_factory.mktemp("needrestart-alone") / "inventory.py", [host],
                          data={host.name: {"tier": "dev", "validate_os_release": OS_RELEASE[host.release],
                                            "tier_mismatch": "warn", "monitoring_node_exporter": True,
                                            "monitoring_listen_address": host.address}})
    first = pyinfra(inv, "deploys/monitoring.py")
    after = victim_pid(host)
    conf = testhosts.ssh(host, "cat /etc/needrestart/conf.d/50-gpufleet.conf", check=False).stdout
    modes = testhosts.ssh(host, "cat /run/gpufleet-needrestart-modes", check=False).stdout.split()
    return {"first": first, "conf": conf, "pids": (before, after), "modes": modes,
            "second": pyinfra(inv, "deploys/monitoring.py")}


def test_an_area_run_alone_writes_the_needrestart_file_before_its_apt(standalone_run):
    first = standalone_run["first"]
    assert first.returncode == 0, first.output
    assert "$nrconf{restart} = 'l';" in standalone_run["conf"]
    changed = changed_operations(first)
    assert any("needrestart" in row for row in changed), first.output
    out = first.output
    run = out[out.index("--> Beginning operation run"):]   # operations in the order they ran
    assert (run.index("Quiet needrestart")
            < run.index("Install node exporter and curl")), out
    before, after = standalone_run["pids"]
    assert before and before == after, "needrestart restarted the service during the standalone area's apt run"
    assert standalone_run["modes"] and set(standalone_run["modes"]) == {"l"}, standalone_run["modes"]
    second = standalone_run["second"]
    assert second.returncode == 0 and changed_operations(second) == [], second.output
