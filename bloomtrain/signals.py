"""Stop signals as exceptions: SIGTERM (and SIGUSR1 before training takes it) raised where a
command is, as Ctrl-C raises KeyboardInterrupt, so that the same cleanup runs."""
from __future__ import annotations

import functools
import os
import signal


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, as Ctrl-C raises KeyboardInterrupt: the same
    cleanup runs (temporary outputs removed, worker pools ended), where the default action
    killed the process and left them. Commands that handle SIGTERM themselves (training's
    save-and-stop, the launcher, the server's drain) install their own handler over this one.
    Training raises it for SIGUSR1 too, before its loop takes that signal (take_signal)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(signum)
        self.signum = signum


def _terminated(owner: int, signum, frame):
    if os.getpid() != owner:
        # A forked child (a multiprocessing pool's worker: lm-eval's bootstrap pool is ended
        # with SIGTERM when it is done) inherits the handler; it dies as by default, not with a
        # Terminated traceback on the command's stderr.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated(signum)


def take_signal(signum: int = signal.SIGTERM):
    """`signum` raises Terminated in this process from now on (not in the children it forks);
    the handler it replaces."""
    return signal.signal(signum, functools.partial(_terminated, os.getpid()))
