"""Where a host's PyTorch lives, for the validation gate's PyTorch check and performance probe,
and what gpufleet installs when it is gpufleet's own (`pytorch_runtime: venv`).

Real sites keep PyTorch out of the system python: in a venv, a conda env or a container. So the
gate never guesses: the tier says which interpreter imports the PyTorch the host's users run.

- ``venv``: gpufleet installs the wheel the resolver chose for the host's GPUs and driver
  (gpufleet/catalog/pytorch.py: the one tools/compat and the plan view name) into one shared
  environment, root-owned and readable by every user (``pytorch_venv_path``, default
  /opt/gpufleet/pytorch; jobs run ``<path>/bin/python``). From PyTorch's index for the CUDA
  variant, a mirror (``pytorch_index_url``, ``{variant}`` standing for cu130...) or, air-gapped,
  a directory of wheels on the host (``pytorch_wheel_dir``: pip --no-index --find-links).
  A record beside it (MARKER) names the wheel installed: the same wish installs nothing again.
- ``python``: an interpreter the site keeps (``pytorch_python``: a venv's or conda env's python).
- ``none``: no PyTorch on this host; the gate says so.

Pure: settings and the resolver's choice in, a Runtime or a VenvPlan out.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpufleet.catalog.pytorch import PytorchChoice

if TYPE_CHECKING:
    from gpufleet.config.settings import Settings

VENV = "venv"
PYTHON = "python"
NONE = "none"
AUTO = "auto"
RUNTIME_KEY = "pytorch_runtime"
MARKER = "gpufleet-torch"  # in the venv's top folder: which wheel gpufleet installed there
#: Debian's and Ubuntu's python3 makes venvs with pip only with this package (ensurepip's wheels)
VENV_PACKAGE = "python3-venv"


@dataclass(frozen=True)
class Runtime:
    """The interpreter the gate runs PyTorch's probes with."""

    kind: str  # venv | python | none
    python: str  # absolute path ("" for none)
    where: str  # the venv's folder, or the interpreter

    def describe(self) -> str:
        if self.kind == VENV:
            return f"runtime venv {self.where} (gpufleet's, {RUNTIME_KEY})"
        if self.kind == PYTHON:
            return f"runtime python {self.python} (pytorch_python)"
        return f"no runtime ({RUNTIME_KEY}: none)"

    def missing_fix(self, choice: PytorchChoice | None) -> str:
        """What the operator sets when this runtime imports no torch."""
        wheel = f"torch {choice.version} {choice.variant}" if choice else "the resolved wheel"
        if self.kind == VENV:
            return (f"run deploys/all.py (or deploys/pytorch.py): it installs {wheel} into {self.where}; "
                    "air-gapped, set pytorch_index_url to a mirror or pytorch_wheel_dir to a folder of wheels")
        return (f"set {RUNTIME_KEY}: venv (gpufleet installs {wheel} for the host's users), or pytorch_python "
                "to the python of the site's venv or conda env that has PyTorch")


def runtime_of(settings: Settings) -> Runtime:
    kind = getattr(settings, "pytorch_runtime", PYTHON)
    if kind == VENV:
        path = settings.pytorch_venv_path
        return Runtime(VENV, f"{path}/bin/python", path)
    if kind == PYTHON:
        return Runtime(PYTHON, settings.pytorch_python, settings.pytorch_python)
    return Runtime(NONE, "", "")


@dataclass(frozen=True)
class VenvPlan:
    """What deploys/pytorch.py installs: `pip install <spec>` from `source` into `path`."""

    path: str
    spec: str  # torch==2.11.*
    variant: str  # cu130: the local version tag pip's choice must carry
    source: tuple[str, ...]  # pip's arguments saying where wheels come from
    record: str  # MARKER's text: the wheel asked for (not where from: a new mirror installs nothing)

    @property
    def marker(self) -> str:
        return f"{self.path}/{MARKER}"

    @property
    def record_sha256(self) -> str:
        return hashlib.sha256(self.record.encode()).hexdigest()

    def describe(self) -> str:
        where = (f"wheels in {self.source[-1]} (no index)" if self.source[0] == "--no-index"
                 else self.source[-1])
        return f"{self.spec} ({self.variant}) into {self.path} from {where}"


def index_url(settings: Settings, choice: PytorchChoice) -> str:
    """PyTorch's index for the chosen variant, or the site's mirror with {variant} filled in."""
    url = settings.pytorch_index_url
    return choice.index_url if url == AUTO else url.replace("{variant}", choice.variant)


def venv_plan(settings: Settings, choice: PytorchChoice) -> VenvPlan:
    if settings.pytorch_wheel_dir != NONE:
        source: tuple[str, ...] = ("--no-index", "--find-links", settings.pytorch_wheel_dir)
    else:
        source = ("--index-url", index_url(settings, choice))
    spec = f"torch=={choice.version}.*"
    return VenvPlan(path=settings.pytorch_venv_path, spec=spec, variant=choice.variant, source=source,
                    record=f"{spec} {choice.variant}\n")


# Runs as root on the host: sh -c SCRIPT - VENV SPEC VARIANT RECORD SOURCE... (values as
# arguments, never pasted). umask 022: the environment is root's, every user reads and runs it.
# A torch of another CUDA variant is taken out first (pip keeps any 2.11.* as "satisfied").
# The record is written last, only once pip left the asked-for build: a failed run installs
# again next time. --no-cache-dir: a CUDA wheel is gigabytes, root's cache would keep a copy.
INSTALL_SCRIPT = r"""
set -eu
umask 022
venv=$1 spec=$2 variant=$3 record=$4
shift 4
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
installed() {
  found=$(cd "$venv" && ls -d lib/python3*/site-packages/torch-*.dist-info 2>/dev/null | head -n 1)
  found=${found##*/torch-}
  echo "${found%.dist-info}"
}
have=$(installed)
case "$have" in
  ''|*+"$variant") ;;
  *) "$venv/bin/python" -m pip uninstall --yes torch ;;
esac
"$venv/bin/python" -m pip install --no-cache-dir "$@" "$spec"
have=$(installed)
case "$have" in
  *+"$variant") ;;
  *) echo "gpufleet: pip installed torch '$have', not a $variant build ($spec): the wheels offered hold no $variant build" >&2
     exit 1 ;;
esac
printf '%s' "$record" > "$venv/.gpufleet-torch.new"
mv -f "$venv/.gpufleet-torch.new" "$venv/gpufleet-torch"
echo "gpufleet: torch $have in $venv"
"""
