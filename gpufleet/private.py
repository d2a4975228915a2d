"""gpufleet's own files on the controller: 0600 in 0700 directories, written whole or not at all.

Fact plans, rollout state, manifest copies and /etc archives describe a fleet (and an archive
holds whatever a host keeps in /etc): nobody but the operator who ran gpufleet reads them.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def ensure_dir(path: Path | str, tighten: bool | None = None) -> Path:
    """Create `path` and every missing parent 0700; with `tighten`, an existing `path` of ours
    that others may enter is made 0700 too (an earlier version created them 0755). By default
    only folders under a `.gpufleet` folder are tightened: a folder the operator chose (a
    rollout's --state, a report's --out) keeps its mode."""
    path = Path(path)
    if tighten is None:
        tighten = ".gpufleet" in path.parts
    missing = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    if tighten and not missing:
        st = path.stat()
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, DIR_MODE)
    return path


def write(path: Path | str, data: str | bytes, tighten: bool | None = None) -> Path:
    """Write `data` to `path` 0600, atomically (a temporary file in the same directory, renamed),
    its directory created 0700 (see ensure_dir)."""
    path = Path(path)
    ensure_dir(path.parent, tighten=tighten)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def is_private(path: Path | str) -> bool:
    """True when `path` is ours and nobody else may write it (a file others can write must not be
    trusted: the fact plan names commands the hosts run)."""
    st = os.stat(path)
    return st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022
