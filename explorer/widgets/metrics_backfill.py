"""Metrics for a source whose frames were recorded before the window saw them (a recording opened from disk).

The metric plots are fed by live frames as they arrive. A recording has none: all its frames are already in its
history, so its plots stayed empty and "metrics up to the step on view" showed nothing. This reads the history
back, oldest first, into the metrics panel: at most as many frames as the panel keeps, spread evenly over the
recording, a few milliseconds per timer tick so the window keeps drawing while it fills (a sequential read costs
one delta per frame, through ``History.walk`` and its own decoder, so that scrubbing meanwhile costs it nothing).
"""
from __future__ import annotations

import time

from PySide6 import QtCore

from ..model.metrics_history import HISTORY

TICK_BUDGET_S = 0.008  # GUI-thread time one tick may spend reading frames
HOLD_MS = 400  # after the user moves through history, wait this long before reading on (scrubbing comes first)


def sample_seqs(seqs: list[int], most: int = HISTORY) -> list[int]:
    """At most ``most`` of ``seqs`` (ascending), spread evenly, the first and the last always included."""
    if len(seqs) <= most:
        return list(seqs)
    stride = (len(seqs) - 1) / (most - 1)
    return sorted({seqs[round(i * stride)] for i in range(most)})


class MetricsBackfill(QtCore.QObject):
    """Reads a history's frames into a MetricsPanel, a slice per timer tick; :meth:`stop` abandons it."""

    def __init__(self, panel, parent: QtCore.QObject | None = None):
        super().__init__(parent)
        self.panel = panel  # the MetricsPanel to fill
        self.history = None  # the kvstream History being read, None when idle
        self._walk = None  # History.walk over the frames still to read
        self.timer = QtCore.QTimer(self)
        self.timer.setInterval(0)
        self.timer.timeout.connect(self._tick)
        self._resume = QtCore.QTimer(self)  # restarts the reading after a hold
        self._resume.setSingleShot(True)
        self._resume.setInterval(HOLD_MS)
        self._resume.timeout.connect(self._go_on)

    @property
    def active(self) -> bool:
        return self.history is not None

    def start(self, history) -> None:
        """Read ``history`` (all it keeps now) into the panel, from an empty panel."""
        self.stop()
        if history is None or len(history) == 0:
            return
        self.history = history
        self._walk = history.walk(sample_seqs(history.seqs()))  # its own decoder: scrubbing does not restart it
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()
        self._resume.stop()
        self.history = None
        self._walk = None

    def hold(self) -> None:
        """The user is scrubbing: read nothing until HOLD_MS after the last call. While a recording's metrics were
        filled, its slices took a large share of the GUI thread from the scrubbing they ran beside
        (bench/gui.py --sections scrub; figures: docs/performance.md, "Scrubbing")."""
        if self.history is not None:
            self.timer.stop()
            self._resume.start()  # (re)starts the wait

    def _go_on(self) -> None:
        if self.history is not None:
            self.timer.start()

    def _tick(self) -> None:
        end = time.perf_counter() + TICK_BUDGET_S
        while time.perf_counter() < end:
            item = next(self._walk, None)  # frames dropped from the history meanwhile (its budget) are skipped
            if item is None:
                self.stop()
                return
            self.panel.record(item[1], timed=False)
