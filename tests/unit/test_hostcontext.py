"""gpufleet's per-host and per-run state lives in gpufleet.config.hostcontext, beside pyinfra's objects:
one context per real Host (or Inventory), fresh for every new State, gone with its Host, and no
`_gpufleet_*` attribute hung on a pyinfra object any more."""
from __future__ import annotations

import ast
import gc
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State

from gpufleet.config.hostcontext import FleetContext, HostContext, fleet_context, host_context
from gpufleet.config.settings import host_settings, validate_inventory

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("gpufleet", "deploys", "operations", "facts", "inventories", "testing", "tools", "bench")
PREFIX = "_gpufleet_"


def new_state(*names: str, tier: str = "dev") -> State:
    inventory = Inventory(([(name, {"tier": tier}) for name in names], {}))
    return State(inventory, Config())


def stray_attributes(source: str, filename: str = "<source>") -> list[str]:
    """Every way a `_gpufleet_*` attribute could be set or read on an object: `x._gpufleet_a`,
    getattr/setattr/hasattr/delattr(x, "_gpufleet_a"), `x.__dict__["_gpufleet_a"]` and
    `x.__dict__.get/setdefault("_gpufleet_a")` (any string starting so counts)."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Attribute) and node.attr.startswith(PREFIX):
            found.append(f"{filename}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(PREFIX):
            found.append(f"{filename}:{node.lineno}: {node.value!r}")
    return found


def test_no_gpufleet_attribute_is_hung_on_a_pyinfra_object():
    found = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            found += stray_attributes(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    assert not found, "keep gpufleet's state in gpufleet.config.hostcontext, not on pyinfra's objects:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "host._gpufleet_facts = {}",
    "cache = getattr(host, '_gpufleet_facts', None)",
    "setattr(state, '_gpufleet_prefetch_all', True)",
    "host.__dict__.setdefault('_gpufleet_executors', {})",
    "known = host.__dict__['_gpufleet_default_executor_json']",
])
def test_the_check_finds_each_way_of_hanging_one(line):
    assert stray_attributes(line)


def test_one_context_per_host_and_the_proxy_finds_the_real_hosts():
    from pyinfra import host as host_proxy
    from pyinfra.context import ctx_host

    state = new_state("gpu-a01", "gpu-a02")
    a, b = (state.inventory.get_host(name) for name in ("gpu-a01", "gpu-a02"))
    assert isinstance(host_context(a), HostContext)
    assert host_context(a) is host_context(a) and host_context(a) is not host_context(b)
    host_context(a).facts["gpu_state"] = "a's"
    with ctx_host.use(b):
        assert host_context(host_proxy) is host_context(b) and "gpu_state" not in host_context(host_proxy).facts
    with ctx_host.use(a):
        assert host_context(host_proxy).facts == {"gpu_state": "a's"}
    assert not any(name.startswith(PREFIX) for name in vars(a))  # nothing hung on the Host


def test_a_new_state_starts_from_empty_contexts_for_a_host_of_the_same_name():
    """Tests (and the rollout's phases) run several pyinfra States in one process: a host named
    like one of an earlier run must not see that run's facts, memo, prefetch or settings."""
    first = new_state("gpu-a01")
    old = first.inventory.get_host("gpu-a01")
    assert host_settings(old).tier == "dev"
    context = host_context(old)
    context.facts["gpu_state"] = "first run's"
    context.fact_memo[("pyinfra.facts.server.Arch", "{}", "{}")] = "x86_64"
    context.prefetched = True
    fleet_context(first).prefetch_all_sent = True

    second = new_state("gpu-a01", tier="hgx")
    new = second.inventory.get_host("gpu-a01")
    assert host_context(new) == HostContext()
    assert fleet_context(second) == FleetContext()
    assert host_settings(new).tier == "hgx"  # not the first run's settings
    assert host_context(old).facts == {"gpu_state": "first run's"}  # the first run's are its own


def test_a_state_and_its_inventory_share_one_fleet_context():
    state = new_state("gpu-a01")
    assert fleet_context(state) is fleet_context(state.inventory)
    validate_inventory(state.inventory, source="", hosts=list(state.inventory))
    assert fleet_context(state).problems == []


def test_the_inventory_is_validated_once_per_run_and_again_for_a_new_one():
    state = new_state("gpu-a01")
    fleet_context(state).problems = ["gpu-a01: tier: found 'nope'"]  # as if found earlier this run
    with pytest.raises(Exception, match="found 'nope'"):
        validate_inventory(state.inventory, source="", hosts=list(state.inventory))
    validate_inventory(new_state("gpu-a01").inventory, source="")  # a new inventory: checked afresh


def test_a_context_goes_away_with_its_host():
    import weakref

    from gpufleet.config import hostcontext

    state = new_state("gpu-gone")
    host = state.inventory.get_host("gpu-gone")
    host_context(host).facts["x"] = 1
    fleet_context(state)
    gc.collect()  # earlier tests' hosts go first
    before, fleets = len(hostcontext._HOSTS), len(hostcontext._FLEETS)
    alive = weakref.ref(host)
    del host, state
    gc.collect()
    assert alive() is None
    assert len(hostcontext._HOSTS) == before - 1 and len(hostcontext._FLEETS) == fleets - 1
