"""gpufleet/dockerconf: daemon.json merged, not overwritten (pure functions)."""
import json

import pytest

from gpufleet.plans import dockerconf
from gpufleet.plans.dockerconf import DockerDefaults, MalformedDaemonJson, merge, needs_write, parse, render

pytestmark = pytest.mark.unit

TIER = DockerDefaults(default_runtime="nvidia", cdi=True, shm_size="1g", ulimits={"memlock": -1, "stack": 67108864})
OPERATOR = {
    "log-driver": "json-file",
    "log-opts": {"max-size": "100m", "max-file": "3"},
    "registry-mirrors": ["https://mirror.example.org"],
    "runtimes": {"crun": {"path": "/usr/bin/crun"}},
    "default-ulimits": {"nofile": {"Name": "nofile", "Hard": 65536, "Soft": 65536}},
    "features": {"buildkit": True},
}


def test_merge_adds_runtime_and_tier_defaults():
    merged = merge(None, TIER)
    assert merged == {
        "default-runtime": "nvidia",
        "default-shm-size": "1g",
        "default-ulimits": {
            "memlock": {"Hard": -1, "Name": "memlock", "Soft": -1},
            "stack": {"Hard": 67108864, "Name": "stack", "Soft": 67108864},
        },
        "features": {"cdi": True},
        "live-restore": True,
        "runtimes": {"nvidia": {"args": [], "path": "nvidia-container-runtime"}},
    }


def test_merge_keeps_every_operator_key():
    merged = merge(OPERATOR, TIER)
    for key in ("log-driver", "log-opts", "registry-mirrors"):
        assert merged[key] == OPERATOR[key]
    assert merged["runtimes"]["crun"] == {"path": "/usr/bin/crun"}
    assert merged["default-ulimits"]["nofile"] == OPERATOR["default-ulimits"]["nofile"]
    assert merged["features"] == {"buildkit": True, "cdi": True}
    assert "nvidia" in merged["runtimes"] and merged["default-runtime"] == "nvidia"


def test_merge_does_not_mutate_its_input():
    before = json.dumps(OPERATOR, sort_keys=True)
    merge(OPERATOR, TIER)
    assert json.dumps(OPERATOR, sort_keys=True) == before


def test_merge_is_idempotent_and_needs_no_second_write():
    once = merge(OPERATOR, TIER)
    twice = merge(parse(render(once).encode()), TIER)
    assert twice == once
    assert not needs_write(parse(render(once).encode()), twice)


