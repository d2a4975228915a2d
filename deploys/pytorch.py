"""PyTorch for the host's users, matched to its GPUs and driver (pytorch_runtime: venv).

Story of a host, part 6 (after tuning): the wheel the resolver chose (gpufleet/catalog/pytorch.py: the release of
`pytorch_version`, its CUDA variant that runs on every GPU with the resolved driver; the one
tools/compat and the plan view name) is installed into one shared environment, root-owned and
readable by every user (`pytorch_venv_path`, /opt/gpufleet/pytorch: jobs run
`<path>/bin/python`). The validation gate's PyTorch check and performance probe run with it.
Wheels come from PyTorch's index for the variant, a mirror (`pytorch_index_url`) or, on an
air-gapped site, a folder of wheels on the host (`pytorch_wheel_dir`). A second run installs
nothing: the record in the environment names the wheel installed.

`pytorch_runtime: python` (a venv or conda env the site keeps, `pytorch_python`) and `none`
install nothing here. gpufleet/plans/pytorch_runtime.py holds the plan.
"""
from pyinfra import host
from pyinfra.api import deploy
from pyinfra.operations import apt

from gpufleet.explain import explained
from gpufleet.apt_policy import APT_CACHE_SECONDS
from gpufleet.errors import Incompatible
from gpufleet.config.failures import refuse
from gpufleet.config.hostfacts import resolution
from gpufleet.operations.pytorch import venv_torch
from gpufleet.plans.pytorch_runtime import VENV, VENV_PACKAGE, venv_plan
from gpufleet.config.settings import host_settings


@deploy("PyTorch")
def pytorch() -> None:
    settings = host_settings(host)
    if settings.pytorch_runtime != VENV:
        return
    try:
        choice = resolution(host, settings).pytorch
    except Incompatible as error:  # in all.py the driver area already refused the host
        refuse(host, error.key or "pytorch_version", f"no PyTorch wheel for this host: {error.reason}",
               f"change {error.key or 'the tier'}" + (f" (allowed: {error.allowed})" if error.allowed else ""))
        return
    if choice is None:  # refused at planning (settings): venv needs a pytorch_version
        return
    apt.packages(
        name=explained("Install python3-venv", "Install python3-venv (the shared PyTorch environment's pip)"),
        packages=[VENV_PACKAGE],
        update=True,
        cache_time=APT_CACHE_SECONDS,
        no_recommends=True,
    )
    plan = venv_plan(settings, choice)
    venv_torch(name=explained(f"Install torch {choice.version} {choice.variant}",
                              f"Install PyTorch {choice.version} {choice.variant} for the host's users into {plan.path}"),
               plan=plan)


# `pyinfra INVENTORY deploys/pytorch.py`: this area on its own (deploys/standalone.py).
from gpufleet.deploys.standalone import run_alone  # noqa: E402

run_alone(__name__, __file__)
