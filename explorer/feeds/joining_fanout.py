"""A runner observer that joins an engine already running (File > Record): its file starts with a keyframe of the
present, and every later frame follows it with its events.

The runner adds an observer with a queued command, so frames may be published between the request and the moment
the observer is in the runner's list. Encoding ``runner.latest`` on the GUI thread at the request (what an earlier
version did) could therefore start the file at a stale state, with the frames published in between missing from
it. :class:`JoiningFanout` is primed on the engine thread instead, right after the runner added it (from the
command's done callback, which runs there) and before the runner publishes anything more; if a frame reaches it
first, that frame becomes its keyframe. Either way the file holds one unbroken run of frames.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

from kvstream.fanout import FrameFanout
from kvstream.views import PoolUpdate


class JoiningFanout:
    """A :class:`~kvstream.fanout.FrameFanout` for sinks that join a running engine; call :meth:`prime` with the
    runner's newest snapshot once the runner holds this observer (a paused engine then still gives a file that
    opens)."""

    def __init__(self, sinks: Sequence[object]):
        self.fanout = FrameFanout(sinks, threaded=True)  # encodes once (off the engine thread), writes to every
        # sink, drops a failing one
        self._lock = threading.Lock()  # prime() may come from another thread than the frames
        self._first = None  # the snapshot the first frame was made of (None: nothing encoded yet)

    @property
    def primed(self) -> bool:
        return self._first is not None

    def prime(self, snapshot) -> None:
        """Encode ``snapshot`` (the runner's newest) as the first frame, unless a frame came first."""
        with self._lock:
            if self._first is None and snapshot is not None:
                self._first = snapshot
                self.fanout(PoolUpdate.of(snapshot))

    def __call__(self, update: PoolUpdate) -> None:
        with self._lock:
            if update.snapshot is self._first:
                return  # prime() already encoded this very snapshot (it was published while priming)
            if self._first is None:
                self._first = update.snapshot
            self.fanout(dataclasses.replace(update, seq=None))  # the file's own frames: numbered from its first

    @property
    def sinks(self) -> list[object]:
        return self.fanout.sinks

    def take_failures(self) -> list[str]:
        return self.fanout.take_failures()

    def stop(self, timeout: float | None = 10.0) -> bool:
        return self.fanout.stop(timeout)

    def close(self) -> None:
        self.fanout.close()
