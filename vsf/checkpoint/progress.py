"""Progress of a long save or load: bytes moved by this rank and the rate, on stderr.

Shown only when asked (``progress=True``) or, by default, when stderr is a terminal, and only
on rank 0 of the checkpoint's group; quiet otherwise.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Counts bytes from any thread and redraws one status line at most every ``interval`` seconds.

    Example::

        >>> meter = Progress("saving ckpt/step_100", enabled=True)
        >>> meter.add(1 << 30); meter.close()
    """

    def __init__(
        self, label: str, *, enabled: bool | None = None, stream: TextIO | None = None, interval: float = 0.5
    ) -> None:
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty() if enabled is None else enabled
        self._label = label
        self._interval = interval
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._last = self._start
        self.bytes = 0
        self._drawn = False

    def add(self, n: int) -> None:
        """Count ``n`` more bytes."""
        with self._lock:
            self.bytes += n
            now = time.perf_counter()
            if self._enabled and now - self._last >= self._interval:
                self._last = now
                self._draw(now)

    def close(self) -> None:
        """Draw the final line (if enabled and anything was counted)."""
        if self._enabled and (self.bytes or self._drawn):
            self._draw(time.perf_counter())
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self._start, 1e-9)
        self._stream.write(f"\r{self._label}: {_size(self.bytes)} at {_size(rate)}/s")
        self._stream.flush()
        self._drawn = True


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
