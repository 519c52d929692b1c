"""One run per directory. Two jobs writing one run directory or one `checkpoint.dir` (a second
launch by mistake, a SLURM requeue while the old job still runs) append to each other's
metrics.jsonl, prune each other's checkpoints and move `latest` back and forth; the resume
after that reads whichever won. So rank 0 takes an exclusive lock on a `.bloomtrain.lock` file
in each, for the whole run, and a job that finds one held stops before it writes anything,
naming the holder.

The lock is flock(2): the kernel drops it when its process ends however it ends (kill -9, a
node's reboot on a local disk), so a crashed run leaves no stale lock to clear by hand; the
file stays, empty of meaning. On NFS, Linux takes it as a POSIX lock through the server's lock
manager, which holds across nodes; on a filesystem without locks (Lustre mounted without
`flock`) the run warns that it cannot be refused and goes on. Within one process the lock is
re-entrant (a Trainer built again in a notebook, a test's resume), counted per directory."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
import weakref
from pathlib import Path

from bloomtrain.errors import UserError
from bloomtrain.files import pid_alive

LOCK_NAME = ".bloomtrain.lock"
# This process's locks: real path of the directory -> [open fd, holders].
_HELD: dict[str, list] = {}


class RunLocks:
    """The directories this rank holds (none on ranks other than 0)."""

    def __init__(self, dirs: list[str]):
        self.dirs = dirs

    def release(self) -> None:
        for d in self.dirs:
            held = _HELD.get(d)
            if held is None:
                continue
            held[1] -= 1
            if held[1] == 0:
                os.close(held[0])  # closing the last descriptor drops the flock
                del _HELD[d]
        self.dirs = []


def lock_run(run_dir: str, checkpoint_dir: str | None, topo, warn, owner=None) -> RunLocks:
    """Rank 0 locks the run directory and `checkpoint.dir`; every rank raises the same UserError
    when another job holds either. Released by `release()` (train()'s end) or when `owner` (the
    Trainer) goes, whichever comes first."""
    dirs = list(dict.fromkeys(os.path.realpath(d) for d in (run_dir, checkpoint_dir) if d))
    taken, error = [], None
    if topo.rank == 0:
        for d in dirs:
            error = _take(d, warn)
            if error:
                break
            taken.append(d)
    from bloomtrain.parallel import comm  # torch; `bloomtrain status` reads ended_holder only

    locks = RunLocks([d for d in taken if d in _HELD])
    error = comm.broadcast_object(error, 0, comm.world_group(), "run lock")
    if error:
        locks.release()
        raise UserError(error)
    if owner is not None:
        weakref.finalize(owner, locks.release)
    return locks


def lock_free(d) -> bool:
    """Whether nothing holds `d`'s lock now (a shared flock taken and dropped at once): its
    holder ended, on whichever host, where the filesystem's locks span hosts. False when it is
    held, or when this cannot tell (no lock file, a filesystem without flock)."""
    try:
        fd = os.open(Path(d) / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # drops the shared lock with it


def ended_holder(d) -> int | None:
    """The pid of the process that last held `d`'s lock, when it ran on this host and runs no
    more (a run killed or crashed, whose lock the kernel dropped); None when it still runs,
    ran elsewhere, or nothing says."""
    try:
        text = (Path(d) / LOCK_NAME).read_text(errors="replace")
    except OSError:
        return None
    parts = text.split()
    if len(parts) < 4 or parts[0] != "pid" or not parts[1].isdigit() or parts[2] != "on" or \
            parts[3].rstrip(",") != socket.gethostname():
        return None
    pid = int(parts[1])
    return None if pid_alive(pid) else pid


def _take(d: str, warn) -> str | None:
    """Lock directory `d` for this process (re-entrant); the refusal's text when another
    process holds it."""
    if d in _HELD:
        _HELD[d][1] += 1
        return None
    Path(d).mkdir(parents=True, exist_ok=True)
    path = os.path.join(d, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return (f"{d} is in use by another run ({holder or 'holder unknown'}): two jobs in "
                    f"one directory overwrite each other's metrics and checkpoints. Wait for "
                    f"it to end, or set run_dir / checkpoint.dir to another directory")
        warn(f"warning: cannot lock {path} ({e.strerror}: a filesystem without locks); a "
             f"second job in this directory would not be refused")
        return None
    # Who holds it, for the next job's refusal (written after the lock: only the holder writes).
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode(), 0)
    _HELD[d] = [fd, 1]
    return None
