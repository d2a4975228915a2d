"""gpufleet/controller/factcache.py: a fact is asked again from memory only while nothing ran on the
host, and last run's facts come back in one command with the same answers pyinfra gives.
Runs pyinfra's real fact machinery against @local (read-only facts on this machine)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all, disconnect_all
from pyinfra.api.facts import get_fact
from pyinfra.api.host import Host
from pyinfra.facts.files import File, Sha1File
from pyinfra.facts.server import Arch

from gpufleet.config.hostcontext import host_context
from gpufleet.controller import factcache

pytestmark = pytest.mark.unit


@pytest.fixture
def local(tmp_path, monkeypatch):
    monkeypatch.setattr(factcache, "PLAN_DIR", tmp_path / "plans")
    factcache.install()

    def new_state(data=None):
        inventory = Inventory(([("@local", dict(data or {}))], {}))
        state = State(inventory, Config())
        connect_all(state)
        host = inventory.get_host("@local")
        calls = []
        original = Host.run_shell_command

        def counting(self, *args, **kwargs):
            calls.append(args[0] if args else kwargs.get("command"))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Host, "run_shell_command", counting)
        return state, host, calls

    yield new_state


def test_same_question_twice_runs_one_command(local, tmp_path):
    state, host, calls = local()
    path = str(tmp_path / "x")
    open(path, "w").write("hello\n")
    first = get_fact(state, host, Sha1File, kwargs={"path": path})
    second = get_fact(state, host, Sha1File, kwargs={"path": path})
    assert first == second == "f572d396fae9206628714fb2ce00f72e94f2258f"
    assert len(calls) == 1


def test_any_other_command_forgets_everything(local, tmp_path):
    state, host, calls = local()
    path = str(tmp_path / "x")
    assert get_fact(state, host, File, kwargs={"path": path}) is None
    host.run_shell_command(f"touch {path}")  # an operation changed the host
    assert get_fact(state, host, File, kwargs={"path": path}) is not None
    assert len(calls) == 3


@pytest.mark.parametrize("packed", [True, False], ids=["gzip-base64", "plain"])
def test_last_runs_facts_come_back_in_one_command_with_the_same_answers(local, tmp_path, monkeypatch, packed):
    if not packed:  # a host without gzip or base64 answers in plain lines
        monkeypatch.setattr(factcache, "_PACK_CHECK", "false")
    path = str(tmp_path / "x")
    open(path, "w").write("hello\n")
    state, host, calls = local()
    expected = (get_fact(state, host, Sha1File, kwargs={"path": path}),
                get_fact(state, host, Arch), get_fact(state, host, File, kwargs={"path": path}))
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects
    assert len(calls) == 3

    state, host, calls = local()  # the next run
    answers = (get_fact(state, host, Sha1File, kwargs={"path": path}),
               get_fact(state, host, Arch), get_fact(state, host, File, kwargs={"path": path}))
    assert answers[:2] == expected[:2] and answers[2]["size"] == expected[2]["size"]
    assert len(calls) == 1 and "gpufleet-prefetch" in str(calls[0])
    # every answer came from the prefetch: none of the three was asked on its own
    assert len(factcache._memo(host)) == 3


def test_a_stale_plan_costs_nothing_but_time(local, tmp_path):
    state, host, calls = local()
    gone = str(tmp_path / "gone")
    get_fact(state, host, Sha1File, kwargs={"path": gone})
    get_fact(state, host, Arch)
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects
    state, host, calls = local()
    assert get_fact(state, host, Sha1File, kwargs={"path": str(tmp_path / "other")}) is None
    assert get_fact(state, host, Arch) == os.uname().machine


def test_file_facts_asked_in_batches_answer_as_pyinfra_does(local, tmp_path):
    from pyinfra.facts.files import Directory, Sha256File

    (tmp_path / "file").write_text("hello\n")
    (tmp_path / "with space 'quoted'").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    names = ["file", "with space 'quoted'", "dir", "link", "dangling", "missing"]
    questions = [(cls, str(tmp_path / n)) for n in names for cls in (File, Directory, Sha1File, Sha256File)]

    state, host, calls = local()
    expected = [get_fact(state, host, cls, kwargs={"path": p}) for cls, p in questions]
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects

    state, host, calls = local()  # the next run: the plan comes back in one script
    answers = [get_fact(state, host, cls, kwargs={"path": p}) for cls, p in questions]

    def without_atime(values):  # the first run's sha1sum read the files: their atime moved
        return [{k: v for k, v in a.items() if k != "atime"} if isinstance(a, dict) else a for a in values]

    assert without_atime(answers) == without_atime(expected)
    assert expected[0]["size"] == 6 and expected[2] == "f572d396fae9206628714fb2ce00f72e94f2258f"
    assert expected[-4] is None and expected[8] is False and expected[9]["mode"]  # missing; dir: no File, a Directory
    # One script, plus pyinfra's own command only where the batch had no line for an existing
    # path: sha1sum/sha256sum of the directory and of the dangling link; and the four facts of
    # the path with quotes in it, never written to the plan (not a plain argument).
    assert len(calls) == 1 + 4 + 4, calls
    assert sum("quoted" in str(c) for c in calls) == 4


@pytest.mark.skipif(not shutil.which("dpkg-query"), reason="needs dpkg-query (Debian)")
def test_the_facts_reading_dpkg_asked_in_one_dpkg_query_answer_as_their_own_commands(local):
    """This machine's own dpkg database, read by each fact's own command in the first run and by
    the prefetch's one `dpkg-query -W '*'` in the next."""
    from pyinfra.facts.deb import DebPackages

    from gpufleet.facts.packages import HeldPackages, PackageVersions, StackPackages

    questions = [(PackageVersions, {"packages": q}) for q in (
        ["bash", "coreutils"], ["libc6", "nosuch-gpufleet-pkg"], ["bash"], "coreutils",
        ["cuda-toolkit-[0-9]*", "bash"], ["lib*", "python3-[a-m]*"], ["bas[h-]"])]  # the last: its own command
    questions += [(StackPackages, {"packages": ["cuda-toolkit-13-0", "libcudnn[0-9]*", "libc6"]}),
                  (StackPackages, {"packages": ["libc6", "lib*"]}), (HeldPackages, {}), (DebPackages, {})]
    state, host, calls = local()
    expected = [get_fact(state, host, cls, kwargs=kwargs) for cls, kwargs in questions]
    assert len(calls) == len(questions)
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects

    state, host, calls = local()  # the next run: one script, one dpkg-query for all but one
    answers = [get_fact(state, host, cls, kwargs=kwargs) for cls, kwargs in questions]
    assert answers == expected
    assert expected[0]["bash"] and expected[1] == {"libc6": expected[1]["libc6"], "nosuch-gpufleet-pkg": None}
    assert expected[-1]["bash"] and len(expected[5]) > 10
    assert len(calls) == 1 and str(calls[0]).count("dpkg-query -W") == 2, calls  # the batch's, bas[h-]'s own
    assert "dpkg -l" not in str(calls[0]) and "sed -n" not in str(calls[0])


