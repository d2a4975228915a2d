"""gpufleet's applications: programs that drive pyinfra runs (or read the fleet) from the
controller, above the deploys (gpufleet/layers.py)."""
