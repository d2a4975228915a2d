"""gpufleet GPU SIMULATOR: a test double that makes disposable test hosts look like NVIDIA GPU servers.

Not NVIDIA software. See README.md in this directory.
"""

from .install import GpuSpec, build_config, install, parse_spec

__all__ = ["GpuSpec", "build_config", "install", "parse_spec"]