def test_remembered_fact_keys_are_pyinfras_own(local):
    """The key cache must give what pyinfra's _handle_fact_kwargs gives, whatever executor
    arguments (sudo, user, env) come from the question or the deploy around it."""
    state, host, calls = local()
    cases = [({"path": "/x"}, None), ({"path": "/x", "_sudo": True}, None),
             ({"path": "/x"}, {"_sudo": True, "_sudo_user": "bob"}), ({"path": "/y", "_env": {"A": "1"}}, None),
             ({"path": "/x"}, None)]
    keys = []
    try:
        for kwargs, deploy_kwargs in cases:
            host.current_deploy_kwargs = deploy_kwargs
            expected = factcache._pyinfra_key(state, host, File, [], dict(kwargs))
            for _ in range(2):  # asked, then answered from the caches
                assert factcache._key(state, host, File, [], dict(kwargs)) == expected
            keys.append(expected)
    finally:
        host.current_deploy_kwargs = None
    assert len(set(keys)) == 4 and keys[0] == keys[-1]  # sudo, sudo as bob, env: each its own key
    assert '"_sudo_user": "bob"' in keys[2][2]


SECRET = "pw-Zq8v-never-written"


def test_no_executor_argument_is_written_and_the_plan_is_private(local, tmp_path):
    """A sudo/su password in the inventory is a connector argument of every fact: the plan file
    must not hold it (nor any executor argument), and it is 0600 in a 0700 directory."""
    path = str(tmp_path / "x")
    open(path, "w").write("hello\n")
    state, host, calls = local({"_su_password": SECRET, "_sudo_password": SECRET})
    get_fact(state, host, Sha1File, kwargs={"path": path})
    get_fact(state, host, Arch)
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects
    plan = tmp_path / "plans" / "_local.json"
    text = plan.read_text()
    assert SECRET not in text and "_sudo" not in text and "_su_" not in text
    assert os.stat(plan).st_mode & 0o777 == 0o600
    assert os.stat(plan.parent).st_mode & 0o777 == 0o700
    assert [e[0] for e in json.loads(text)["facts"]] == ["pyinfra.facts.files.Sha1File", "pyinfra.facts.server.Arch"]

    state, host, calls = local({"_su_password": SECRET, "_sudo_password": SECRET})  # the next run
    assert get_fact(state, host, Sha1File, kwargs={"path": path}) == "f572d396fae9206628714fb2ce00f72e94f2258f"
    assert get_fact(state, host, Arch) == os.uname().machine
    assert len(calls) == 1 and "gpufleet-prefetch" in str(calls[0])


