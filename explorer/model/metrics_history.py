"""The pool's recent samples, one per engine step the window sees: what the Metrics dock plots (Qt-free)."""
from __future__ import annotations

import time

import numpy as np

from kvstream.rules import Rate
from kvstream.views import PoolSnapshot

HISTORY = 1200  # samples kept (about 40 s at 30 frames/s)
SERIES = ("step", "used", "cached", "free", "filled", "allocated", "saved", "contiguous", "tokens_per_s",
          "preemptions", "hit_rate")
_ROW = {name: i for i, name in enumerate(SERIES)}  # row of each series in MetricsHistory.samples


class MetricsHistory:
    """The recent samples, newest last; decode speed comes from the generated-token counter and wall time
    (:class:`kvstream.rules.Rate`, the project's one sliding-window rate).

    Samples live in a float buffer [len(SERIES), 2 * HISTORY]; the newest HISTORY are columns ``start..end``.
    When the buffer's end is reached the last HISTORY columns are moved to the front: one copy every HISTORY
    samples instead of a shift of the whole matrix on every frame once full. Read through :meth:`series` (a
    contiguous view, what the plots take)."""

    def __init__(self):
        self.clear()

    @property
    def count(self) -> int:
        """Samples held (at most HISTORY), the newest last."""
        return self._end - self._start

    @property
    def samples(self) -> np.ndarray:
        """The samples held, [len(SERIES), count] (a view)."""
        return self._buffer[:, self._start:self._end]

    def record(self, snap: PoolSnapshot, now: float | None = None, timed: bool = True) -> None:
        """One sample of ``snap``. ``timed`` False: a frame read back from a history or recording, whose wall-clock
        time is unknown, so its tokens/s is left out (NaN, not drawn) instead of measured against now."""
        mem, met = snap.memory, snap.metrics
        if timed:
            now = time.perf_counter() if now is None else now
            tokens = met.num_generated_tokens
            if self._tokens is None or tokens < self._tokens:  # the first sample, or a new engine's counter
                self._rate.clear()
                self._tokens = tokens
            self._rate.tick(tokens - self._tokens, now)
            self._tokens = tokens
            rate = self._rate.per_second(now)
        else:
            rate = float("nan")
        if mem:
            pool = (mem.num_used_blocks, mem.num_cached_blocks, mem.num_free_blocks, mem.num_filled_slots,
                    mem.num_allocated_slots, mem.num_slots_saved_by_sharing, mem.num_contiguous_slots)
        else:
            pool = (0,) * 7
        values = (snap.step_id, *pool, rate, met.num_preemptions,  # in SERIES order
                  100.0 * met.prefix_cache_hit_rate)
        if self.count and self._buffer[_ROW["step"], self._end - 1] == snap.step_id:
            index = self._end - 1  # published again after a command, not a step: update the step's sample
        else:
            if self._end == self._buffer.shape[1]:  # the buffer is used up: the newest HISTORY - 1 to the front
                keep = HISTORY - 1
                self._buffer[:, :keep] = self._buffer[:, self._end - keep:self._end]
                self._start, self._end = 0, keep
            elif self.count == HISTORY:
                self._start += 1  # the oldest sample goes
            index = self._end
            self._end += 1
        self._buffer[:, index] = values

    def series(self, name: str) -> np.ndarray:
        return self._buffer[_ROW[name], self._start:self._end]

    def clear(self) -> None:
        self._buffer = np.zeros((len(SERIES), 2 * HISTORY))
        self._start = self._end = 0  # the samples held are columns start..end-1
        self._rate = Rate(window=1.0)  # tokens generated per second over the last second
        self._tokens: int | None = None  # the generated-token counter at the last timed sample
