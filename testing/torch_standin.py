"""TEST DOUBLE: a stand-in `torch` package reporting the recorded build values of real CUDA wheels.

Test infrastructure, not production code, and not PyTorch. A CUDA build of PyTorch cannot be
shown working here (no GPU; the wheels are gigabytes), and what the validation gate reads of it
is three values: `torch.__version__`, `torch.version.cuda` and `torch.cuda.get_arch_list()`.
This package answers exactly those with values recorded from real wheels, and nothing else
(`torch.cuda.is_available()` is False, `device_count()` 0: the performance probe then skips, as
on a host whose GPUs torch cannot use).

Two ways onto a host. `wheel()` builds it as a pure-Python wheel named torch (version
`2.11.0+cu130` and the like), which the stand-in apt repository's server also offers as a PyTorch
index on loopback (testing/aptrepo.py: `AptRepo.pytorch_index_url`, one index per CUDA variant as
download.pytorch.org/whl/<variant>): gpufleet's own install (pytorch_runtime: venv) then runs
pip against it, as a site's mirror. Its values: RECORDED where a real wheel printed them, else the
compatibility data's arch list of that variant (DERIVED, compat.yaml) written as get_arch_list()
spells it.

Or `install()` puts it in a test-only directory on the host (/opt/gpufleet-testing/torch-standin), put on
python3's path by a `.pth` file in /usr/local/lib/python3.X/dist-packages; `remove(host)`
takes both away. Recorded builds (RECORDED):

- 2.11.0+cu126 and 2.11.0+cu128: `torch.cuda.get_arch_list()` of the real wheels, as printed in
  pytorch/pytorch#182250 (comment of 2026-05-03, `uv run --with torch
  --index=https://download.pytorch.org/whl/cu126` / `.../cu128`). `torch.version.cuda` is not
  printed there; it is the CUDA release the local version tag names (+cu126 -> "12.6"), which is
  how PyTorch's builds set it.
"""
from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

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


def values(version: str) -> dict:
    """RECORDED values, else DERIVED ones: compat.yaml's arch list of the version's variant
    ("9.0" -> sm_90, "12.0+PTX" -> sm_120 and compute_120), torch.version.cuda from its tag."""
    if version in RECORDED:
        return RECORDED[version]
    from gpufleet.catalog.pytorch import pytorch_data

    release, _, variant = version.partition("+")
    for v in pytorch_data().releases[".".join(release.split(".")[:2])]:
        if v.name == variant:
            archs: list[str] = []
            for arch in v.archs:
                base, _, ptx = arch.partition("+")
                archs.append("sm_" + base.replace(".", ""))
                if ptx:
                    archs.append("compute_" + base.replace(".", ""))
            return {"cuda": v.cuda, "arch_list": archs}
    raise KeyError(f"no variant {variant} of PyTorch {release} in compat.yaml")


def _files(version: str) -> dict[str, str]:
    record = {"version": version, **values(version)}
    return {"torch/__init__.py": _INIT.format(**record), "torch/version.py": _VERSION.format(**record),
            "torch/cuda/__init__.py": _CUDA.format(**record)}


def wheel(version: str, dest: Path) -> Path:
    """The stand-in as a wheel file (py3-none-any) in `dest`: what pip installs from an index.
    Fixed timestamps: the same version gives the same bytes."""
    dist = f"torch-{version}.dist-info"
    files = dict(_files(version))
    files[f"{dist}/METADATA"] = (f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
                                 "Summary: TEST DOUBLE (gpufleet testing/torch_standin.py): NOT PyTorch\n")
    files[f"{dist}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: gpufleet-testing\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n")
    rows = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(text.encode())}")
    files[f"{dist}/RECORD"] = "\n".join(rows + [f"{dist}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            archive.writestr(info, text)
    return path


def serve_index(root: Path, release: str = "2.11") -> None:
    """Under `root` (a web server's document root): pytorch/whl/<variant>/torch/index.html and
    the stand-in wheel of `release` for each of its variants (PEP 503 simple index), as
    download.pytorch.org/whl/<variant>/torch/ lists the real ones."""
    from gpufleet.catalog.pytorch import pytorch_data

    for variant in pytorch_data().releases[release]:
        folder = root / "pytorch" / "whl" / variant.name / "torch"
        made = wheel(f"{release}.0+{variant.name}", folder)
        link = made.name.replace("+", "%2B")
        (folder / "index.html").write_text(
            f'<!DOCTYPE html>\n<html><body>\n<a href="{link}">{made.name}</a>\n</body></html>\n')


def _python(host: testhosts.Host) -> str:
    return testhosts.ssh(host, "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()


def install(host: testhosts.Host, version: str) -> None:
    """Make the host's python3 import the stand-in for the recorded build `version`."""
    package = host.root / DIR / "torch"
    shutil.rmtree(package, ignore_errors=True)
    (package / "cuda").mkdir(parents=True)
    for name, text in _files(version).items():
        (package.parent / name).write_text(text)
    site = host.root / f"usr/local/lib/python{_python(host)}/dist-packages"
    site.mkdir(parents=True, exist_ok=True)
    (site / PTH).write_text("/" + DIR + "\n")


def remove(host: testhosts.Host) -> None:
    shutil.rmtree(host.root / DIR, ignore_errors=True)
    subprocess.run(["sh", "-c", 'rm -f "$1"/usr/local/lib/python3*/dist-packages/"$2"', "-", str(host.root), PTH],
                   check=True)
