"""gpufleet's own files on the controller: 0600 in 0700 directories, written whole or not at all.

Fact plans, rollout state, manifest copies and /etc archives describe a fleet (and an archive
holds whatever a host keeps in /etc): nobody but the operator who ran gpufleet reads them.

Nor does anybody else write them: the fact plan names commands the hosts run, a manifest names
what a rollback extracts as root. A `.gpufleet` folder (or one below it) that another user
made or may write, and a file that is a symbolic link, another user's, or writable by others,
are refused (UnsafePath, naming it), never used (issue 27). Files are read through one
descriptor: opened without following a symbolic link, checked with fstat, read from the same
descriptor (no re-open by path between the check and the use).
"""
from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


class UnsafePath(OSError):
    """A gpufleet folder or file another user made or may change: refused, never used."""


def _who(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _ours(path: Path, st: os.stat_result, what: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafePath(f"{path}: {what} owned by {_who(st.st_uid)}, not by you ({_who(me)}): another user made it; "
                         "gpufleet uses only its own files. Move it away, check what it holds, and re-run")


def check_dir(path: Path | str, tighten: bool = True) -> None:
    """Refuse (UnsafePath) a folder that is not ours or that others may write; with `tighten`, one
    of ours others may only read or enter is made 0700 (an earlier version created them 0755:
    nobody else could write in it)."""
    path = Path(path)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        _ours(path, st, "a symbolic link")   # ours: only we can change where it points
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path}: not a folder; gpufleet keeps its files in a folder of its own. Move it away and re-run")
    _ours(path, st, "a folder")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafePath(f"{path}: a folder others may write (mode {mode:04o}): what is in it may not be gpufleet's. "
                         "Check its files, `chmod 700` it, and re-run")
    if mode & 0o077 and tighten:
        os.chmod(path, DIR_MODE)


def _ours_below(path: Path) -> list[Path]:
    """`path` and its parents from the first `.gpufleet` folder down (none outside one)."""
    parts = path.parts
    if ".gpufleet" not in parts:
        return []
    first = parts.index(".gpufleet")
    return [Path(*parts[:i + 1]) for i in range(first, len(parts))]


def ensure_dir(path: Path | str, tighten: bool | None = None) -> Path:
    """Create `path` and every missing parent 0700. A `.gpufleet` folder and every folder below
    it must be ours and not writable by others (check_dir: refused otherwise, a loose one of
    ours tightened). By default only those are tightened: a folder the operator chose (a
    rollout's --state, a report's --out) keeps its mode."""
    path = Path(path)
    if tighten is None:
        tighten = ".gpufleet" in path.parts
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in _ours_below(path):   # before anything is made in them
        if directory not in missing:
            check_dir(directory)
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=DIR_MODE)
        except FileExistsError:   # made by someone else meanwhile: checked like any other
            check_dir(directory)
            continue
        os.chmod(directory, DIR_MODE)  # mkdir's mode is filtered by the umask
    if tighten and not missing and path not in _ours_below(path):
        st = path.stat()
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, DIR_MODE)
    return path


def read(path: Path | str) -> bytes:
    """The bytes of a file gpufleet wrote (a fact plan, a rollout state, a manifest): the folders
    from `.gpufleet` down checked (check_dir), the file opened without following a symbolic
    link, then checked on that descriptor (fstat: a regular file of ours others cannot write)
    and read from it. UnsafePath otherwise; FileNotFoundError when it is not there."""
    path = Path(path)
    for directory in _ours_below(path.parent):
        check_dir(directory)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symbolic link
            raise UnsafePath(f"{path}: a symbolic link, not gpufleet's file: move it away and re-run") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path}: not a regular file: move it away and re-run")
        _ours(path, st, "a file")
        if stat.S_IMODE(st.st_mode) & 0o022:
            raise UnsafePath(f"{path}: a file others may write (mode {stat.S_IMODE(st.st_mode):04o}): "
                             "not trusted. Check it, `chmod 600` it, and re-run")
        return fh.read()


def write(path: Path | str, data: str | bytes, tighten: bool | None = None, durable: bool = False) -> Path:
    """Write `data` to `path` 0600, atomically (a temporary file in the same directory, renamed),
    its directory created 0700 (see ensure_dir). `durable` (a rollout's state): the file is
    fsynced before the rename and the directory after it, so a crash or power loss leaves the
    old file or the new one, never an empty one."""
    path = Path(path)
    ensure_dir(path.parent, tighten=tighten)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def is_private(path: Path | str) -> bool:
    """True when `path` is ours and nobody else may write it (a file others can write must not be
    trusted: the fact plan names commands the hosts run)."""
    st = os.stat(path)
    return st.st_uid == os.geteuid() and not stat.S_IMODE(st.st_mode) & 0o022
