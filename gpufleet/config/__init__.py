"""A host's settings, checked and resolved (tier defaults under the inventory, the schema, the
driver/CUDA/cuDNN resolution), the run's per-host context that holds them, and the one way a
plan refuses a host (failures). Below the plans: plans take Settings."""
