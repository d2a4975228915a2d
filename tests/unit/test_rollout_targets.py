"""The rollout's per-host target: the inventory's, or an override put in its place; and the
inventory lines an operator sets after an override."""
from gpufleet.rollout import targets
from gpufleet.config.settings import Settings


def test_override_takes_the_inventory_place_with_its_branch():
    import dataclasses

    fields = {f.name: None for f in dataclasses.fields(Settings)}
    s = Settings(**{**fields, "driver_version": "auto", "driver_branch": "580"})
    w = targets.wishes(s, "595.45.04")
    assert (w.driver_version, w.driver_branch) == ("595.45.04", "595")
    assert targets.wishes(s, None) is s


def test_refusal_line_names_host_key_and_allowed():
    line = targets.refusal_line("h1", ("driver_branch", "V100 (volta) is not supported by driver branch R595",
                                       "R570, R580"), "595.45.04")
    assert line == ("host h1: --driver-version 595.45.04 (as driver_branch): V100 (volta) is not supported by "
                    "driver branch R595; allowed: R570, R580")
    assert targets.refusal_line("h2", ("cuda_version", "too new", "12.8"), None) == \
        "host h2: key 'cuda_version': too new; allowed: 12.8"


def test_inventory_lines_point_at_where_the_value_comes_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "inv.py").write_text(
        "pinned = [('a', {'tier': 'research', 'driver_version': '580.95.05'})]\n"
        "grouped = ['b', 'c']\n"
        "tiered = [('d', {'tier': 'research'})]\n")
    (tmp_path / "group_data").mkdir()
    (tmp_path / "group_data" / "grouped.py").write_text("tier = 'research'\ndriver_version = '580.95.05'\n")
    lines = targets.inventory_lines("inv.py", ["a", "b", "c", "d"], "580.126.09")
    assert 'inv.py: host a: set driver_version: "580.126.09" (now \'580.95.05\')' in lines
    assert 'inv.py: the data of group grouped (2 host(s)): set driver_version: "580.126.09" (now \'580.95.05\')' in lines
    assert any(line.startswith('inv.py: add driver_version: "580.126.09" to the data of d') for line in lines)
    assert len(lines) == 3                      # same branch: no driver_branch line
    assert targets.inventory_lines("inv.py", ["a"], "580.95.05") == []   # says so already
