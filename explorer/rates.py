"""The window's rates (GUI frames/s, engine steps/s, tokens/s), all from one helper: ``kvstream.rules.Rate``.

Steps and tokens are read off the views a source delivers (their ``step_id`` and ``metrics.num_generated_tokens``)
rather than asked of the engine thread, so the status line reads the same for the local engine, an attached stream
and a recording being played. A view carries a running count, not an event, hence this adapter.
"""
from __future__ import annotations

import time

from kvstream.rules import Rate


class CounterRate:
    """Growth per second of a running count (a step id, a token counter), through a :class:`Rate`.

    ``add(count)`` gives the count's current value; the growth since the previous value is ticked into the rate.
    A count that goes backwards (a new source counting from 0) starts the rate over instead of going negative.
    """

    def __init__(self, window_s: float = 1.0, clock=time.perf_counter):
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s!r}")
        self.rate = Rate(window=window_s, clock=clock)  # the shared helper that does the arithmetic
        self._last: float | None = None  # the count given last, None before the first

    def add(self, count: float, now: float | None = None) -> None:
        if self._last is None or count < self._last:
            self.rate.clear()
            self.rate.tick(0, now)
        else:
            self.rate.tick(int(count - self._last), now)
        self._last = count

    def per_second(self, now: float | None = None) -> float:
        return self.rate.per_second(now)

    def reset(self) -> None:
        self.rate.clear()
        self._last = None
