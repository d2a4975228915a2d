"""Fleet report: one table of every host of an inventory (see gpufleet/apps/report/cli.py)."""