@pytest.mark.parametrize("entry", [
    ["pyinfra.facts.server.Command", '{"command": "touch MARK"}'],      # runs what it is given
    ["os.system", '{"command": "touch MARK"}'],                          # not a fact at all
    ["pyinfra.facts.files.File", '{"path": "/x; touch MARK"}'],          # not a plain argument
    ["pyinfra.facts.files.File", '{"path": "$(touch MARK)"}'],
    ["pyinfra.facts.files.File", '{"path": "`touch MARK`"}'],
    ["pyinfra.facts.files.File", '{"path": "/x\\ntouch MARK"}'],
    ["pyinfra.facts.files.File", '{"path": "/x", "_sudo_password": "x"}'],  # executor arguments
    ["gpufleet.facts.system.Nothing\"; touch MARK", "{}"],
    ["pyinfra.facts.files.FindInFile",  # pasted into double quotes by pyinfra
     '{"path": "/x", "pattern": "$(touch MARK)", "interpolate_variables": true, "extended_regex": false}'],
    ["pyinfra.facts.files.FindInFile", '{"path": "/x", "pattern": "x\' ; touch MARK", "interpolate_variables": false}'],
    ["pyinfra.facts.files.File", '{"path": "/x"}', '{"_sudo": true}'],   # the old format's shape
    # pyinfra pastes systemd's machine and user_name unquoted (--machine={machine}): words of
    # the plan would be systemctl's words (the issue's: ".host start reboot.target")
    ["pyinfra.facts.systemd.SystemdStatus", '{"machine": ".host is-active MARK", "services": ["ssh.service"], '
                                            '"user_mode": false, "user_name": null}'],
    ["pyinfra.facts.systemd.SystemdEnabled", '{"machine": null, "services": ["ssh.service"], '
                                             '"user_mode": false, "user_name": "root@.host is-active MARK"}'],
    ["pyinfra.facts.systemd.SystemdStatus", '{"services": ["--machine=.host", "MARK"], "user_mode": false}'],
    ["pyinfra.facts.systemd.SystemdStatus", '{"services": ["ssh.service MARK"], "user_mode": true}'],
    ["pyinfra.facts.files.Sha1File", '{"path": "--help MARK"}'],        # an option, not a path
    ["pyinfra.facts.files.File", '{"path": "MARK /etc/shadow"}'],       # two words
    ["pyinfra.facts.files.File", '{"path": "MARK", "mode": "x"}'],      # an argument the fact is not asked with
    ["pyinfra.facts.server.Arch", '{"path": "MARK"}'],
    ["pyinfra.facts.deb.DebPackage", '{"package": "-x MARK"}'],
    ["gpufleet.facts.ssh.AuthorizedKeys", '{"user": "root MARK"}'],
    ["gpufleet.facts.ssh.AuthorizedKeys", '{"user": "root", "extra": "MARK"}'],
    ["gpufleet.facts.ssh.SmallModuli", '{"min_bits": true, "path": "MARK"}'],  # a bool is no int
    ["gpufleet.facts.gpu.GpuState", '{"processes": "MARK"}'],
    ["gpufleet.facts.ssh.NoSuchFact", '{"user": "MARK"}'],
])
def test_a_plan_entry_off_the_allow_list_is_ignored_with_a_warning_and_never_run(local, tmp_path, entry, caplog):
    mark = tmp_path / "pwned"
    entry = [part.replace("MARK", str(mark)) for part in entry]
    plans = tmp_path / "plans"
    plans.mkdir(mode=0o700)
    ok = ["pyinfra.facts.files.File", json.dumps({"path": str(tmp_path)})]
    (plans / "_local.json").write_text(json.dumps({"format": 2, "facts": [ok, ok, entry]}))
    os.chmod(plans / "_local.json", 0o600)
    state, host, calls = local()
    get_fact(state, host, Arch)
    assert not mark.exists()
    assert len(calls) == 2 and "gpufleet-prefetch" in str(calls[0]) and str(mark) not in str(calls[0])
    assert "ignored 1 entry of the fact plan" in caplog.text


