"""When each step went by, as the window saw it: what turns "40 steps idle" into seconds where the source is live.

No source puts a wall-clock time on its steps (a pool stream and a recording carry step numbers only), but a live
source's frames reach the window as its steps happen, so the time a frame arrived dates its step to within a frame
(about 33 ms). The clock keeps those times (bounded, oldest forgotten first) and answers spans between two steps it
saw, interpolating between frames the window skipped; a step before the first one it saw, or a recording's (read
back, not lived), has no time, and the words then say steps only. Qt-free.
"""
from __future__ import annotations

import time

import numpy as np

CAPACITY = 65_536  # steps remembered (the newest); older ones fall out first


class StepClock:
    """Step -> monotonic seconds, for the steps of a live source the window saw arrive."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = int(capacity)
        self._steps = np.zeros(self.capacity, np.int64)
        self._times = np.zeros(self.capacity, np.float64)
        self._n = 0

    def clear(self) -> None:
        """A new source: its steps are not the old one's."""
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def saw(self, step: int, now: float | None = None) -> None:
        """A live frame of ``step`` arrived now (repeats and steps going back are ignored)."""
        step = int(step)
        if self._n and step <= self._steps[self._n - 1]:
            return
        if self._n == self.capacity:
            keep = self.capacity // 2
            self._steps[:keep] = self._steps[self._n - keep:self._n]
            self._times[:keep] = self._times[self._n - keep:self._n]
            self._n = keep
        self._steps[self._n] = step
        self._times[self._n] = time.monotonic() if now is None else now
        self._n += 1

    def time_of(self, step: int) -> float | None:
        """Monotonic seconds at which ``step`` went by (interpolated between the frames seen), or None outside the
        steps seen."""
        n = self._n
        if not n or step < self._steps[0] or step > self._steps[n - 1]:
            return None
        return float(np.interp(step, self._steps[:n], self._times[:n]))

    def seconds_between(self, first: int, last: int) -> float | None:
        """Seconds from step ``first`` to step ``last``, or None where either was not seen."""
        a, b = self.time_of(first), self.time_of(last)
        return None if a is None or b is None else max(0.0, b - a)

    def seconds_since(self, step: int, now: float | None = None) -> float | None:
        """Seconds from step ``step`` until now, or None where it was not seen."""
        at = self.time_of(step)
        return None if at is None else max(0.0, (time.monotonic() if now is None else now) - at)
