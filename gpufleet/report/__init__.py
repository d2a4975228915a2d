"""Fleet report: one table of every host of an inventory (see gpufleet/report/cli.py)."""