def test_an_old_or_foreign_plan_is_ignored(local, tmp_path, caplog):
    plans = tmp_path / "plans"
    plans.mkdir(mode=0o700)
    ok = ["pyinfra.facts.files.File", json.dumps({"path": str(tmp_path)}), "{}"]
    (plans / "_local.json").write_text(json.dumps([ok, ok]))  # format 1: executor arguments
    state, host, calls = local()
    get_fact(state, host, Arch)
    assert "gpufleet-prefetch" not in str(calls) and "not format 2" in caplog.text
    (plans / "_local.json").write_text(json.dumps({"format": 2, "facts": [ok[:2], ok[:2]]}))
    os.chmod(plans / "_local.json", 0o666)  # anyone may write it: not trusted
    state, host, calls = local()
    get_fact(state, host, Arch)
    assert "gpufleet-prefetch" not in str(calls) and "a file others may write" in caplog.text


def test_a_regular_expression_pyinfra_quotes_is_a_plain_argument():
    assert factcache.allowed("pyinfra.facts.files.FindInFile", json.dumps(
        {"path": "/etc/default/sysstat", "pattern": "^.*^ENABLED=.*$", "interpolate_variables": False,
         "extended_regex": False}))
    assert not factcache.allowed("pyinfra.facts.files.File", json.dumps({"path": "/etc/a$b"}))


def test_plans_an_older_version_left_readable_are_removed(tmp_path):
    """An older gpufleet wrote plans 0644 with executor arguments (a sudo password among them):
    they go, and .gpufleet and factplans become 0700; a current private plan stays."""
    top = tmp_path / ".gpufleet"
    plans = top / "factplans"
    plans.mkdir(parents=True)
    top.chmod(0o755)
    plans.chmod(0o755)
    old = plans / "gpu-a01.json"
    old.write_text('{"facts": [["x", "{\\"_sudo_password\\": \\"hunter2\\"}"]]}')
    old.chmod(0o644)
    current = plans / "gpu-a02.json"
    current.write_text("{}")
    current.chmod(0o600)
    assert factcache.sweep_old_plans(plans) == [old]
    assert not old.exists() and current.exists()
    assert (top.stat().st_mode & 0o777, plans.stat().st_mode & 0o777) == (0o700, 0o700)


