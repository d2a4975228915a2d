"""A GPU smoke-test image built on a test host itself (no registry is reachable from the tests).

Test infrastructure, not production code. `build(host)` makes a minimal root filesystem from the
host's own files (dash as /bin/sh, python3 with the standard-library modules the GPU simulator's
nvidia-smi imports, and the shared libraries both need) and `docker import`s it as IMAGE. Like a
real CUDA base image it brings no nvidia-smi: the (stand-in) container toolkit mounts the GPU
simulator's into a container that asks for GPUs (testing/aptrepo.py, nvidia-container-runtime-hook).
"""
from __future__ import annotations

from testing import testhosts

IMAGE = "gpufleet-smoke:local"

_BUILD = r"""set -e
command -v docker >/dev/null
r=$(mktemp -d); trap 'rm -rf "$r"' EXIT
py=$(readlink -f /usr/bin/python3)
mods=$(python3 -IS -c 'import fcntl, json, os, re, string, sys, time
print(" ".join(sorted({m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)})))')
libs=$( (ldd /bin/dash; ldd "$py") | grep -o '/[^ ]*' | sort -u)
for f in /bin/dash "$py" $mods $libs; do
  mkdir -p "$r$(dirname "$f")"; cp -L "$f" "$r$f"
done
ln -s dash "$r/bin/sh"; ln -s "$(basename "$py")" "$r/usr/bin/python3"
mkdir -p "$r/etc" "$r/tmp" "$r/proc" "$r/sys" "$r/dev"
echo "gpufleet GPU smoke-test image (test harness): no nvidia-smi of its own" > "$r/etc/gpufleet-smoke"
tar -C "$r" -c . | docker import -m "gpufleet smoke-test image" - "$1" >/dev/null
docker image inspect --format '{{.Id}} {{.Size}}' "$1"
"""


def build(host: testhosts.Host, image: str = IMAGE) -> str:
    """Build IMAGE on `host` (its Docker engine must run); returns `<id> <size>`."""
    script = _BUILD.replace("'", "'\\''")
    return testhosts.ssh(host, f"sh -c '{script}' gpufleet-smoke {image}", timeout=300).stdout.strip()
