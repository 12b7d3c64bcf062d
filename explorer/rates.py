"""One way to turn a running count into a rate, shared by every "per second" the window shows.

GUI frames per second, engine steps per second and decoded tokens per second are all the same question: how much
did a counter grow over the last second. Asking it of the views a source delivers (their ``step_id`` and
``metrics.num_generated_tokens``) rather than of the engine thread means it works the same for the local engine,
an attached stream and a recording being played.
"""
from __future__ import annotations

import time
from collections import deque


class RateMeter:
    """Growth per second of a running count over a sliding window, decaying to 0 when the count stops growing.

    Feed it the count's current value with :meth:`add` (or :meth:`tick` for "one more event"); :meth:`rate` is
    ``(newest count - oldest count in the window) / (now - oldest time)``. The sample just before the window is
    kept as the window's anchor so a slow counter (one step every 0.7 s) still has a rate, and a count that goes
    backwards (a new source started from 0) starts the meter over instead of reporting a negative rate.
    """

    def __init__(self, window_s: float = 1.0, clock=time.perf_counter):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.window_s = window_s  # seconds the rate is averaged over
        self._clock = clock  # time source (tests pass a fake one)
        self._samples: deque[tuple[float, float]] = deque()  # (time, count), oldest first
        self._count = 0.0  # running total for tick()

    def add(self, count: float, now: float | None = None) -> None:
        """The count is ``count`` at time ``now``."""
        now = self._clock() if now is None else now
        if self._samples and count < self._samples[-1][1]:
            self._samples.clear()  # a counter that restarted (new engine): the old samples say nothing now
        self._samples.append((now, float(count)))
        self._count = float(count)
        self._trim(now)

    def tick(self, now: float | None = None) -> None:
        """One more event happened now."""
        self.add(self._count + 1, now)

    def rate(self, now: float | None = None) -> float:
        """Count growth per second over the last ``window_s`` seconds; 0 with fewer than two samples."""
        now = self._clock() if now is None else now
        self._trim(now)
        if len(self._samples) < 2:
            return 0.0
        t0, c0 = self._samples[0]
        _, c1 = self._samples[-1]
        return (c1 - c0) / max(now - t0, 1e-9)

    def reset(self) -> None:
        self._samples.clear()
        self._count = 0.0

    def _trim(self, now: float) -> None:
        """Drop samples older than the window, keeping the newest of them as the anchor."""
        start = now - self.window_s
        while len(self._samples) >= 2 and self._samples[1][0] <= start:
            self._samples.popleft()
