"""Which step a pane shows, as one value: live (the newest frame) or one frame of the history kept.

The timeline's slider, the pane's grid and the source that decodes history frames used to hold the position each,
reconciled through "scrubbing" flags on both sides (a drag went timeline -> pane -> source -> pane -> timeline),
and later through a pane that copied the cursor into the timeline. Here, as napari's ``Dims`` is for its sliders and
canvas, there is one: :class:`StepCursor` holds the frame the user wants on view, whoever moved it (the slider, a
key, an event clicked in the log, Back to live, the history dropping the frame on view), and the frame that is on
view now. The source follows the first by decoding that frame and writes the second when it lands; the timeline
draws the first and moves it. The frame on view may trail the wanted one while a far frame decodes; the timeline
shows where the user has it, never the frame that happens to be decoded.

Qt-free: listeners are plain callables, called in order on the thread that moved the cursor (the GUI thread).
"""
from __future__ import annotations

from typing import Callable

Listener = Callable[["StepCursor"], None]


def _frame(seq) -> int | None:
    if seq is None:
        return None
    if isinstance(seq, bool) or int(seq) != seq or seq < 0:
        raise ValueError(f"a frame number is a non-negative integer, got {seq!r}")
    return int(seq)


class StepCursor:
    """The frame wanted on view (``seq``; None: live), whether it moves in a run (``running``: a drag or play, of
    which only the latest move matters, so a far frame may be decoded off the GUI thread), and the frame on view now
    (``shown``; None: live)."""

    def __init__(self):
        self.seq: int | None = None  # history frame wanted on view; None: follow the newest frame
        self.running = False  # the last move was one of a run (drag, play)
        self.shown: int | None = None  # history frame on view now; None: the newest frame (or nothing yet)
        self._listeners: list[Listener] = []

    @property
    def live(self) -> bool:
        return self.seq is None

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(cursor)`` after every move that changed the wanted frame."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def move(self, seq: int | None, running: bool = False) -> bool:
        """Want frame ``seq`` on view (None: live); returns whether anything changed (listeners were called)."""
        seq = _frame(seq)
        running = bool(running) and seq is not None
        if seq == self.seq and running == self.running:
            return False
        self.seq, self.running = seq, running
        for listener in list(self._listeners):
            listener(self)
        return True

    def show(self, seq: int | None) -> bool:
        """Frame ``seq`` is on view now (None: live), as the source that decoded it says; returns whether that
        changed. Moves nothing: the wanted frame stays what the user asked for."""
        seq = _frame(seq)
        changed = seq != self.shown
        self.shown = seq
        return changed
