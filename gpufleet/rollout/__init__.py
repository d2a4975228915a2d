"""Fleet-wide driver upgrades: plan (batches), state (resume), manifest and snapshots, runner.

    tools/rollout INVENTORY --driver-version V [--canary N] [--batch-size N | --batch-percent P] ...
    tools/rollback INVENTORY HOST [--manifest FILE] [--reboot]

Two layers live here (gpufleet/layers.py): cli, runner, rollback and session are applications
that drive pyinfra runs of deploys/upgrade.py and deploys/rollback.py; plan, state, manifest,
snapshot, context and targets are core (no pyinfra run, no deploy), used by those deploys too.
"""