def test_probes_are_never_in_a_later_runs_prefetch(local, monkeypatch):
    """The DCGM and performance probes and the PyTorch build fact load GPUs or import torch:
    asked by validate.py, they must not run again in the next all.py's prefetch."""
    from gpufleet.facts.pytorch import TorchBuild
    from gpufleet.facts.dcgm_diag import DcgmDiag
    from gpufleet.facts.gpu_checks import PerfProbe
    from gpufleet.facts.system import UnitActive

    assert TorchBuild.gpufleet_no_prefetch and DcgmDiag.gpufleet_no_prefetch and PerfProbe.gpufleet_no_prefetch

    def planned_after_asking():
        state, host, _ = local()
        get_fact(state, host, UnitActive, kwargs={"unit": "gpufleet-none.service"})
        get_fact(state, host, Arch)
        return [path for path, _ in host_context(host).plan_seen]

    assert "gpufleet.facts.system.UnitActive" in planned_after_asking()  # the control: recorded normally
    monkeypatch.setattr(UnitActive, "gpufleet_no_prefetch", True, raising=False)
    assert planned_after_asking() == ["pyinfra.facts.server.Arch"]


def test_a_file_uploaded_in_a_run_is_checked_in_the_next_runs_prefetch(local, tmp_path):
    """files.put asks only File for a file it creates; the next run asks Sha1File of it. That
    question is in the plan, so the first re-run after a converge sends no command per file."""
    import io

    path = str(tmp_path / "uploaded.conf")
    state, host, calls = local()
    assert get_fact(state, host, File, kwargs={"path": path}) is None  # what files.put asks first
    host.put_file(io.BytesIO(b"managed\n"), path)
    get_fact(state, host, Arch)
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects

    state, host, calls = local()  # the re-run: files.put compares checksums now
    assert get_fact(state, host, Sha1File, kwargs={"path": path}) == "e1fa417ad9e9880d4c50b3c10306395a4861a8a5"
    assert get_fact(state, host, Arch) == os.uname().machine
    assert len(calls) == 1 and "gpufleet-prefetch" in str(calls[0])


def test_an_upload_with_other_privileges_is_not_planned(local, tmp_path):
    import io

    state, host, _ = local()
    get_fact(state, host, Arch)
    factcache._record_upload(host, (io.BytesIO(b"x\n"), str(tmp_path / "as-sudo")), {"_sudo": True})
    factcache._record_upload(host, (io.BytesIO(b"x\n"), str(tmp_path / "as-is")), {"_sudo": False})
    planned = [kwargs for _, kwargs in host_context(host).plan_seen]
    assert not any("as-sudo" in kwargs for kwargs in planned)
    assert any("as-is" in kwargs for kwargs in planned)  # the control


def test_a_deploy_runs_prefetch_leaves_out_the_gates_end_of_run_facts(local, monkeypatch):
    """The exporters' scrape (MetricsEndpoint) is asked by the gate at the end of a run only:
    a deploy run (prefetch_all) never uses a prefetched answer, the fleet report does."""
    from gpufleet.facts.monitoring import MetricsEndpoint
    from gpufleet.facts.system import UnitActive
    from gpufleet.config.hostcontext import fleet_context

    assert MetricsEndpoint.gpufleet_end_of_run
    monkeypatch.setattr(UnitActive, "gpufleet_end_of_run", True, raising=False)
    state, host, _ = local()
    get_fact(state, host, UnitActive, kwargs={"unit": "gpufleet-none.service"})
    get_fact(state, host, Arch)
    get_fact(state, host, File, kwargs={"path": "/nonexistent-gpufleet"})
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects

    def planned(deploy_run):
        state, host, _ = local()
        if deploy_run:
            fleet_context(state).deploy_run = True  # what prefetch_all marks
        factcache._default_executor_json(state, host)
        return [entry[0].__name__ for entry in factcache._plan_entries(state, host)]

    assert sorted(planned(deploy_run=False)) == ["Arch", "File", "UnitActive"]  # the report's prefetch
    assert sorted(planned(deploy_run=True)) == ["Arch", "File"]


