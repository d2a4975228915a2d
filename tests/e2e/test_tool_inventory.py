"""End-to-end: tools/rollout and tools/fleet-report take the inventory as pyinfra does (issue 20)
on 3 real test hosts (GPUs SIMULATED by testing/gpusim, a test double):

- `--limit GROUP` / `--limit HOST` touch only those hosts (counted from each host's own sshd log),
  with a broken host (a tier that does not exist) elsewhere in the inventory;
- `--exclude` leaves a host that is down uncontacted and uncounted (issue 50 item 2);
- a rollout without a terminal and without -y goes no further than its dry run (issue 50 item 1);
- `--data key=value` overrides a setting (and a bad value is refused by the settings grammar);
- a `config.py` beside the inventory is honoured: `config.SUDO = True` with a non-root SSH user,
  and the host's own sudo log shows the run's commands went through sudo;
- a local user's GPU job named with a newline and a GpuState marker forges no GPU fact, and
  tools/rollback refuses its host as busy (issue 44 item 3).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from gpufleet.rollout import manifest as mf
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
    # sudo from config.py alone: no _sudo in the host's data (the harness's default shape has it)
    write_inventory(ops / "inventory.py", [a], data={a.name: _data(a, ssh_user=OPS_USER, _sudo=None)})
    (ops / "config.py").write_text("from pyinfra import config\n\nconfig.SUDO = True\n")
    assert not (work / "config.py").exists()   # the tools run in `work`: only the inventory's folder has one

    def sudo_lines(text: str) -> list[str]:
        return [line for line in text.splitlines() if f"{OPS_USER} : " in line and "USER=root" in line]

    r, journal = journal_during([a], lambda: tool(work, "fleet-report", "ops/inventory.py", "--out", "out-ops",
                                                  "--no-drift"))
    assert json.loads((work / "out-ops" / "fleet-report.json").read_text())["hosts"][0]["status"] == "ok", r.stderr
    # the report reads its facts in one batched command (gpufleet/controller/factcache.py): through sudo
    assert len(sudo_lines(journal[a.name])) >= 1, journal[a.name][-3000:]
    r, journal = journal_during([a], lambda: tool(work, "rollout", "ops/inventory.py", "--dry-run"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(sudo_lines(journal[a.name])) >= 1, journal[a.name][-3000:]
    # the same run with an empty config file instead: no sudo at all
    (work / "empty.py").write_text("")
    r, journal = journal_during([a], lambda: tool(work, "fleet-report", "ops/inventory.py", "--out", "out-ops2",
                                                  "--no-drift", "--config", "empty.py"))
    assert logins(journal[a.name]) >= 1 and sudo_lines(journal[a.name]) == [], journal[a.name][-3000:]


# --- honest exit codes (issue 26): a host not reached is named and the run is not a success ---------

GHOST = "gf-tools-ghost"
FAKE_NVML = "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05"


@pytest.fixture(scope="module")
def with_ghost(fleet):
    """Host c with an installed driver as the survey reads it (a simulated NVML library file of
    580.95.05, a test double like the GPUs), so --driver-version plans it; and an inventory entry
    on an address of the pool's /24 where nothing listens."""
    a, b, c = fleet["hosts"]
    work = fleet["work"]
    testhosts.ssh(c, f"touch {FAKE_NVML}")
    net = c.address.rsplit(".", 1)[0]
    ghost = {**c.pyinfra_data(), "ssh_hostname": f"{net}.251", **_data(c)}
    (work / "ghost").mkdir()
    inv = write_inventory(work / "ghost" / "inventory.py", [c], data={c.name: _data(c, driver_source="nvidia")})
    inv.write_text(inv.read_text() + f"\nghosts = [({GHOST!r}, {ghost!r})]\n")
    only_c = write_inventory(work / "ghost" / "one.py", [c], data={c.name: _data(c, driver_source="nvidia")})
    yield {"inventory": "ghost/inventory.py", "one": "ghost/one.py", "c": c, "work": work,
           "paths": (inv, only_c)}
    testhosts.ssh(c, f"rm -f {FAKE_NVML}")


