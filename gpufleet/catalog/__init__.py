"""What the world offers, as typed read-only views of gpufleet/data: the compatibility
tables, the GPU catalogue, kernel flavours, what an OpenSSH release accepts. Below the settings."""
