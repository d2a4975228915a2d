"""gpufleet's own state for one run, kept beside pyinfra's objects, never on them.

One `HostContext` per pyinfra Host and one `FleetContext` per Inventory (an Inventory belongs to
one pyinfra State, and its Hosts to it), each reached by one function. They live in weak
dictionaries keyed by the real objects (never pyinfra's `host` context proxy, which follows
whichever host is current): a new State builds new Hosts, so a second run in one process (the
rollout's phases, the tests) starts from empty contexts even for a host of the same name, and a
context goes away with its Host.

Nothing in here may hold a reference back to its Host or Inventory (that would keep the entry
alive for ever): facts' answers, settings, counters and plain strings only.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings


def real_object(obj: Any) -> Any:
    """The object behind one of pyinfra's context proxies (`pyinfra.host`, `pyinfra.state`,
    `pyinfra.inventory`); any other object as it is."""
    for proxy, ctx in _proxies():
        if obj is proxy:
            return ctx.get()
    return obj


_PROXIES: list[tuple[Any, Any]] = []


def _proxies() -> list[tuple[Any, Any]]:
    """(proxy, its context manager) of pyinfra's host, state and inventory: made once by
    pyinfra.context, looked up once here (real_object runs ~1,500 times a host and run)."""
    if not _PROXIES:
        from pyinfra.context import ctx_host, ctx_inventory, ctx_state

        _PROXIES.extend((ctx.context, ctx) for ctx in (ctx_host, ctx_state, ctx_inventory))
    return _PROXIES


@dataclass
class HostOutcome:
    """What this run leaves for later on one host (gpufleet/controller/run_summary.py says it at
    the end of the run; the gate and the fleet report read it): written by the deploys while
    they plan, or by a callback while it executes (a reboot found busy). Empty: nothing left."""

    #: (installed, resolved) driver: an upgrade all.py leaves to tools/rollout
    driver_pending: tuple[str, str] | None = None
    #: {"CUDA toolkit" | "cuDNN": (installed, resolved)}
    stack_pending: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: {"CUDA toolkit" | "cuDNN": [what changed by hand]}: left as found, the gate FAILs them
    stack_by_hand: dict[str, list[str]] = field(default_factory=dict)
    #: why it needs a reboot
    needs_reboot: str = ""
    #: its reboot found GPU work right before it (started after planning): not rebooted
    busy_at_reboot: bool = False
    #: (daemon.json keys, why): a Docker restart not done under running GPU containers
    docker_pending: tuple[tuple[str, ...], str] | None = None
    #: (the MIG layout not applied, what ran): GPU work found right before the change
    mig_pending: tuple[str, str] | None = None
    #: the GPUs whose MIG mode change waits for a reboot (the GPU reset was refused)
    mig_reboot: str = ""
    #: the tuning_profiling setting the loaded nvidia module does not have yet (next boot)
    profiling_pending: str = ""
    #: the old mount points of a scratch that moved (storage_scratch_path), left mounted
    scratch_moved: str = ""
    #: why a host the run left converged is not accepted (the gate's acceptance WARN): no record
    #: for its driver and CUDA
    not_accepted: str = ""


@dataclass
class HostContext:
    """What gpufleet remembers about one host during one run."""

    #: (the host's explicit inventory data, its validated Settings): settings are worked out
    #: once per run (every deploy asks); the data is kept to notice a change (a test's override)
    settings: tuple[dict[str, Any], Settings] | None = None
    #: planning-time answers of gpufleet.config.hostfacts (GPUs, driver, OS, resolution, clocks ...):
    #: the host as it was before this run, asked once. The validation gate swaps in an empty
    #: one to see the host as it is now (validation.fresh_host_facts)
    facts: dict[str, Any] = field(default_factory=dict)
    #: gpufleet.controller.factcache's memo, (fact, arguments, executor arguments) -> answer: valid while
    #: nothing but facts has run on the host since; cleared by any other command
    fact_memo: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    #: factcache: executor-argument context (JSON) -> the executor arguments' JSON pyinfra
    #: would derive from it; saves walking pyinfra's data layers for every fact
    executors: dict[str, str] = field(default_factory=dict)
    #: factcache: the executor arguments a fact gets when nothing around it sets any (inventory
    #: data and config), and their JSON (the memo key's spelling); None until first needed.
    #: In memory only: they may hold a sudo password
    default_executor: dict[str, Any] | None = None
    default_executor_json: str | None = None
    #: factcache: last run's facts were (or are being) prefetched for this host
    prefetched: bool = False
    #: factcache: the greenlet prefetch_all() started for this host; the host's first fact
    #: waits for it (then None)
    prefetch: Any = None
    #: depth of fact calls under way on this host (factcache): their commands read, they do
    #: not change the host, so they neither clear the memo nor take the host lock
    in_fact: int = 0
    #: factcache.fresh() under way on this host: facts are read from it, not from the memo
    fresh: int = 0
    #: the same depth as counted by gpufleet.controller.hostlock (installed separately from factcache)
    lock_in_fact: int = 0
    #: the lock's generation (facts/hostlock.py) read before planning: the lock is refused if it moved
    lock_generation: str = ""
    #: operations.needrestart.quiet_needrestart was planned for this host in this run (base in all.py,
    #: or standalone.py before an area run alone): once is enough, before the first apt
    needrestart_planned: bool = False
    #: gpufleet.controller.staging: (the connector it was checked on, the login user's staging folder):
    #: made or checked once per connection, before the first transfer through sudo
    staging_folder: tuple[Any, str] | None = None
    #: gpufleet.controller.askpass: "sudo"/"su" -> the holder of this connection's private askpass folder
    askpass: dict[str, Any] = field(default_factory=dict)
    #: operations.daemon_reload: this run has taken over (or said is still pending) the
    #: daemon-reload an earlier run deferred
    reload_claimed: bool = False
    #: gpufleet.controller.reload_guard: the SSH transport the guard held on (a reboot means a
    #: new one: held again)
    reload_guard_transport: Any = None
    #: operations.source_steps: the source operations a first converge's early install
    #: (deploys/bootstrap.py) planned on this host; the areas then leave their sources to them
    sources_written_early: Any = None
    #: what this run leaves for later on this host (the end-of-run summary reads it)
    outcome: HostOutcome = field(default_factory=HostOutcome)
    #: gpufleet.controller.factcache: the (fact path, arguments JSON) this host asked, in order
    #: (a dict: an ordered set), saved at its disconnect for the next run's prefetch
    plan_seen: dict[tuple[str, str], None] = field(default_factory=dict)


@dataclass
class FleetContext:
    """What gpufleet remembers about one inventory (one pyinfra State) during one run."""

    #: validate_inventory's findings for the hosts this run touches, worked out once per run
    #: (deploys ask for every host they plan; validating N hosts N times was quadratic)
    problems: list[str] | None = None
    #: factcache.prefetch_all() already sent every host its prefetch
    prefetch_all_sent: bool = False
    #: a deploy run (prefetch_all() called): its prefetch leaves out the gate's end-of-run facts
    deploy_run: bool = False
    #: gpufleet.controller.run_end's callback handler is on this run's State
    run_end_installed: bool = False


_HOSTS: weakref.WeakKeyDictionary[Any, HostContext] = weakref.WeakKeyDictionary()
_FLEETS: weakref.WeakKeyDictionary[Any, FleetContext] = weakref.WeakKeyDictionary()


def host_context(host: Any) -> HostContext:
    """gpufleet's context for `host` (a pyinfra Host, or the `host` proxy), made on first use."""
    host = real_object(host)
    context = _HOSTS.get(host)
    if context is None:
        context = _HOSTS[host] = HostContext()
    return context


def fleet_context(inventory_or_state: Any) -> FleetContext:
    """gpufleet's context for a pyinfra Inventory (or the State running it), made on first use."""
    obj = real_object(inventory_or_state)
    inventory = real_object(getattr(obj, "inventory", obj))  # a State: its inventory
    context = _FLEETS.get(inventory)
    if context is None:
        context = _FLEETS[inventory] = FleetContext()
    return context
