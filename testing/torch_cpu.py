"""Real PyTorch (the CPU build) for a test host, so the validation gate's performance probe runs.

Test infrastructure, not production code. The test hosts reach only Debian's archive, whose
python3-torch drags in 300 packages; the controller's pip reaches the CPU wheel (PyPI, or the
machine's wheel mirror). `site()` installs it once, with its dependencies, into a cached
directory; `install(host)` copies that into the host's /usr/local/lib/python3.X/dist-packages,
as an operator's `pip install torch` would leave it. Debian 12 only (the wheel is cp311, as
bookworm's python3).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from testing import testhosts

VERSION = "2.13.0"
CACHE = testhosts.CACHE_ROOT / f"torch-cpu-{VERSION}-cp311"


def site() -> tuple[Path | None, str]:
    """(directory with torch and its dependencies, "") or (None, why not)."""
    if (CACHE / "torch" / "__init__.py").exists():
        return CACHE, ""
    if sys.version_info[:2] != (3, 11):
        return None, f"the controller's Python is {sys.version_info[0]}.{sys.version_info[1]}, the hosts' 3.11"
    work = CACHE.with_name(CACHE.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-compile", "--target", str(work),
                        f"torch=={VERSION}"], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        return None, f"pip install torch=={VERSION} failed: {(r.stderr or r.stdout).strip()[-300:]}"
    work.rename(CACHE)
    return CACHE, ""


def install(host: testhosts.Host, source: Path) -> None:
    py = testhosts.ssh(host, "python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").stdout.strip()
    dest = host.root / f"usr/local/lib/python{py}/dist-packages"
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", f"{source}/.", str(dest)], check=True)
