"""tools/rollout and tools/rollback: the rolling driver upgrade and its rollback, driving one
pyinfra run per step (the rollout's pure parts, its plan, state, manifest and targets, are
core: gpufleet/rollout/)."""
