"""Progress of long operator work (rebuild, backup, restore), reported to a callback.

The replay functions count their work in a `Progress` and hand every step to the
caller's `ProgressCallback`; they write nothing themselves. The command line draws the
updates on stderr (`memledger.cli.common.ProgressLine`); a library caller may log them,
show them elsewhere, or pass nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """Where one phase of the work stands (`total` 0: unknown)."""

    label: str
    done: int
    total: int
    unit: str
    elapsed: float
    final: bool = False

    @property
    def rate(self) -> float:
        """Units per second so far."""
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the current rate, when there is a rate and work left."""
        rate, left = self.rate, self.total - self.done
        return left / rate if rate > 0 and left > 0 else None


#: Called at every step of the work and once when a phase ends (`final`).
ProgressCallback = Callable[[ProgressUpdate], None]


class Progress:
    """Counts `total` units of one phase (`label`) and reports each step to `report`.

    `report` None (or any falsy value, such as the `progress=False` of older callers)
    reports nothing.
    """

    def __init__(self, label: str, total: int, *, unit: str = "events",
                 report: ProgressCallback | None = None) -> None:
        self.label = label
        self.total = max(0, total)
        self.unit = unit
        self.report = report or None
        self.done = 0
        self.started = time.monotonic()

    def update(self, *, final: bool = False) -> ProgressUpdate:
        """The current state."""
        return ProgressUpdate(self.label, self.done, self.total, self.unit,
                              time.monotonic() - self.started, final)

    def advance(self, n: int) -> None:
        """Count `n` more units done (never past the total) and report it."""
        self.done = min(self.done + n, self.total) if self.total else self.done + n
        if self.report is not None:
            self.report(self.update())

    def finish(self) -> None:
        """Report the end of the phase."""
        if self.report is not None:
            self.report(self.update(final=True))
