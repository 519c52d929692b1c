"""One line of progress redrawn in place on a terminal (a long build's state, training's line),
and durations as h:mm:ss."""
from __future__ import annotations

import shutil
import sys
import time


def is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # no isatty(), or closed
        return False


def draw_in_place(stream, text: str) -> None:
    """Replace the terminal's current line with `text`. A line wider than the terminal wraps,
    and a carriage return then goes back to its last row only: it is cut to fit."""
    width = shutil.get_terminal_size().columns
    stream.write("\r\x1b[2K" + text[:max(width - 1, 1)])
    stream.flush()


def format_duration(seconds: float) -> str:
    """h:mm:ss, the hours unbounded."""
    m, s = divmod(round(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


class ProgressLine:
    """A long build's state on one line redrawn in place, in the style of training's progress
    line (fields joined by " | "), at most every `interval` seconds and ended by close().
    Only on a terminal: in a log file or a pipe, the summary the caller prints at the end says
    what was done, without a line per redraw."""

    def __init__(self, stream=None, interval: float = 0.25, enabled: bool = True):
        self.stream = sys.stderr if stream is None else stream
        self.enabled, self.interval = enabled and is_terminal(self.stream), interval
        self.start = self._last = time.monotonic()
        self._drawn = False

    def elapsed(self) -> str:
        return format_duration(time.monotonic() - self.start)

    def update(self, *fields: str, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and self._drawn and now - self._last < self.interval):
            return
        self._last, self._drawn = now, True
        draw_in_place(self.stream, " | ".join(fields))

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