def test_the_gates_unit_question_is_the_one_systemd_service_asked(local):
    """On a re-run that changed nothing the gate reads each exporter's unit state instead of
    scraping it: with the arguments pyinfra's systemd.service asks, so it is answered from memory."""
    from pyinfra.facts.systemd import SystemdStatus

    state, host, _ = local()
    unit = ["prometheus-node-exporter.service"]
    asked_by_the_deploy = factcache._key(state, host, SystemdStatus, [], {
        "user_mode": False, "machine": None, "user_name": None, "services": unit})
    asked_by_the_gate = factcache._key(state, host, SystemdStatus, [], {"services": unit})
    assert asked_by_the_gate == asked_by_the_deploy is not None
    assert asked_by_the_gate != factcache._key(state, host, SystemdStatus, [], {"services": ["other.service"]})


@pytest.mark.parametrize(("path", "kwargs"), [
    ("pyinfra.facts.systemd.SystemdStatus", {"user_mode": False, "machine": None, "user_name": None,
                                             "services": ["ssh.service", "nvidia-persistenced.service"]}),
    ("pyinfra.facts.systemd.SystemdEnabled", {"user_mode": False, "machine": None, "user_name": None,
                                              "services": "ssh.socket"}),
    ("pyinfra.facts.files.FindInFile", {"path": "/etc/default/sysstat", "pattern": "^ENABLED=.*$",
                                        "interpolate_variables": False, "extended_regex": False}),
    ("pyinfra.facts.files.Directory", {"path": "/etc/nftables.d"}),
    ("pyinfra.facts.deb.DebPackages", {}),
    ("gpufleet.facts.ssh.AuthorizedKeys", {"user": "lab-admin"}),
    ("gpufleet.facts.ssh.SmallModuli", {"min_bits": 3072, "path": "/etc/ssh/moduli"}),
    ("gpufleet.facts.slurm.SlurmNode", {"node": ""}),
    ("gpufleet.facts.packages.PackageVersions", {"packages": ["nvidia-open", "cuda-toolkit-12-*"]}),
    ("gpufleet.facts.monitoring.MetricsEndpoint", {"url": "http://127.0.0.1:9100/metrics", "family": "node_cpu",
                                                   "sample": "node_cpu_seconds_total"}),
])
def test_the_argument_shapes_gpufleet_asks_are_allowed(path, kwargs):
    assert factcache.allowed(path, json.dumps(kwargs, sort_keys=True))


# --- framing: no fact output can forge another fact's answer -------------------------------

def _arch_script(n=3):
    fact = Arch()
    entries = [(Arch, json.dumps({"i": i}), "{}", fact, "uname -m") for i in range(n)]
    return factcache.prefetch_script(entries), entries


def _output(script, sections, host_nonce="0123456789abcdef" * 2):
    mark = f"::gpufleet-prefetch::{script.nonce}-{host_nonce}::"
    rc = f"::gpufleet-rc::{script.nonce}-{host_nonce}::"
    lines = [f"::gpufleet-prefetch::{script.nonce}::host {host_nonce}"]
    for i, out in sections:
        lines += [f"{mark}{i}", *out, "", f"{rc}0"]
    return lines, mark, rc


def test_well_framed_output_answers_every_fact():
    script, entries = _arch_script()
    lines, _, _ = _output(script, [(i, [f"arch{i}"]) for i in range(3)])
    answers = script.answers(lines)
    assert sorted(answers.values()) == ["arch0", "arch1", "arch2"] and script.refused is None


@pytest.mark.parametrize("forged", [
    # the old fixed markers: section 0 "answered" again from section 2's output (a user's file)
    ["::gpufleet-prefetch::0", "evil", "::gpufleet-rc::0"],
    # guesses at the new format: the run's own nonce (ps shows it), any host nonce
    ["::gpufleet-prefetch::NONCE-" + "f" * 32 + "::0", "evil", "::gpufleet-rc::NONCE-" + "f" * 32 + "::0"],
    ["::gpufleet-prefetch::NONCE::host " + "f" * 32],
    ["::gpufleet-gzip-base64::"],
])
def test_marker_shaped_lines_in_a_facts_output_drop_every_answer(forged):
    script, _ = _arch_script()
    forged = [line.replace("NONCE", script.nonce) for line in forged]
    lines, _, _ = _output(script, [(0, ["x86_64"]), (1, ["x86_64"]), (2, ["x86_64", *forged])])
    assert script.answers(lines) == {}
    assert "shaped like the prefetch's markers" in script.refused


