"""From the runner's published snapshots to pool-stream frames: encode once, hand the same frame to every sink.

The engine runner calls its observers with ``(snapshot, events)`` on the engine thread each time it publishes. The
window's History, a ``--record`` file and a ``--publish`` socket all want the same thing, a
:class:`kvstream.poolstream.Frame`, so one :class:`FrameFanout` encodes each snapshot once and writes the frame to
each sink. A sink that raises is dropped and reported (:meth:`FrameFanout.take_failures`); the others, and the
engine, go on. Qt-free: headless runs use it too.
"""
from __future__ import annotations

import threading
from typing import Sequence

from kvstream.poolstream import StreamEncoder


class FrameFanout:
    """A runner observer: ``fanout(snapshot, events)`` encodes one frame and writes it to every sink.

    ``first``: a snapshot to encode at once (the runner's newest, when attaching to a runner that is already
    running), so the sinks start with a keyframe of the present and not with whatever frame comes next.
    """

    def __init__(self, sinks: Sequence[object], *, first=None, keyframe_interval: int = 256):
        self.encoder = StreamEncoder(keyframe_interval=keyframe_interval)  # one encoding for all sinks
        self._sinks = list(sinks)  # objects with write(frame); a failed one is removed
        self._failures: list[str] = []  # why sinks were dropped, taken by the GUI thread
        self._lock = threading.Lock()  # the engine thread writes failures, the GUI thread takes them
        self.frames = 0  # frames encoded
        if first is not None:
            self(first, ())

    @property
    def sinks(self) -> list[object]:
        with self._lock:
            return list(self._sinks)

    def __call__(self, snapshot, events) -> None:
        frame = self.encoder.encode(snapshot, events)
        self.frames += 1
        for sink in list(self._sinks):
            try:
                sink.write(frame)
            except Exception as exc:  # a full disk or a closed socket stops that output, not the engine
                with self._lock:
                    self._sinks.remove(sink)
                    self._failures.append(f"{_name(sink)} stopped: {type(exc).__name__}: {exc}")

    def take_failures(self) -> list[str]:
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def close(self) -> None:
        """Close every sink that can be closed (files, sockets)."""
        for sink in self._sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def _name(sink) -> str:
    path = getattr(sink, "path", None)
    return f"{type(sink).__name__} ({path})" if path else type(sink).__name__
