"""End-to-end: tools/rollout and tools/fleet-report take the inventory as pyinfra does (issue 20)
on 3 real test hosts (GPUs SIMULATED by testing/gpusim, a test double):

- `--limit GROUP` / `--limit HOST` touch only those hosts (counted from each host's own sshd log),
  with a broken host (a tier that does not exist) elsewhere in the inventory;
- `--data key=value` overrides a setting (and a bad value is refused by the settings grammar);
- a `config.py` beside the inventory is honoured: `config.SUDO = True` with a non-root SSH user,
  and the host's own sudo log shows the run's commands went through sudo.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from testing import testhosts
from testing.inventory import OS_RELEASE, write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.gpusim]
REPO = Path(__file__).resolve().parents[2]
OPS_USER = "gfops"


def _data(host, **extra) -> dict:
    # no Debian package has the test machine's kernel headers (testing/inventory.environment_data)
    return {"tier": "dev", "validate_os_release": OS_RELEASE[host.release], "tier_mismatch": "warn",
            "driver_kernel_headers": "skip", **extra}


@pytest.fixture(scope="module")
def fleet(hostpool, tmp_path_factory):
    a, b, c = hostpool.get("tools-inventory", 3, gpu="t4")
    work = tmp_path_factory.mktemp("tools-inventory")
    (work / "fleet").mkdir()
    # the broken host is host c's address under another name, with a tier nobody defined
    broken = testhosts.Host("gf-broken", c.address, c.release, c.gpu, c.pool, c.ssh_key)
    data = {a.name: _data(a), b.name: _data(b), c.name: _data(c), broken.name: _data(c, tier="no-such-tier")}
    write_inventory(work / "fleet" / "inventory.py", [a, b, c, broken], data=data,
                    groups={"gpu_a": [a.name], "gpu_b": [b.name], "gpu_c": [c.name, broken.name]})
    return {"hosts": (a, b, c), "work": work}


def tool(work: Path, name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(REPO / "tools" / name), *args], cwd=work, capture_output=True, text=True,
                          timeout=timeout)
    print(proc.stdout, proc.stderr)
    return proc


def journal_during(hosts, run):
    """run(); then per host the lines its journal got meanwhile (read afterwards, outside the
    window: whole seconds, so the reading login itself is not counted)."""
    time.sleep(1.1)
    since = int(time.time())
    result = run()
    time.sleep(1.1)
    until = int(time.time())
    time.sleep(1.1)
    lines = {h.name: testhosts.ssh(h, f"journalctl -q --no-pager -o cat --since=@{since} --until=@{until}").stdout
             for h in hosts}
    return result, lines


def logins(text: str) -> int:
    return text.count("Accepted publickey for ")


def test_rollout_limit_group_touches_only_its_hosts(fleet):
    a, b, c = fleet["hosts"]
    work = fleet["work"]
    # the broken host is really refused when it is part of the run
    whole = tool(work, "rollout", "fleet/inventory.py", "--dry-run")
    assert whole.returncode == 2, whole.stdout + whole.stderr
    assert "error: host gf-broken: key 'tier': unknown tier 'no-such-tier'" in whole.stdout
    r, journal = journal_during((a, b, c), lambda: tool(work, "rollout", "--limit", "gpu_a", "fleet/inventory.py",
                                                        "--dry-run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "surveying 1 host(s)" in r.stdout and a.name in r.stdout
    assert b.name not in r.stdout and "gf-broken" not in r.stdout
    assert logins(journal[a.name]) >= 1, journal[a.name]
    assert logins(journal[b.name]) == 0, journal[b.name]
    assert logins(journal[c.name]) == 0, journal[c.name]   # the broken entry's address too
    # a limit that matches nothing is refused, not an empty success
    none = tool(work, "rollout", "--limit", "gpu_x", "fleet/inventory.py", "--dry-run")
    assert none.returncode == 2 and "--limit 'gpu_x': no group or host" in none.stdout


def test_fleet_report_limit_host_reads_only_that_host(fleet):
    a, b, c = fleet["hosts"]
    work = fleet["work"]
    r, journal = journal_during((a, b, c), lambda: tool(work, "fleet-report", "--limit", b.name,
                                                        "fleet/inventory.py", "--out", "out-limit"))
    doc = json.loads((work / "out-limit" / "fleet-report.json").read_text())
    assert [row["host"] for row in doc["hosts"]] == [b.name], r.stdout + r.stderr
    row = doc["hosts"][0]
    assert row["status"] == "ok" and row["kernel"], row
    # all.py was planned for it (drift) without tripping over the broken host outside the limit
    assert row["drift"]["error"] is None and (row["drift"]["changes"] or 0) > 0, row["drift"]
    assert "[1/1]" in r.stderr
    assert logins(journal[b.name]) >= 1, journal[b.name]
    assert logins(journal[a.name]) == 0, journal[a.name]
    assert logins(journal[c.name]) == 0, journal[c.name]


def test_data_overrides_a_setting(fleet):
    a, b, c = fleet["hosts"]
    work = fleet["work"]
    r = tool(work, "fleet-report", "--limit", "gpu_a", "fleet/inventory.py", "--out", "out-data", "--no-drift",
             "--data", "tier=research")
    row = json.loads((work / "out-data" / "fleet-report.json").read_text())["hosts"][0]
    assert row["host"] == a.name and row["tier"] == "research", r.stdout + r.stderr
    plain = tool(work, "fleet-report", "--limit", "gpu_a", "fleet/inventory.py", "--out", "out-plain", "--no-drift")
    assert json.loads((work / "out-plain" / "fleet-report.json").read_text())["hosts"][0]["tier"] == "dev", plain.stderr
    bad = tool(work, "rollout", "--limit", "gpu_a", "fleet/inventory.py", "--dry-run",
               "--data", "driver_reboot=sometimes")
    assert bad.returncode == 2
    assert f"error: host {a.name}: key 'driver_reboot': unknown value 'sometimes'" in bad.stdout, bad.stdout
    # --data fixes the broken host for this run: the whole inventory is accepted
    fixed = tool(work, "rollout", "--limit", "gpu_c", "fleet/inventory.py", "--dry-run", "--data", "tier=dev")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "surveying 2 host(s)" in fixed.stdout


def _ops_user(host) -> None:
    """A non-root SSH user with passwordless sudo, as many fleets log in."""
    testhosts.ssh(host, f"id {OPS_USER} >/dev/null 2>&1 || useradd -m -s /bin/sh {OPS_USER}; "
                        f"install -d -m 700 -o {OPS_USER} -g {OPS_USER} /home/{OPS_USER}/.ssh && "
                        f"install -m 600 -o {OPS_USER} -g {OPS_USER} /root/.ssh/authorized_keys /home/{OPS_USER}/.ssh/ && "
                        f"echo '{OPS_USER} ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/{OPS_USER} && "
                        f"chmod 440 /etc/sudoers.d/{OPS_USER}")


def test_config_py_beside_the_inventory_is_honoured(fleet):
    a, b, c = fleet["hosts"]
    work = fleet["work"]
    _ops_user(a)
    ops = work / "ops"
    ops.mkdir()
    write_inventory(ops / "inventory.py", [a], data={a.name: _data(a, ssh_user=OPS_USER)})
    (ops / "config.py").write_text("from pyinfra import config\n\nconfig.SUDO = True\n")
    assert not (work / "config.py").exists()   # the tools run in `work`: only the inventory's folder has one

    def sudo_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if f"{OPS_USER} : " in line and "USER=root" in line]

    r, journal = journal_during([a], lambda: tool(work, "fleet-report", "ops/inventory.py", "--out", "out-ops",
                                                  "--no-drift"))
    assert json.loads((work / "out-ops" / "fleet-report.json").read_text())["hosts"][0]["status"] == "ok", r.stderr
    # the report reads its facts in one batched command (gpufleet/factcache.py): through sudo
    assert len(sudo_lines(journal[a.name])) >= 1, journal[a.name][-3000:]
    r, journal = journal_during([a], lambda: tool(work, "rollout", "ops/inventory.py", "--dry-run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(sudo_lines(journal[a.name])) >= 1, journal[a.name][-3000:]
    # the same run with an empty config file instead: no sudo at all
    (work / "empty.py").write_text("")
    r, journal = journal_during([a], lambda: tool(work, "fleet-report", "ops/inventory.py", "--out", "out-ops2",
                                                  "--no-drift", "--config", "empty.py"))
    assert logins(journal[a.name]) >= 1 and sudo_lines(journal[a.name]) == [], journal[a.name][-3000:]
