"""Files written and read safely: output written to a temporary sibling and renamed into place
(atomic_output, tmp_name, fsync_dir), disk-full errors that say what to change and leave what
was there (is_disk_full, disk_full_error, disk_space), and names read from untrusted files kept
inside their directory (path_inside, PathOutside)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath
from typing import Iterator

from bloomtrain.errors import UserError


def tmp_name(path: str | os.PathLike) -> Path:
    """A temporary sibling of `path` that is unique to this process. Siblings so that the final
    os.replace is a same-filesystem atomic rename."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp.{os.getpid()}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# mkstemp creates its file 0600; an output renamed into place gets the mode a plain open() would
# have given it (reports, metrics and checkpoints are read by other users and web servers). Read
# once at import: os.umask can only be read by setting it.
_FILE_MODE = 0o666 & ~_umask()


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, mode: str = "wb") -> Iterator:
    """Open a temporary sibling of `path` for writing and rename it into place only if the block
    finishes without an exception. A crash, a kill or a full disk leaves `path` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# What a write fails with when the disk, or the user's quota on it, is full: the user frees
# space or writes elsewhere.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def _fmt_bytes(n: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def disk_space(path: str | os.PathLike) -> str:
    """How much space the filesystem holding `path` has left, for the message of a failed write:
    `1.3 MiB free (1,363,148 bytes) of 16.0 MiB on the filesystem of PATH`. Asked of the nearest
    existing parent, since the failed output itself has usually been removed by then."""
    p = Path(path).absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError as e:
        return f"free space on the filesystem of {p} unknown ({e})"
    return (f"{_fmt_bytes(u.free)} free ({u.free:,} bytes) of {_fmt_bytes(u.total)} on the "
            f"filesystem of {p}")


def pid_alive(pid) -> bool:
    """Whether process `pid` (an int or its digits) runs on this host; True when unsure (not a
    pid, or one that runs as another user)."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in DISK_FULL_ERRNOS


def disk_full_error(what: str, err: OSError, where: str | os.PathLike, fix: str) -> UserError:
    """The UserError for `what` (e.g. `writing dataset P.bin/.idx`) running out of space: the
    error, the free space left on the filesystem of `where`, and what to change (`fix`). Made
    after the partial output is removed, so the free space it names is what a retry has."""
    return UserError(f"{what} failed: {err.strerror or err} ({disk_space(where)}); {fix}")


@contextlib.contextmanager
def disk_full_as(what: str, where: str | os.PathLike, fix: str):
    """Within: an out-of-space error becomes disk_full_error's one line (what, the free space
    at `where`, `fix`); any other error passes as it is."""
    try:
        yield
    except OSError as e:
        if not is_disk_full(e):
            raise
        raise disk_full_error(what, e, where, fix) from None


def unwritable(path: str | os.PathLike) -> str | None:
    """Why a directory at `path` could not be written (created where missing), or None: the
    nearest existing part of it is a file, or is not writable (a read-only filesystem, another
    user's directory). Checked before a job starts, not found at its first save."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only(probe) else "not writable by this user"
        return f"{probe} is {why}"
    return None


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside `path` durable."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class PathOutside(Exception):
    """A file name that must stay inside a directory does not. `reason`: "not_a_name" (not a
    non-empty string without NUL), "outside" (absolute, or with `..`), "unresolvable" (a symlink
    loop, a name the OS refuses; `detail` says what), "symlink" (a symlink leading out;
    `detail` is where it leads). Callers word the error for the file kind they read."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


def path_inside(directory: Path, name, boundary: Path | None = None) -> Path:
    """`directory / name` for a file name read from an untrusted file (a checkpoint manifest,
    an HF weight map), refused (PathOutside) unless it is a relative name that, symlinks
    resolved, stays inside `boundary` (default: `directory`), so that such a file can never
    make us read, hash or copy files elsewhere."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise PathOutside("not_a_name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise PathOutside("outside")
    full = directory / name
    try:
        inside = full.resolve().is_relative_to((boundary or directory).resolve())
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop; a name the OS refuses
        raise PathOutside("unresolvable", str(e)) from None
    if not inside:
        raise PathOutside("symlink", str(full.resolve()))
    return full
