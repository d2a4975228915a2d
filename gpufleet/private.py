"""gpufleet's own files on the controller (.gpufleet/: rollout state, manifests, fact plans) are
private: 0600 files in 0700 folders, whatever the umask."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def private_dir(path: Path | str) -> Path:
    """Make `path` (and its missing parents); it and every folder of it under .gpufleet/ 0700."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for part in (path, *path.parents):
        if ".gpufleet" not in part.parts:
            break
        try:
            if stat.S_IMODE(part.stat().st_mode) != 0o700:
                part.chmod(0o700)
        except OSError:
            pass
    return path


def write_private(path: Path | str, text: str) -> None:
    """Write `text` to `path`, 0600 (a cache: no fsync; see write_atomic for state)."""
    path = Path(path)
    private_dir(path.parent)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def write_atomic(path: Path | str, text: str) -> None:
    """Replace `path` with `text` so that a reader (or a crash, or kill -9) at any moment sees
    the old file or the new one, whole: a unique temporary file in the same folder, written and
    fsynced, renamed over the old one, then the folder fsynced so the rename itself is on disk."""
    path = Path(path)
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:   # mkstemp: 0600
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