def test_rollout_dry_run_with_an_unreachable_host_exits_non_zero_naming_it(with_ghost):
    work, c = with_ghost["work"], with_ghost["c"]
    r = tool(work, "rollout", with_ghost["inventory"], "--dry-run", "--driver-version", "580.126.09")
    assert r.returncode == 3, r.stdout + r.stderr
    # the reachable host is planned as usual ...
    assert re.search(rf"canary\s+{re.escape(c.name)}\s+\S+/580\.95\.05\s+580\.126\.09", r.stdout), r.stdout
    # ... and the unreachable one named, in the project's words, with what to do
    assert re.search(rf"^\[{GHOST}\] failed \(rollout\): not surveyed, left out of this run: could not connect "
                     r"\(.*Unable to connect to port 22 on .*\.251\)\. Fix: ", r.stdout, re.M), r.stdout
    assert f"INCOMPLETE: 1 host(s) not reached: {GHOST}" in r.stdout
    # the same with only the unreachable host left: not an empty success either
    r = tool(work, "rollout", with_ghost["inventory"], "--dry-run", "--limit", GHOST)
    assert r.returncode == 3 and f"[{GHOST}] failed (rollout)" in r.stdout, r.stdout + r.stderr


def test_exclude_leaves_a_host_that_is_down_uncontacted_and_uncounted(with_ghost):
    """`--exclude` as pyinfra's (issue 50 item 2): the host that is down is neither contacted
    (no "could not connect" for it) nor counted (not in the plan, the report or the totals)."""
    work, c = with_ghost["work"], with_ghost["c"]
    r = tool(work, "rollout", with_ghost["inventory"], "--dry-run", "--driver-version", "580.126.09",
             "--exclude", GHOST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "surveying 1 host(s)" in r.stdout and GHOST not in r.stdout + r.stderr, r.stdout
    assert re.search(rf"canary\s+{re.escape(c.name)}\s", r.stdout), r.stdout
    report = tool(work, "fleet-report", with_ghost["inventory"], "--out", "out-excluded", "--no-drift",
                  "--exclude", "gf-tools-gh*")   # a pattern, as pyinfra's
    # exit as for host c alone (its own state, mismatch-pending here, decides it): the ghost adds nothing
    alone = tool(work, "fleet-report", with_ghost["one"], "--out", "out-alone", "--no-drift")
    assert report.returncode == alone.returncode, report.stdout + report.stderr
    rows = json.loads((work / "out-excluded" / "fleet-report.json").read_text())["hosts"]
    assert [row["host"] for row in rows] == [c.name] and GHOST not in report.stdout + report.stderr
    assert "1 hosts" in report.stdout and "not reported" not in report.stderr
    _manifest(work, GHOST)
    back = tool(work, "rollback", with_ghost["inventory"], GHOST, "--exclude", GHOST, "-y")
    assert back.returncode == 0 and f"{GHOST}: excluded (--exclude): not rolled back" in back.stdout, back.stdout
    # a mistyped --exclude would contact the very host meant to be left out: refused up front
    typo = tool(work, "rollout", with_ghost["inventory"], "--dry-run", "--exclude", "gf-tools-gost")
    assert typo.returncode == 2 and "--exclude 'gf-tools-gost': no group or host" in typo.stdout + typo.stderr


def test_fleet_report_with_an_unreachable_host_exits_non_zero_naming_it(with_ghost):
    work, c = with_ghost["work"], with_ghost["c"]
    r = tool(work, "fleet-report", with_ghost["inventory"], "--out", "out-ghost", "--no-drift")
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {row["host"]: row for row in json.loads((work / "out-ghost" / "fleet-report.json").read_text())["hosts"]}
    assert rows[c.name]["status"] == "ok" and rows[c.name]["kernel"], rows[c.name]   # still reported
    assert rows[GHOST]["status"] == "unreachable", rows[GHOST]
    assert re.search(rf"^\[{GHOST}\] failed \(report\): not reached: Could not connect .*\. Fix: ", r.stderr, re.M), r.stderr
    assert f"fleet-report: 1 of 2 host(s) not reported: {GHOST}" in r.stderr


def _manifest(work: Path, name: str, packages: dict[str, str] | None = None) -> Path:
    """A manifest as tools/rollout's snapshot step writes one (mf.build: tools/rollback refuses
    anything else), 0600 in 0700 folders as gpufleet keeps them; `packages` recorded (and held)."""
    ident = "20261202T100000Z"
    path = work / ".gpufleet" / "manifests" / name / f"{ident}.json"
    for folder in (path.parent.parent.parent, path.parent.parent, path.parent):
        folder.mkdir(mode=0o700, exist_ok=True)
    packages = packages or {"nvidia-open": "580.95.05-1"}
    doc = mf.build(host=name, ident=ident, created=time.time(), reason="before driver 580.126.09",
                   packages=packages, holds=sorted(packages), etc_files={},
                   driver={"installed": "580.95.05", "loaded": "580.95.05"}, gpus=[], disk_snapshot=None)
    assert mf.manifest_problems(doc, name) == []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(mf.dumps(doc))
    return path


def test_rollback_with_an_unreachable_host_exits_non_zero_naming_it(with_ghost):
    work, c = with_ghost["work"], with_ghost["c"]
    _manifest(work, c.name)
    _manifest(work, GHOST)
    dry = tool(work, "rollback", with_ghost["inventory"], c.name, GHOST, "--dry-run")
    assert dry.returncode == 1, dry.stdout + dry.stderr
    assert f"  {c.name}: reachable" in dry.stdout
    assert re.search(rf"^\[{GHOST}\] failed \(rollback\): dry run: could not connect \(.*\)\. Fix: ", dry.stdout, re.M)
    assert f"FAILED: 1 host(s) a rollback could not reach: {GHOST}" in dry.stdout
    real = tool(work, "rollback", with_ghost["inventory"], GHOST, "-y")
    assert real.returncode == 1, real.stdout + real.stderr
    assert re.search(rf"^\[{GHOST}\] failed \(rollback\): restore: could not connect", real.stdout, re.M), real.stdout
    assert f"FAILED: 1 host(s) not rolled back: {GHOST}" in real.stdout


def tool_on_a_terminal(work: Path, name: str, *args: str, answer: bytes) -> subprocess.CompletedProcess:
    """The tool with a pseudo-terminal as stdin (an operator at a shell), `answer` typed ahead."""
    controller, terminal = os.openpty()
    try:
        os.write(controller, answer)
        proc = subprocess.run([str(REPO / "tools" / name), *args], cwd=work, stdin=terminal, capture_output=True,
                              text=True, timeout=600)
    finally:
        os.close(controller)
        os.close(terminal)
    print(proc.stdout, proc.stderr)
    return proc


def test_rollout_asks_before_draining_and_no_changes_nothing(with_ghost):
    work, c = with_ghost["work"], with_ghost["c"]
    args = (with_ghost["one"], "--driver-version", "580.126.09", "--state", "ghost/one-state.json")
    marker = "/run/gpufleet-test-before-question"
    testhosts.ssh(c, f"touch {marker}")
    time.sleep(1.1)
    r = tool_on_a_terminal(work, "rollout", *args, answer=b"n\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Drain and upgrade 1 host(s) as planned above? (-y skips this question) [y/N]" in r.stdout
    assert "not confirmed: nothing changed" in r.stdout
    assert r.stdout.index(f"canary   {c.name}") < r.stdout.index("[y/N]")   # the plan first
    # nothing changed: no state file on the controller, nothing drained, locked or written on the host
    assert not (work / "ghost" / "one-state.json").exists()
    changed = testhosts.ssh(c, f"find /etc /var/lib/gpufleet /var/lib/dpkg /var/lib/apt /usr -newer {marker} "
                               "-type f 2>/dev/null; true").stdout
    assert changed.strip() == "", changed
    # the rollout locks a host (gpufleet/controller/hostlock.py) before its first change: never taken
    assert testhosts.ssh(c, "ls -A /run/lock/gpufleet 2>/dev/null; true").stdout.strip() == ""
    # (-y and a stdin that is no terminal go on without asking: tests/unit/test_rollout_progress.py)


def test_rollout_without_a_terminal_or_yes_stops_after_its_dry_run(with_ghost):
    """Started with stdin closed (cron, CI) and no -y (issue 50 item 1): the plan, then exit 1
    saying how to go on; nothing changed on the host or the controller. tools/rollback too."""
    work, c = with_ghost["work"], with_ghost["c"]
    args = (with_ghost["one"], "--driver-version", "580.126.09", "--state", "ghost/unattended.json")
    marker = "/run/gpufleet-test-before-unattended"
    testhosts.ssh(c, f"touch {marker}")
    time.sleep(1.1)
    env = {k: v for k, v in os.environ.items() if k != "PYINFRA_YES"}
    for stdin in ("closed", subprocess.DEVNULL):
        proc = subprocess.run([str(REPO / "tools" / "rollout"), *args], cwd=work, capture_output=True, text=True,
                              timeout=600, env=env, **({"preexec_fn": lambda: os.close(0)} if stdin == "closed"
                                                       else {"stdin": stdin}))
        print(proc.stdout, proc.stderr)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "DRY RUN: rollout of driver 580.126.09" in proc.stdout and f"canary   {c.name}" in proc.stdout
        assert ("no terminal to ask on (stdin is not one: cron, CI, a script) and no -y: that was the dry run, "
                "nothing changed. To drain and upgrade 1 host(s) as shown, run tools/rollout again with -y "
                "(or PYINFRA_YES=1 in its environment)") in proc.stdout, proc.stdout
    assert not (work / "ghost" / "unattended.json").exists()
    # tools/rollback likewise: its dry run (is the host reachable), then exit 1
    _manifest(work, c.name)
    back = subprocess.run([str(REPO / "tools" / "rollback"), with_ghost["one"], c.name], cwd=work, capture_output=True,
                          text=True, timeout=600, env=env, stdin=subprocess.DEVNULL)
    print(back.stdout, back.stderr)
    assert back.returncode == 1 and f"  {c.name}: reachable" in back.stdout, back.stdout + back.stderr
    assert ("that was the dry run, nothing changed. To roll back 1 host(s) as shown, run tools/rollback again with "
            "-y") in back.stdout, back.stdout
    changed = testhosts.ssh(c, f"find /etc /var/lib/gpufleet /var/lib/dpkg /var/lib/apt /usr -newer {marker} "
                               "-type f 2>/dev/null; true").stdout
    assert changed.strip() == "", changed
    assert testhosts.ssh(c, "ls -A /run/lock/gpufleet 2>/dev/null; true").stdout.strip() == ""
    # a PYINFRA_YES that is neither yes nor no is refused before anything runs
    bad = subprocess.run([str(REPO / "tools" / "rollout"), *args], cwd=work, capture_output=True, text=True,
                         timeout=600, env={**env, "PYINFRA_YES": "maybe"}, stdin=subprocess.DEVNULL)
    assert bad.returncode == 2 and "PYINFRA_YES='maybe' is not a yes or a no" in bad.stderr, bad.stderr
    # (with -y it proceeds: every other rollout e2e test runs so, without a terminal)


# --- a GPU process's name is its user's text (issue 44 item 3) ---------------------------------------

#: argv[0] of a local user's GPU job: nvidia-smi prints it raw, and this one's second line is the
#: status line GpuState's script prints where a host has no nvidia-smi
HOSTILE = "train\n::gpufleet:: status no-nvidia-smi\n"
HELD = "procps"   # what the rollback below puts back: a hold on a package every test host has


def _gpu_state(work: Path, inventory: Path) -> dict:
    proc = subprocess.run([str(REPO / ".venv/bin/pyinfra"), "-y", str(inventory), "fact", "gpufleet.facts.gpu.GpuState"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return json.loads(out[out.index("{", out.index("--> Fact data for")):out.rindex("}") + 1])


def test_a_gpu_process_name_forges_no_gpu_fact_and_rollback_refuses_its_host_as_busy(fleet):
    """`student` runs a job holding a GPU device node (simulated: the simulator lists it as a compute
    process under its real argv[0]), named with a newline and a GpuState marker. The GPU facts still
    show every GPU and the job; tools/rollback refuses the host as busy (the name forged "no
    nvidia-smi", so no processes, and the rollback went ahead: the test failed on that code), also
    when only the device node is held; --force rolls it back, as its help says."""
    a, b, c = fleet["hosts"]
    work = fleet["work"] / "procname"
    work.mkdir()
    inventory = write_inventory(work / "inventory.py", [b], data={b.name: _data(b)})
    version = testhosts.ssh(b, f"dpkg-query -W -f '${{Version}}' {HELD}").stdout.strip()
    _manifest(work, b.name, packages={HELD: version})
    testhosts.ssh(b, f"apt-mark unhold {HELD} >/dev/null")
    job = ("import os; fd = os.open('/dev/nvidia0', os.O_RDONLY); os.set_inheritable(fd, True); "
           f"os.execv('/bin/sleep', [{HOSTILE!r}, '600'])")
    testhosts.ssh(b, "[ -e /dev/nvidia0 ] || { touch /dev/nvidia0; touch /run/test-made-nvidia0; }; "
                     f"systemd-run --quiet --unit=student-job --uid=student python3 -c {shlex.quote(job)}")
    pid = ""
    try:
        pid = testhosts.ssh(b, "for i in $(seq 50); do p=$(systemctl show -p MainPID --value student-job); "
                               "[ \"$(stat -c %U /proc/$p 2>/dev/null)\" = student ] && "
                               "[ \"$(readlink /proc/$p/exe)\" = /usr/bin/sleep ] && break; sleep 0.1; done; "
                               "echo $p").stdout.strip()
        argv0 = testhosts.ssh(b, f"python3 -c \"print(open('/proc/{pid}/cmdline', 'rb').read().split(bytes(1))[0].hex())\"")
        assert bytes.fromhex(argv0.stdout.strip()).decode() == HOSTILE   # the job's real name
        sim = json.loads(testhosts.ssh(b, "cat /etc/gpusim/gpus.json").stdout)
        testhosts.ssh(b, f"gpusimctl add-process --gpu 0 --pid {pid} --name {shlex.quote(HOSTILE)} --used-mib 1024")

        state = _gpu_state(work, inventory)[b.name]
        assert state["status"] == "ok", state
        assert [g["uuid"] for g in state["gpus"]] == [g["uuid"] for g in sim["gpus"]]
        assert [(p["pid"], p["gpu_uuid"], p["used_memory_mib"], p["process_name"]) for p in state["processes"]] == [
            (int(pid), sim["gpus"][0]["uuid"], 1024, "train\\n::gpufleet:: status no-nvidia-smi\\n")]

        r = tool(work, "rollback", "inventory.py", b.name, "-y")
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"  {b.name}: restore BUSY, not rolled back: busy: GPU work running ({pid} train\\n::gpufleet::" \
            in r.stdout, r.stdout
        assert HELD not in testhosts.ssh(b, "apt-mark showhold").stdout.split()   # nothing rolled back

        # what nvidia-smi does not list (NVML failing, say): the device node's holder alone is GPU work
        testhosts.ssh(b, f"gpusimctl remove-process --pid {pid}")
        r = tool(work, "rollback", "inventory.py", b.name, "-y")
        assert r.returncode == 1 and f"busy: GPU work running ({pid} (holds /dev/nvidia*))" in r.stdout, r.stdout
        assert HELD not in testhosts.ssh(b, "apt-mark showhold").stdout.split()

        r = tool(work, "rollback", "inventory.py", b.name, "--force", "-y")
        assert r.returncode == 0 and f"  {b.name}: restore ok" in r.stdout, r.stdout + r.stderr
        assert HELD in testhosts.ssh(b, "apt-mark showhold").stdout.split()
        assert testhosts.ssh(b, f"kill -0 {pid}", check=False).returncode == 0   # the job was left running
    finally:
        testhosts.ssh(b, f"systemctl stop student-job; gpusimctl remove-process --pid {pid or 0} 2>/dev/null; "
                         f"apt-mark unhold {HELD} >/dev/null; [ -e /run/test-made-nvidia0 ] && "
                         "rm -f /dev/nvidia0 /run/test-made-nvidia0; true", check=False)