@pytest.mark.parametrize("case", ["repeated", "out-of-order", "missing", "no-host-nonce", "short-host-nonce",
                                  "status-outside", "stray-line", "unclosed"])
def test_a_marker_repeated_or_out_of_order_drops_every_answer(case):
    """Even with the right nonces (which the output's own sections cannot know): the output
    is exactly header, then sections 0..n-1 each closed by its status, or nothing is used."""
    script, _ = _arch_script()
    good, mark, rc = _output(script, [(i, [f"arch{i}"]) for i in range(3)])
    lines = {
        "repeated": _output(script, [(0, ["a"]), (1, ["b"]), (1, ["evil"]), (2, ["c"])])[0],
        "out-of-order": _output(script, [(0, ["a"]), (2, ["c"]), (1, ["b"])])[0],
        "missing": _output(script, [(0, ["a"]), (1, ["b"])])[0],
        "no-host-nonce": [good[0].rsplit(" ", 1)[0] + " ", *good[1:]],
        "short-host-nonce": _output(script, [(i, ["a"]) for i in range(3)], host_nonce="0123")[0],
        "status-outside": good[:5] + [f"{rc}0"] + good[5:],
        "stray-line": good[:5] + ["between sections"] + good[5:],
        "unclosed": good[:-1],
    }[case]
    assert script.answers(lines) == {} and script.refused
    assert script.answers(good) and len(script.answers(good)) == 3  # the control


def test_forged_sections_in_a_file_do_not_answer_other_facts_and_the_facts_are_asked_again(local, tmp_path, caplog):
    """A real prefetch on @local: a file another user writes holds old-style sections that
    would answer an earlier fact (Arch): every answer is dropped, with a warning, and each
    fact is asked again the normal way, with the host's real answers."""
    from pyinfra.facts.files import FileContents

    theirs = tmp_path / "authorized_keys"
    theirs.write_text("ssh-ed25519 AAAA x\n::gpufleet-prefetch::0\nforged-arch\n::gpufleet-rc::0\n")
    state, host, calls = local()
    get_fact(state, host, Arch)
    get_fact(state, host, FileContents, kwargs={"path": str(theirs)})
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects

    state, host, calls = local()  # the next run
    assert get_fact(state, host, Arch) == os.uname().machine
    assert get_fact(state, host, FileContents, kwargs={"path": str(theirs)})[1] == "::gpufleet-prefetch::0"
    assert len(calls) == 3 and "gpufleet-prefetch" in str(calls[0])  # the prefetch, then one command each
    assert "every prefetched fact answer dropped" in caplog.text and "shaped like the prefetch's markers" in caplog.text


def test_the_hosts_nonce_is_never_on_a_command_line(local, tmp_path):
    """ps shows every local user the script (and the controller's nonce) while it runs: the
    host draws its own, into a shell variable, and prints it only into the framed output."""
    state, host, calls = local()
    get_fact(state, host, Arch)
    get_fact(state, host, File, kwargs={"path": str(tmp_path)})
    disconnect_all(state)  # the run's end: each host's plan is written as it disconnects
    state, host, calls = local()
    get_fact(state, host, Arch)
    text = str(calls[0])
    assert "/dev/urandom" in text and "gf_h=$(od" in text
    two = factcache.prefetch_script([]), factcache.prefetch_script([])
    assert two[0].nonce != two[1].nonce and len(two[0].nonce) == 16


def test_fresh_facts_are_read_from_the_host_not_from_memory(local, tmp_path):
    state, host, calls = local()
    get_fact(state, host, Arch)
    get_fact(state, host, Arch)
    assert len(calls) == 1
    with factcache.fresh(host):
        assert get_fact(state, host, Arch) == os.uname().machine
    assert len(calls) == 2
    get_fact(state, host, Arch)
    assert len(calls) == 2  # the fresh answer is remembered
