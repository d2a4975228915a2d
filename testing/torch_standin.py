"""TEST DOUBLE: a stand-in `torch` package reporting the recorded build values of real CUDA wheels.

Test infrastructure, not production code, and not PyTorch. A CUDA build of PyTorch cannot be
shown working here (no GPU; the wheels are gigabytes), and what the validation gate reads of it
is three values: `torch.__version__`, `torch.version.cuda` and `torch.cuda.get_arch_list()`.
This package answers exactly those with values recorded from real wheels, and nothing else
(`torch.cuda.is_available()` is False, `device_count()` 0: the performance probe then skips, as
on a host whose GPUs torch cannot use).

It lives in a test-only directory on the host (/opt/gpufleet-testing/torch-standin), put on
python3's path by a `.pth` file in /usr/local/lib/python3.X/dist-packages; `remove(host)`
takes both away. Recorded builds (RECORDED):

- 2.11.0+cu126 and 2.11.0+cu128: `torch.cuda.get_arch_list()` of the real wheels, as printed in
  pytorch/pytorch#182250 (comment of 2026-05-03, `uv run --with torch
  --index=https://download.pytorch.org/whl/cu126` / `.../cu128`). `torch.version.cuda` is not
  printed there; it is the CUDA release the local version tag names (+cu126 -> "12.6"), which is
  how PyTorch's builds set it.
"""
from __future__ import annotations

import shutil
import subprocess

from testing import testhosts

DIR = "opt/gpufleet-testing/torch-standin"
PTH = "gpufleet-testing-torch-standin.pth"

RECORDED: dict[str, dict] = {
    "2.11.0+cu126": {"cuda": "12.6", "arch_list": ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]},
    "2.11.0+cu128": {"cuda": "12.8", "arch_list": ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]},
}

_INIT = '''"""TEST DOUBLE written by gpufleet's testing/torch_standin.py: NOT PyTorch.
Reports the recorded build values of the real wheel {version} only."""
__version__ = {version!r}
from . import version, cuda  # noqa: E402,F401
_C = None
'''
_VERSION = '''"""TEST DOUBLE (testing/torch_standin.py): recorded torch.version of {version}."""
__version__ = {version!r}
cuda = {cuda!r}
hip = None
'''
_CUDA = '''"""TEST DOUBLE (testing/torch_standin.py): the recorded arch list of {version}; no GPU is usable."""


def get_arch_list():
    return list({arch_list!r})


def is_available():
    return False


def device_count():
    return 0
'''


def _python(host: testhosts.Host) -> str:
    return testhosts.ssh(host, "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()


def install(host: testhosts.Host, version: str) -> None:
    """Make the host's python3 import the stand-in for the recorded build `version`."""
    record = RECORDED[version]
    package = host.root / DIR / "torch"
    shutil.rmtree(package, ignore_errors=True)
    (package / "cuda").mkdir(parents=True)
    values = {"version": version, **record}
    (package / "__init__.py").write_text(_INIT.format(**values))
    (package / "version.py").write_text(_VERSION.format(**values))
    (package / "cuda" / "__init__.py").write_text(_CUDA.format(**values))
    site = host.root / f"usr/local/lib/python{_python(host)}/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / PTH).write_text("/" + DIR + "\n")


def remove(host: testhosts.Host) -> None:
    shutil.rmtree(host.root / DIR, ignore_errors=True)
    subprocess.run(["sh", "-c", 'rm -f "$1"/usr/local/lib/python3*/dist-packages/"$2"', "-", str(host.root), PTH],
                   check=True)
