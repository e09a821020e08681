"""Progress on stderr for long operator commands: done/total, events/s and ETA.

On a terminal one line is redrawn in place; otherwise (a log file, a CI job) a plain
line is written every few seconds, so the output stays readable when captured.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """A progress line for `total` units of work (events, rows)."""

    def __init__(self, label: str, total: int, *, unit: str = "events",
                 stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.total = max(0, total)
        self.unit = unit
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.done = 0
        self.started = time.monotonic()
        self._tty = self.stream.isatty()
        self._last = 0.0
        self._every = 0.2 if self._tty else 5.0

    @property
    def rate(self) -> float:
        """Units per second so far."""
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """The current progress line."""
        rate = self.rate
        pct = f" ({100 * self.done / self.total:5.1f}%)" if self.total else ""
        left = self.total - self.done
        eta = _clock(left / rate) if rate > 0 and left > 0 else "-"
        return (f"{self.label}: {self.done:,}/{self.total:,} {self.unit}{pct}, "
                f"{rate:,.0f} {self.unit}/s, ETA {eta}")

    def advance(self, n: int) -> None:
        """Count `n` more units done (never past the total); redraw when it is time."""
        self.done = min(self.done + n, self.total) if self.total else self.done + n
        now = time.monotonic()
        if self.enabled and now - self._last >= self._every:
            self._last = now
            self._write(self.line())

    def finish(self) -> None:
        """Write the final line."""
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        self._write(f"{self.label}: {self.done:,} {self.unit} in {_clock(elapsed)} "
                    f"({self.rate:,.0f} {self.unit}/s)", final=True)

    def _write(self, text: str, *, final: bool = False) -> None:
        if self._tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
