"""Progress lines of a long layout search (``planner.plan``), for a user who would otherwise wait in silence.

A search has two passes (``planner`` module doc): the memory estimate and lower bound of every enumerated
layout, then the full price of settings in bound order. ``SearchProgress`` turns their counts into one line
each at most every ``interval_s`` seconds (elapsed time and, in the first pass, an ETA from the mean time
per layout so far), plus one line when each pass ends; a search shorter than ``interval_s`` prints only the
pass-end lines if it printed anything before. Invariant: ``report`` is called with the lines only, so the
search never depends on where they go (stderr in ``scripts/plan.py``, a list in tests, nowhere by default).
"""

from __future__ import annotations

import time
from typing import Callable

from parallel3d.progress import format_duration

Report = Callable[[str], None]


class SearchProgress:
    """Throttled progress lines of one search; ``report=None`` prints nothing."""

    def __init__(self, report: Report | None, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.report, self.interval_s, self.clock = report, interval_s, clock
        self.t0 = self.last = clock()
        self.spoke = False  # a line was printed: the pass ends are then printed too

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(f"plan: {line} ({format_duration(self.clock() - self.t0)} elapsed)")
            self.spoke = True
        self.last = self.clock()

    def _due(self) -> bool:
        return self.report is not None and self.clock() - self.last >= self.interval_s

    def layouts(self, done: int, total: int, fitting: int) -> None:
        """During the first pass: ``done`` of ``total`` layouts estimated, ``fitting`` of them fit."""
        if not self._due() or done == 0:
            return
        eta = (self.clock() - self.t0) / done * (total - done)
        self._say(f"memory and bound: {done:,} of {total:,} layouts, {fitting:,} fit, ~{format_duration(eta)} left")

    def bounded(self, total: int, settings: int) -> None:
        """End of the first pass: ``settings`` fitting settings to price in bound order."""
        if self.spoke or self._due():
            self._say(f"memory and bound done: {total:,} layouts, {settings:,} fitting settings")

    def simulated(self, done: int, settings: int) -> None:
        """During the second pass: ``done`` settings priced in full (at most ``settings``)."""
        if self._due():
            self._say(f"simulating: {done:,} settings priced (of at most {settings:,}; the rest are bounded out)")

    def finished(self, simulated: int) -> None:
        if self.spoke or self._due():
            self._say(f"done: {simulated:,} settings simulated")


__all__ = ["Report", "SearchProgress"]
