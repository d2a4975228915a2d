"""gpufleet's own pyinfra operations (generators: read facts, yield only what is needed)."""
