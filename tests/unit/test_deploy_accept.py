"""gpufleet-deploy and a new host's acceptance (issue 46 item 1): its --accept / --no-accept
command line, what all.py's run tells it (gpufleet/controller/run_result.py), and the sentence
a bare all.py ends with for the converged hosts not accepted (gpufleet/controller/run_summary.py)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from gpufleet.apps import deploy
from gpufleet.apps.exits import EXIT_CODES, epilog
from gpufleet.controller import run_result
from gpufleet.controller.run_summary import RunSummary

pytestmark = pytest.mark.unit
TAKES_VALUE = frozenset({"--limit", "--data", "--config", "--exclude"})


@pytest.fixture
def inv(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "inv.py"
    path.write_text("hosts = ['a', 'b', 'c']\n")
    return path


@pytest.fixture
def calls(monkeypatch) -> list:
    """What main() started: pyinfra exec'd in its place, all.py then the acceptance, or the
    acceptance alone; nothing runs."""
    seen: list = []

    def execv(_exe: str, argv: list[str]) -> None:
        seen.append(("exec", argv[3:]))

    monkeypatch.setattr(deploy.os, "execv", execv)
    monkeypatch.setattr(deploy, "deploy_and_accept", lambda command, source: seen.append(
        ("deploy+accept", command, source)) or 0)
    monkeypatch.setattr(deploy, "accept_hosts", lambda source, names: seen.append(("accept", names, source)) or 0)
    return seen


def test_all_runs_the_deploy_then_the_acceptance(inv, calls):
    assert deploy.main([str(inv), "-y", "--limit", "b", "--data", "tier=dev"]) == 0
    (what, command, source), = calls
    assert what == "deploy+accept" and command[1] == str(deploy.DEPLOYS / "all.py") and "--accept" not in command
    # the acceptance sees the hosts and data the pyinfra run sees
    assert source.path == str(inv) and source.limit == ["b"] and source.data == {"tier": "dev"}


def test_no_accept_runs_pyinfra_alone_and_says_so(inv, calls, capsys):
    assert deploy.main([str(inv), "--no-accept", "-y"]) in (0, None)
    assert calls == [("exec", [str(inv), str(deploy.DEPLOYS / "all.py"), "-y"])]   # the flag is not pyinfra's
    assert "acceptance left out (--no-accept)" in capsys.readouterr().out


def test_accept_runs_only_the_acceptance_of_the_limited_hosts(inv, calls):
    assert deploy.main([str(inv), "--accept", "--limit", "c", "--exclude=a"]) == 0
    assert calls[0][:2] == ("accept", ["c"])
    assert deploy.main([str(inv), "--accept"]) == 0
    assert calls[1][:2] == ("accept", ["a", "b", "c"])


def test_another_area_or_a_dry_run_accepts_nothing(inv, calls, capsys):
    deploy.main([str(inv), "tuning", "-y"])
    deploy.main([str(inv), "--dry"])
    assert [c[0] for c in calls] == ["exec", "exec"]
    assert "--dry changes nothing" in capsys.readouterr().out


@pytest.mark.parametrize("args, fragment", [
    (["{inv}", "--accept", "--no-accept"], "--accept and --no-accept exclude each other"),
    (["{inv}", "tuning", "--accept"], "--accept is for area all"),
    (["{inv}", "--no-accept", "hardening"], "--no-accept is for area all"),
    (["{inv}", "--accept", "--limit", "nosuchhost"], "--limit 'nosuchhost': no group or host"),
    (["{inv}", "--accept", "--data", "novalue"], "expected KEY=VALUE"),
])
def test_a_bad_acceptance_command_line_stops_before_anything_runs(args, fragment, inv, calls, capsys):
    assert deploy.main([a.format(inv=inv) for a in args]) == deploy.USAGE
    assert calls == []
    assert fragment in capsys.readouterr().err


def test_option_values_skip_other_options_values():
    args = ["inv.py", "--limit", "a", "--data", "x=--limit", "--limit=b", "--config", "c.py", "--", "--limit", "z"]
    assert deploy.option_values(args, "--limit", TAKES_VALUE) == ["a", "b"]
    assert deploy.option_values(args, "--data", TAKES_VALUE) == ["x=--limit"]


def test_the_exit_code_of_a_failed_acceptance_is_documented():
    codes = dict(EXIT_CODES["gpufleet-deploy"])
    assert deploy.EXIT_NOT_ACCEPTED not in (0, 1, deploy.USAGE)
    assert "acceptance" in codes[deploy.EXIT_NOT_ACCEPTED] and "drained" in codes[deploy.EXIT_NOT_ACCEPTED]
    assert f"{deploy.EXIT_NOT_ACCEPTED} every host done, but a host failed its acceptance" in epilog("gpufleet-deploy")


# --- what all.py's run tells gpufleet-deploy ------------------------------------------------------

def test_the_run_result_names_the_converged_hosts_privately(tmp_path, monkeypatch):
    from pyinfra.api import Inventory, State

    inventory = Inventory((["a", "b", "c"], {}))
    state = State(inventory)
    a, b, _c = (inventory.get_host(n) for n in "abc")
    state.activated_hosts.update({a, b})     # c never reached
    state.active_hosts.update({a, b})
    state.fail_hosts({b})
    folder = tmp_path / "private"
    path = folder / "results.json"
    monkeypatch.setenv(run_result.ENV, str(path))
    run_result.write(state)
    assert json.loads(path.read_text()) == {"hosts": {"a": "ok", "b": "failed"}}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert run_result.read(str(path)) == {"a": "ok", "b": "failed"}
    assert run_result.read(str(tmp_path / "none.json")) == {}


def test_a_results_file_others_may_write_is_not_trusted(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"hosts": {"a": "ok"}}))
    os.chmod(path, 0o666)
    assert run_result.read(str(path)) == {}


# --- the sentence a run ends with ------------------------------------------------------------------

def test_the_run_end_names_converged_hosts_not_accepted_and_the_command():
    summary = RunSummary(not_accepted={"gpu-02": "none on record", "gpu-01": "accepted 2026-12-01T10:00:00Z with "
                                       "driver 570.172.08, driver 580.126.09 loaded now"})
    text = summary.report()
    assert ("--> gpufleet: 2 host(s) converged but NOT ACCEPTED: no acceptance on record for their driver and CUDA"
            in text)
    assert "Accept them: gpufleet-deploy INVENTORY --accept" in text
    assert text.index("gpu-01: accepted 2026-12-01") < text.index("gpu-02: none on record")
    assert "runs their acceptance now" in summary.report(accepts_next=True)
    assert RunSummary().report() == ""