def test_runc_tier_and_cdi_off():
    want = DockerDefaults(default_runtime="runc", cdi=False, shm_size="64g", ulimits={})
    merged = merge({"features": {"buildkit": True}}, want)
    assert merged["default-runtime"] == "runc"
    assert merged["features"] == {"buildkit": True}  # cdi left alone when off
    assert merged["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"  # still usable with --runtime=nvidia
    assert merged["default-shm-size"] == "64g"


def test_render_is_byte_stable():
    a = render(merge(OPERATOR, TIER))
    b = render(merge(dict(reversed(list(OPERATOR.items()))), TIER))
    assert a == b and a.endswith("}\n")
    assert a.splitlines()[1].startswith('    "default-runtime"')  # sorted keys, 4-space indent


def test_same_json_in_another_format_is_not_rewritten():
    text = json.dumps(merge(OPERATOR, TIER), indent=1)  # operator's own formatting
    assert not needs_write(parse(text.encode()), merge(parse(text.encode()), TIER))


def test_replaced_operator_values_are_reported():
    existing = {"default-runtime": "runc", "default-shm-size": "64m", "log-driver": "local"}
    merged = merge(existing, TIER)
    assert dockerconf.replaced_keys(existing, merged) == ["default-runtime", "default-shm-size"]


def test_absent_and_empty_files():
    assert parse(None) is None
    assert parse(b"") == {} and parse(b"  \n") == {}
    assert needs_write(None, merge(None, TIER))


@pytest.mark.parametrize("raw,fragment", [
    (b'{"log-driver": "json-file",}', "invalid JSON at line 1"),
    (b'{\n  "a": 1\n  "b": 2\n}', "line 3"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"a": 1, "a": 2}', "appears twice"),
    (b'{"runtimes": []}', "'runtimes' must be an object"),
    (b'{"default-ulimits": "x"}', "'default-ulimits' must be an object"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_malformed_files_are_refused_with_a_clear_reason(raw, fragment):
    with pytest.raises(MalformedDaemonJson) as exc:
        parse(raw)
    assert fragment in str(exc.value)


def test_defaults_from_settings():
    from gpufleet.catalog.tiers import tier_defaults

    class S:
        pass

    s = S()
    for key, value in tier_defaults("hgx").items():
        setattr(s, key, value)
    d = DockerDefaults.from_settings(s)
    assert d.shm_size == "64g" and d.default_runtime == "nvidia" and d.cdi is True
    assert d.ulimits == {"memlock": -1, "stack": 67108864}


# ---- applying a change without killing GPU work ----------------------------------------------

def _plan(existing, merged, **kw):
    args = dict(running=True, live_restore_on=False, gpu_containers=[], policy="live-restore", containers=0)
    args.update(kw)
    return dockerconf.apply_plan(existing, merged, **args)


def test_changed_keys_and_partial():
    old = {"a": 1, "b": {"x": 1}, "gone": True}
    new = {"a": 1, "b": {"x": 2}, "c": 3}
    assert dockerconf.changed_keys(old, new) == ["b", "c", "gone"]
    assert dockerconf.partial(old, new, ["c", "gone"]) == {"a": 1, "b": {"x": 1}, "c": 3}


def test_only_reloadable_keys_changed_is_a_reload_never_a_restart():
    old = merge(OPERATOR, TIER)
    new = dict(old, **{"default-shm-size": "2g", "registry-mirrors": []})
    plan = _plan(old, new, gpu_containers=["train"])
    assert plan.steps == (("write",), ("reload",)) and not plan.pending


def test_nothing_changed_and_engine_down():
    merged = merge(None, TIER)
    assert _plan(merged, merged).steps == ()
    assert _plan(None, merged, running=False).steps == (("write",),)


def test_restart_when_idle():
    old = {"log-driver": "json-file"}
    assert _plan(old, merge(old, TIER)).steps == (("write",), ("restart",))


def test_live_restore_switched_on_by_reload_before_a_restart_under_running_gpu_containers():
    old = {"log-driver": "json-file"}
    plan = _plan(old, merge(old, TIER), gpu_containers=["train"])
    assert plan.steps[0][0] == "write-reloadable" and "live-restore" in plan.steps[0][1]
    assert "default-ulimits" not in plan.steps[0][1] and "features" not in plan.steps[0][1]
    assert plan.steps[1:] == (("reload",), ("check-live-restore",), ("write",), ("restart",))
    assert not plan.pending
    # the same with other (non-GPU) containers: they survive too
    assert _plan(old, merge(old, TIER), containers=2).steps[1:] == plan.steps[1:]


def test_live_restore_already_on_restart_is_checked_first():
    old = dict(merge(None, TIER), **{"default-ulimits": {}})
    plan = _plan(old, merge(None, TIER), gpu_containers=["train"], live_restore_on=True)
    assert plan.steps == (("check-live-restore",), ("write",), ("restart",))


def test_pending_when_gpu_containers_run_and_nothing_keeps_them():
    no_live = TIER.__class__(**{**TIER.__dict__, "live_restore": False})
    old = {"log-driver": "json-file"}
    plan = _plan(old, merge(old, no_live), gpu_containers=["train", "infer"])
    assert plan.pending == ("default-ulimits", "features")
    assert plan.steps[0] == ("write-reloadable", ("default-runtime", "default-shm-size", "live-restore", "runtimes"))
    assert plan.steps[1:] == (("reload",),)
    assert "2 GPU container(s) running (train, infer)" in plan.why and "live-restore is off" in plan.why
    never = _plan(old, merge(old, TIER), gpu_containers=["train"], policy="never")
    assert never.pending == ("default-ulimits", "features") and "never" in never.why
    # a second run over the partly written file: still pending, nothing written
    partial_file = dockerconf.partial(old, merge(old, no_live), list(plan.steps[0][1]))
    again = _plan(partial_file, merge(partial_file, no_live), gpu_containers=["train"])
    assert again.steps == () and again.pending == ("default-ulimits", "features")


def test_policy_always_restarts_anyway():
    old = {"log-driver": "json-file"}
    plan = _plan(old, merge(old, TIER), gpu_containers=["train"], policy="always", live_restore_on=True)
    assert plan.steps == (("write",), ("restart",))
    with pytest.raises(ValueError):
        _plan(old, merge(old, TIER), policy="sometimes")


def test_restart_for_the_toolkit_without_a_daemon_json_change():
    merged = merge(None, TIER)
    why = ("the NVIDIA container toolkit was installed",)
    assert _plan(merged, merged, restart_for=why).steps == (("restart",),)
    assert _plan(merged, merged, restart_for=why, running=False).steps == ()
    busy = _plan(merged, merged, restart_for=why, gpu_containers=["train"], live_restore_on=False)
    assert busy.steps == () and busy.pending == why
    kept = _plan(merged, merged, restart_for=why, gpu_containers=["train"], live_restore_on=True)
    assert kept.steps == (("check-live-restore",), ("restart",))
