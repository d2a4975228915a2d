"""How gpufleet uses apt on a host: how old an index may be, and which packages
unattended-upgrades must leave to gpufleet (the hardening and the driver deploys both write
that file, from here, so the two never rewrite each other's)."""
from __future__ import annotations

# An apt index younger than this is fresh enough: no `apt-get update` on re-runs.
APT_CACHE_SECONDS = 86400

UNATTENDED_CONF = "/etc/apt/apt.conf.d/51gpufleet-unattended-upgrades"

# Packages unattended-upgrades must never touch: driver, CUDA, cuDNN, NCCL, Fabric Manager and
# the container toolkit move together, on gpufleet's schedule. Python regular expressions
# matched at the start of the package name (unattended-upgrades' Package-Blacklist).
# The only copy: the hardening and driver deploys both write the file from it.
GPU_PACKAGE_BLACKLIST = (
    "^nvidia-",                   # nvidia-driver, nvidia-kernel-*, nvidia-persistenced, ...
    "^libnvidia-",                # libnvidia-compute, libnvidia-container1, ...
    "^cuda",                      # cuda-toolkit-*, cuda-drivers, cuda-compat-*
    "^libcuda",                   # libcuda1 (Debian), libcudart*
    "^cudnn",                     # cudnn9-cuda-13 metapackages
    "^libcudnn",                  # libcudnn9-cuda-13
    "^libnccl",                   # libnccl2, libnccl-dev
    "^nvidia-fabricmanager",      # Fabric Manager must equal the driver version exactly
    "^nvidia-container-toolkit",  # container toolkit and its base package
    "^firmware-nvidia-",          # Debian's GSP firmware follows the driver
    "^xserver-xorg-video-nvidia", # Debian's X driver follows the driver
    "^linux-modules-nvidia-",     # Ubuntu's prebuilt signed modules: the driver's version, per kernel
    "^linux-objects-nvidia-",     # Ubuntu's linux-restricted-modules objects, linked at install
    "^linux-signatures-nvidia-",  # Ubuntu's signatures of those modules
)

# Where unattended-upgrades takes security updates from (Origins-Pattern, matched with the
# host's ${distro_codename}): Debian's security archive (Debian's 50unattended-upgrades has the
# same pattern) and Ubuntu's -security pocket, its release pocket and ESM, the pockets Ubuntu's
# own 50unattended-upgrades allows (github.com/mvo5/unattended-upgrades,
# data/50unattended-upgrades.Ubuntu). One file for both, written by the hardening and the
# driver deploys alike: a pattern for another distribution never matches.
UNATTENDED_ORIGINS = (
    "origin=Debian,codename=${distro_codename}-security,label=Debian-Security",
    "origin=Ubuntu,archive=${distro_codename}-security,label=Ubuntu",
    "origin=Ubuntu,archive=${distro_codename},label=Ubuntu",
    "origin=UbuntuESMApps,archive=${distro_codename}-apps-security",
    "origin=UbuntuESM,archive=${distro_codename}-infra-security",
)
