"""Fleet-wide driver upgrades: plan (batches), state (resume), manifest and snapshots, runner.

    tools/rollout INVENTORY --driver-version V [--canary N] [--batch-size N | --batch-percent P] ...
    tools/rollback INVENTORY HOST [--manifest FILE] [--reboot]
"""
