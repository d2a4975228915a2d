"""Bring a GPU host to the state its tier describes: the whole story, in order.

    pyinfra inventories/cloud.py deploys/all.py

0. validate   every host's inventory data, before anything is changed anywhere
1. base       diagnostics packages, the gpufleet record
2. driver     matching NVIDIA driver, CUDA toolkit, cuDNN, held
3. docker     Docker engine and the NVIDIA container toolkit
4. tuning     persistence, clocks, NCCL / OMP / PyTorch profiles
5. hardening  SSH keys only, firewall (last: it must not cut off the steps above)
"""
from pyinfra import state

from deploys.base import base
from deploys.docker import docker
from deploys.driver import driver
from deploys.hardening import hardening
from deploys.tuning import tuning
from gpufleet.settings import validate_inventory

# pyinfra plans every host before it executes anything: a bad host stops the whole run here.
validate_inventory(state.inventory)

base()
driver()
docker()
tuning()
hardening()
