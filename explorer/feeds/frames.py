"""What a feed's poll hands the window: one frame, with the events that led to it, as one unit.

The grid, the event log, the timeline's marks, the block history and the inspector's relocation-following all
show the same moment only if the snapshot and its events travel together. A feed therefore never hands out a
snapshot alone: :meth:`explorer.feeds.feed.Feed.poll` returns a :class:`FeedFrame`, the newest snapshot plus the
events of every frame since the previous poll (the window may skip frames, never their events). A kvstream History,
where a feed has one, is fed from the same updates and serves the timeline's scrubbing of the past; it no longer
carries the live window's events (a feed without one still shows them).

Qt-free: headless runs and tests poll the same feeds.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvstream.views import NO_CHANGE_RECORD, ChangeRecord, PoolSnapshot, chain_changes

MAX_PENDING_EVENTS = 200_000  # events an engine feed holds for a window that does not poll (hidden, stalled); past
# that the oldest are dropped and counted (FeedFrame.dropped): a bound, not a loss a running window ever sees


@dataclass(frozen=True)
class FeedFrame:
    """The newest frame of a feed since its last poll, and the events of every frame up to it."""

    snapshot: PoolSnapshot  # the newest view (earlier frames' snapshots are coalesced into it)
    seq: int | None  # its frame number in the feed's stream (the History's seq where the feed keeps one; None: no
    # numbers, a feed without a history that does not count its frames)
    events: tuple = ()  # (seq, BlockEvent) of every frame since the previous poll up to this one, oldest first
    restarted: bool = False  # a new stream (a new feed, an attached source that restarted): start over
    dropped: int = 0  # events of those frames dropped because the window fell too far behind (MAX_PENDING_EVENTS)
    changes: ChangeRecord = NO_CHANGE_RECORD  # which blocks may differ from ``changes.base`` (the snapshot of the
    # frame handed out before, where the producer knows; the grid redraws those and compares nothing)


class FrameBuffer:
    """An engine runner observer that keeps what the window has not taken yet: the newest update's snapshot and
    every update's events (bounded), under the numbers the runner gave them.

    Called on the engine thread (one :class:`~kvstream.views.PoolUpdate` per publication); :meth:`take` on the GUI
    thread. The runner numbers its updates once (``PoolUpdate.seq``, from 0); the pool-stream encoder that writes
    the History from the same updates gives its frames those numbers too, so an event's seq is a frame the timeline
    can jump to.
    """

    def __init__(self, max_events: int = MAX_PENDING_EVENTS):
        self.max_events = int(max_events)
        self._lock = threading.Lock()
        self._got = False  # an update (or a prime) came
        self._snapshot: PoolSnapshot | None = None  # the newest update's, until taken
        self._seq: int | None = None  # its number
        self._changes: ChangeRecord = NO_CHANGE_RECORD  # from the snapshot taken last to the newest, chained
        self._events: deque = deque()  # (seq, BlockEvent) not taken yet
        self._dropped = 0  # events dropped since the last take
        self._taken = False  # something was taken: later frames continue the stream

    def __call__(self, update) -> None:
        """One published update (the runner's observer call), numbered by the runner."""
        seq = update.seq
        if seq is None:
            raise ValueError("a FrameBuffer takes the engine runner's numbered updates (PoolUpdate.seq)")
        with self._lock:
            self._got = True
            if self._snapshot is None:  # the first update since a take: its record starts from the frame taken
                self._changes = update.changes
            elif update.changes.base is self._snapshot:  # frames the window will skip: what changed over them all
                self._changes = chain_changes(self._changes, update.changes)
            else:
                self._changes = NO_CHANGE_RECORD
            self._snapshot, self._seq = update.snapshot, seq
            if update.events:
                self._events.extend((seq, event) for event in update.events)
                over = len(self._events) - self.max_events
                if over > 0:
                    for _ in range(over):
                        self._events.popleft()
                    self._dropped += over

    def prime(self, snapshot: PoolSnapshot | None) -> None:
        """Start from ``snapshot`` (the runner's newest, when the buffer joins a runner already running): the
        window's first frame, with no events (those before it went to nobody) and no number (read apart from the
        snapshot, the runner's count could name another update). Ignored once an update came."""
        if snapshot is None:
            return
        with self._lock:
            if not self._got:
                self._got = True
                self._snapshot, self._seq = snapshot, None

    def take(self) -> FeedFrame | None:
        """The newest frame with the events of every frame since the last take (None: nothing new)."""
        with self._lock:
            if self._snapshot is None:
                return None
            frame = FeedFrame(self._snapshot, self._seq, tuple(self._events), not self._taken, self._dropped,
                              self._changes)
            self._snapshot, self._changes = None, NO_CHANGE_RECORD
            self._events.clear()
            self._dropped = 0
            self._taken = True
        return frame


class HistoryReader:
    """For a feed whose frames arrive in a kvstream History it owns (a recording, an attached stream): the events
    of the frames it gained since the last read, up to the frame handed out with them."""

    def __init__(self):
        self.seq: int | None = None  # newest frame whose events were read
        self.stream: int | None = None  # the history's stream id then

    def read(self, history, upto: int | None) -> tuple[tuple, bool]:
        """((seq, event) of the frames after the last read up to ``upto`` (None: the newest kept), whether the
        history is a new stream whose kept events these all are)."""
        if history is None or len(history) == 0:
            return (), False
        last, stream = history.last_seq, history.stream_id
        if upto is not None:
            last = min(last, upto)
        restarted = stream != self.stream or self.seq is None
        if not restarted and last <= self.seq:
            return (), False
        first = history.first_seq
        start = first if restarted else max(first, self.seq + 1)
        pairs = tuple(history.events(start, last)) if start <= last else ()
        self.seq, self.stream = last, stream
        return pairs, restarted
