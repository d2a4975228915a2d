"""gpufleet/controller/inventory_source.py: the tools' --limit, --exclude, --data and config.py, with pyinfra's
semantics (issue 20); validate_inventory checks only the hosts a run is limited to."""
from __future__ import annotations

import argparse

import pytest
from pyinfra.api import Config, State
from pyinfra.context import ctx_state

from gpufleet.errors import InventoryError
from gpufleet.controller.inventory_source import InventorySource, SourceError, add_arguments
from gpufleet.config.settings import validate_inventory

pytestmark = pytest.mark.unit

INVENTORY = '''
gpu_a = [("a1", {"tier": "dev"}), ("a2", {"tier": "dev"})]
gpu_b = [("b1", {"tier": "dev"})]
broken = [("x1", {"tier": "no-such-tier"})]
'''


def _source(tmp_path, monkeypatch, *argv: str) -> InventorySource:
    (tmp_path / "inv").mkdir(exist_ok=True)
    (tmp_path / "inv" / "fleet.py").write_text(INVENTORY)
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    parser.add_argument("inventory")
    add_arguments(parser)
    return InventorySource.from_args(parser.parse_args(["inv/fleet.py", *argv]))


def _names(src: InventorySource) -> list[str]:
    return [h.name for h in src.hosts(src.load())]


def test_limit_takes_groups_names_and_patterns_as_pyinfra(tmp_path, monkeypatch):
    assert _names(_source(tmp_path, monkeypatch)) == ["a1", "a2", "b1", "x1"]
    assert _names(_source(tmp_path, monkeypatch, "--limit", "gpu_a")) == ["a1", "a2"]
    assert _names(_source(tmp_path, monkeypatch, "--limit", "b1", "--limit", "a*")) == ["a1", "a2", "b1"]
    assert _names(_source(tmp_path, monkeypatch, "--limit", "fleet")) == ["a1", "a2", "b1", "x1"]  # the file's group
    with pytest.raises(SourceError, match="--limit 'gpu_z': no group or host of inv/fleet.py matches"):
        _names(_source(tmp_path, monkeypatch, "--limit", "gpu_a", "--limit", "gpu_z"))


def test_exclude_leaves_out_groups_names_and_patterns_as_pyinfra(tmp_path, monkeypatch):
    assert _names(_source(tmp_path, monkeypatch, "--exclude", "gpu_a")) == ["b1", "x1"]
    assert _names(_source(tmp_path, monkeypatch, "--exclude", "b1", "--exclude", "x*")) == ["a1", "a2"]
    assert _names(_source(tmp_path, monkeypatch, "--limit", "gpu_a", "--exclude", "a2")) == ["a1"]
    assert _names(_source(tmp_path, monkeypatch, "--exclude", "fleet")) == []
    src = _source(tmp_path, monkeypatch, "--exclude", "gpu_b", "--exclude", "a1")
    assert src.excluded(src.load()) == ["a1", "b1"]
    # a mistyped --exclude would contact the host the operator meant to leave out: refused
    with pytest.raises(SourceError, match="--exclude 'gpu_z': no group or host of inv/fleet.py matches"):
        _names(_source(tmp_path, monkeypatch, "--exclude", "gpu_z"))


@pytest.mark.parametrize("limit,exclude", [((), ("gpu_a",)), (("gpu_a", "b1"), ("a2",)), ((), ("?1", "fleet")),
                                           (("a*",), ("[ab]2",))])
def test_exclude_selects_what_the_pyinfra_command_line_selects(tmp_path, monkeypatch, limit, exclude):
    from pyinfra_cli.cli import _apply_inventory_exclude, _apply_inventory_limit

    argv = [x for pattern in limit for x in ("--limit", pattern)] + [x for p in exclude for x in ("--exclude", p)]
    src = _source(tmp_path, monkeypatch, *argv)
    inventory = src.load()
    theirs = _apply_inventory_exclude(inventory, _apply_inventory_limit(inventory, limit), exclude)
    assert set(src.hosts(inventory)) == set(theirs if theirs is not None else inventory)


def test_data_is_parsed_as_pyinfra_parses_it(tmp_path, monkeypatch):
    src = _source(tmp_path, monkeypatch, "--data", "driver_reboot=never", "--data", "rollout_lock_wait=30",
                  "--data", "docker_ulimits={\"memlock\": -1}", "--data", "x=true", "--data", "y=a=b")
    assert src.data == {"driver_reboot": "never", "rollout_lock_wait": 30, "docker_ulimits": {"memlock": -1},
                        "x": True, "y": "a=b"}
    host = src.load().get_host("a1")
    assert host.data.driver_reboot == "never" and host.data.rollout_lock_wait == 30


@pytest.mark.parametrize("bad", ["novalue", "=x", ""])
def test_malformed_data_is_a_usage_error(tmp_path, monkeypatch, capsys, bad):
    with pytest.raises(SystemExit) as info:
        _source(tmp_path, monkeypatch, "--data", bad)
    assert info.value.code == 2 and "argument --data: expected KEY=VALUE" in capsys.readouterr().err


