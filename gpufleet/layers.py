"""gpufleet's layers, top to bottom. Imports point down: a module imports its own layer or a
layer below it, never one above, never a peer. tests/unit/test_import_direction.py checks every
module against this list (import statements, importlib.import_module / __import__ with a
literal name, and module names written as strings for a later import).

    applications  gpufleet/apps: drive pyinfra runs of the deploys from the controller, or read
                  the fleet: the rolling upgrade and rollback (apps/rollout), the fleet
                  report (gpufleet/apps/report), tools/compat (gpufleet/apps/compat), tools/health
                  (gpufleet/apps/health) and the installed commands (gpufleet/apps/commands)
    inventories   the operator's hosts and their data (inventories/); peers of the applications,
                  which load an inventory by its path, never by import
    deploys       the story of a host, area by area (deploys/); a deploy imports no other
                  deploy, except the few that compose areas (COMPOSERS)
    operations    one change each: facts in, commands out (operations/)
    checks        the validation gate: the host compared with its plans (gpufleet/checks)
    rollout       the rollout's pure parts: plan, state, manifest, snapshot, context, targets
                  (gpufleet/rollout); a peer of the checks
    controller    the machinery around pyinfra: fact cache and batching, host lock, the sudo
                  password's channel, staging, the daemon-reload guard (gpufleet/controller)
    plans         one pure, typed plan per area, facts and settings in (gpufleet/plans)
    config        a host's settings, checked and resolved, the run's per-host context, and the
                  one way a plan refuses a host (gpufleet/config)
    catalog       typed read-only views of gpufleet/data: compatibility, GPUs, kernels, sshd
                  releases (gpufleet/catalog)
    base          small leaves every floor may use (gpufleet/*.py: errors, versions, printable,
                  rendering, yamlload, pyinfra_private, the host-side probe script)
    facts         what a host is, read from it (facts/)

The harness (testing/, tests/, tools/, bench/) sits outside: it may import any layer, no layer
imports it (the sandbox inventory, which lists the test hosts, is the one exception below).
"""
from __future__ import annotations

#: (layer, rank, module prefixes): a lower rank is higher up; equal ranks are peers.
LAYERS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("applications", 0, ("gpufleet.apps",)),
    ("inventories", 0, ("inventories",)),
    ("deploys", 1, ("gpufleet.deploys", "deploys")),  # "deploys": the file path, for the checker
    ("operations", 2, ("gpufleet.operations", "operations")),  # "operations": the file path, for the checker
    ("checks", 3, ("gpufleet.checks",)),
    ("rollout", 3, ("gpufleet.rollout",)),
    ("controller", 4, ("gpufleet.controller",)),
    ("plans", 5, ("gpufleet.plans",)),
    ("config", 6, ("gpufleet.config",)),
    ("catalog", 7, ("gpufleet.catalog",)),
    ("base", 8, ("gpufleet",)),
    ("facts", 9, ("gpufleet.facts", "facts")),  # "facts": the file path, for the checker
)

#: Test harness and entry points: outside the layers.
OUTSIDE = ("testing", "tests", "tools", "bench")

#: (importing module, imported prefix): arrows allowed against the rule, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("inventories.sandbox", "testing"): "the sandbox inventory is the test hosts' own list (tools/testhosts)",
}


#: Deploys that import other deploys, each with its reason. Every other deploy imports none:
#: what two areas share lives a floor down, in operations/ or the core.
COMPOSERS: dict[str, str] = {
    "deploys.all": "the whole story of a host, every area in order",
    "deploys.standalone": "runs one area on its own (`pyinfra INVENTORY deploys/<area>.py`), preflight first",
}
#: What every area's file imports on its last line, so that it can run on its own.
AREA_ENTRY = "deploys.standalone"


def _deploy(module: str) -> str:
    return module.removeprefix("gpufleet.")


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> tuple[str, int] | None:
    """(layer, rank) of a gpufleet module name; ("outside", -1) for the harness; None for others
    (the standard library, pyinfra, ...). The longest matching prefix wins."""
    best: tuple[int, str, int] | None = None
    for name, rank, prefixes in LAYERS:
        for prefix in prefixes:
            if _matches(module, prefix) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), name, rank)
    if best is not None:
        return best[1], best[2]
    if any(_matches(module, prefix) for prefix in OUTSIDE):
        return "outside", -1
    return None


def arrow_problem(importer: str, imported: str) -> str | None:
    """Why `importer` may not import `imported` (None when the arrow points down or sideways
    inside one layer)."""
    source, target = layer_of(importer), layer_of(imported)
    if source is not None and target is not None and source[0] == target[0] == "deploys":
        mine, theirs = _deploy(importer), _deploy(imported)
        if mine != theirs and mine not in COMPOSERS and theirs not in (AREA_ENTRY, "deploys"):
            return "a deploy imports another deploy (what areas share belongs in operations/ or the core)"
        return None
    if source is None or target is None or source[0] == target[0] or source[0] == "outside":
        return None
    if any(_matches(importer, a) and _matches(imported, b) for a, b in EXCEPTIONS):
        return None
    if target[0] == "outside":
        return f"{source[0]} imports the test harness / tools ({target[0]})"
    if target[1] < source[1]:
        return f"{source[0]} imports {target[0]}, a layer above it"
    if target[1] == source[1]:
        return f"{source[0]} imports {target[0]}, a peer layer"
    return None
