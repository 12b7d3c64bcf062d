"""Which step a pane shows, as one value: live (the newest frame) or one frame of the history kept.

The timeline's slider, the pane's grid and the source that decodes history frames used to hold the position each,
reconciled through "scrubbing" flags on both sides (a drag went timeline -> pane -> source -> pane -> timeline).
Here, as napari's ``Dims`` is for its sliders and canvas, there is one: :class:`StepCursor` holds the frame the user
wants on view, whoever moved it (the slider, a key, an event clicked in the log, Back to live, the history dropping
the frame on view). The source follows it by decoding that frame; the timeline follows it by drawing it. The frame
actually on view may trail the wanted one while a far frame decodes (``PoolSource.viewing``); the timeline shows
where the user has it, never the frame that happens to be decoded.

Qt-free: listeners are plain callables, called in order on the thread that moved the cursor (the GUI thread).
"""
from __future__ import annotations

from typing import Callable

Listener = Callable[["StepCursor"], None]


class StepCursor:
    """The frame wanted on view (``seq``; None: live) and whether it moves in a run (``running``: a drag or play,
    of which only the latest move matters, so a far frame may be decoded off the GUI thread)."""

    def __init__(self):
        self.seq: int | None = None  # history frame wanted on view; None: follow the newest frame
        self.running = False  # the last move was one of a run (drag, play)
        self._listeners: list[Listener] = []

    @property
    def live(self) -> bool:
        return self.seq is None

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(cursor)`` after every move that changed it."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def move(self, seq: int | None, running: bool = False) -> bool:
        """Want frame ``seq`` on view (None: live); returns whether anything changed (listeners were called)."""
        if seq is not None:
            if isinstance(seq, bool) or int(seq) != seq or seq < 0:
                raise ValueError(f"a frame number is a non-negative integer, got {seq!r}")
            seq = int(seq)
        running = bool(running) and seq is not None
        if seq == self.seq and running == self.running:
            return False
        self.seq, self.running = seq, running
        for listener in list(self._listeners):
            listener(self)
        return True