def test_config_py_beside_the_inventory_then_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "inv").mkdir()
    (tmp_path / "inv" / "config.py").write_text("from pyinfra import config\nconfig.SUDO = True\n")
    src = _source(tmp_path, monkeypatch)
    assert src.config_file == str((tmp_path / "inv" / "config.py").resolve())
    assert src.config().SUDO is True and src.config().PARALLEL == 0
    (tmp_path / "config.py").write_text("from pyinfra import config\nconfig.CONNECT_TIMEOUT = 3\n")
    here = _source(tmp_path, monkeypatch)   # pyinfra's own: the current directory's wins
    assert here.config().CONNECT_TIMEOUT == 3 and here.config().SUDO is False
    assert InventorySource("x").config().SUDO is False   # none: pyinfra's defaults


def test_a_broken_config_or_inventory_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "bad.py").write_text("raise RuntimeError('no')\n")
    src = _source(tmp_path, monkeypatch, "--config", "bad.py")
    with pytest.raises(SourceError, match=r"^config file bad.py: RuntimeError: no$"):
        src.config()
    (tmp_path / "inv" / "broken.py").write_text("gpu_a = [\n")
    with pytest.raises(SourceError, match=r"^inventory inv/broken.py: SyntaxError: '\[' was never closed"):
        InventorySource("inv/broken.py").load()
    with pytest.raises(SourceError, match="argument --config: no such file: nope.py"):
        _source(tmp_path, monkeypatch, "--config", "nope.py")


def test_validate_inventory_checks_only_the_limited_hosts(tmp_path, monkeypatch):
    src = _source(tmp_path, monkeypatch)
    inventory = src.load()
    with pytest.raises(InventoryError, match="host x1: key 'tier'"):
        validate_inventory(inventory)
    # as `pyinfra INVENTORY deploys/all.py --limit gpu_a` runs it: the state's limit
    inventory = src.load()
    with ctx_state.use(State(inventory, Config(), initial_limit=[inventory.get_host("a1")])):
        validate_inventory(inventory)
    inventory = src.load()
    validate_inventory(inventory, hosts=[inventory.get_host("b1")])
    inventory = src.load()
    with pytest.raises(InventoryError, match="host x1"):
        validate_inventory(inventory, hosts=[inventory.get_host("b1"), inventory.get_host("x1")])


# Compared with pyinfra's own answers: the `pyinfra` command's `debug-inventory`, and the
# command line's own --data and --limit functions (pyinfra_cli), which gpufleet does not call.

def test_the_loaded_inventory_is_what_the_pyinfra_command_loads(tmp_path, monkeypatch):
    import json
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "gpu_a.py").write_text('driver_reboot = "never"\n')
    (tmp_path / "group_data" / "all.py").write_text("rollout_lock_wait = 5\n")
    data = ["docker_ulimits={\"memlock\": -1}", "x=TRUE", "y=07", "z=a=b", "w=[1, \"two\"]"]
    src = _source(tmp_path, monkeypatch, *[a for d in data for a in ("--data", d)])
    ours = [{"name": h.name, "groups": list(h.groups), "data": h.data.dict()} for h in src.load()]
    pyinfra_cmd = Path(sys.executable).with_name("pyinfra")
    done = subprocess.run([str(pyinfra_cmd), "inv/fleet.py", *[a for d in data for a in ("--data", d)],
                           "--json", "debug-inventory"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)
    assert json.loads(json.dumps(ours)) == theirs
    assert theirs[0]["data"]["driver_reboot"] == "never" and theirs[0]["data"]["x"] is True  # it was read


@pytest.mark.parametrize("value", ["true", "False", "TRUE", "0", "07", "-3", " 5", "1.5", "1e3", "null", "[1, 2]",
                                   "{\"a\": 1}", "\"quoted\"", "text", "", "a=b", "NaN", "0x10", "1_000"])
def test_data_values_are_parsed_as_the_pyinfra_command_line_parses_them(value):
    import json

    from pyinfra_cli.util import parse_cli_arg

    from gpufleet.controller.inventory_source import cli_value

    ours, theirs = cli_value(value), parse_cli_arg(value)
    assert (type(ours), json.dumps(ours)) == (type(theirs), json.dumps(theirs))


@pytest.mark.parametrize("pattern", ["gpu_a", "fleet", "all", "a*", "b1", "?1", "[ab]2", "nothing", "gpu_*"])
def test_limit_patterns_match_as_the_pyinfra_command_line_matches_them(tmp_path, monkeypatch, pattern):
    from pyinfra_cli.cli import _get_inventory_pattern_matches

    from gpufleet.controller.inventory_source import pattern_matches

    inventory = _source(tmp_path, monkeypatch).load()
    assert set(pattern_matches(inventory, pattern)) == set(_get_inventory_pattern_matches(inventory, [pattern], "--limit"))
