"""The window's model: one object owns the current source of pool views and the view every panel shows.

The explorer can watch the project's engine in this process, a pool stream another process publishes, a recording
on disk, or a vLLM/SGLang KV-event stream. They differ in what they can do: only the local engine takes commands
and has K/V values; a stream and a recording are read-only but keep a history to scrub; a KV-event stream knows
block contents but no physical pool. :class:`PoolSource` hides the difference behind one API and a few signals,
so panels ask it ("can I command?", "what should I show now?") instead of testing which kind of source they have,
and a restart, an opened recording or an attach swaps the feed in one place that every panel hears about.

A *feed* (:class:`~explorer.feeds.feed.Feed`, Qt-free so headless runs use the same ones) is one concrete source;
:class:`PoolSource` drives it from the GUI thread's frame timer (:meth:`PoolSource.poll`) and never blocks on it.

Plain Python, as napari's model layer is: it runs and is tested without a display. Its eight signals are
:class:`~explorer.model.signals.Signal` objects unless it is given others with the same names; the window gives it
Qt signals (:mod:`explorer.window.qt_source`), so the panels connect to it as to any Qt object. The step on view is
its :class:`~explorer.model.cursor.StepCursor`'s, which the timeline moves and reads too.
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from kvstream.events import EventKind
from kvstream.history import Cancelled
from kvstream.poolstream import StreamError
from kvstream.views import NO_CHANGE_RECORD, ChangeRecord, PoolSnapshot

from ..feeds.feed import Capabilities, Feed, Problem, done_future
from ..feeds.futures import FutureWatcher
from ..feeds.snapshot_block import block_info_from_snapshot
from .cursor import StepCursor
from .palette import ColourBook
from .signals import Signal

__all__ = ["Capabilities", "Feed", "PoolSignals", "PoolSource", "Problem"]

SIGNALS = ("sourceChanged", "frameArrived", "viewChanged", "viewingChanged", "eventsArrived", "eventsDropped",
           "historyChanged", "problem")


def _timed(fn, *args):
    """(fn(*args), when it began, when it ended): perf_counter seconds."""
    start = time.perf_counter()
    out = fn(*args)
    return out, start, time.perf_counter()


KEPT_EVENTS = 10_000  # the newest events a source keeps for a panel that follows it later (the event log's rows)
SCRUB_ON_GUI_THREAD = 12  # frames of decoding (History.decode_cost) a scrub does on the GUI thread; more go to a
# worker (a frame far from the one decoded last takes longer than a frame of the window on a large pool)
SCRUB_PACE_S = 0.033  # the worker begins at most one decode per window frame (it shows no more), and rests as long
# as its last decode took before the next: decoding back to back, it held the GIL the GUI thread needs for drawing so
# much that a drag over a long recording of a large pool lost frames (figures: docs/performance.md, "Scrubbing"); a
# decode that has to wait begins at the first poll after its time


class PoolSignals:
    """The eight signals of a :class:`PoolSource`, as plain Python (see :class:`PoolSource` for what each says)."""

    def __init__(self):
        for name in SIGNALS:
            setattr(self, name, Signal())


class PoolSource:
    """Owns the current feed and the view the window shows: the newest frame (live) or one kept frame (history).

    Signals (all on the GUI thread, from :meth:`poll` or a call that changes something):

    - ``sourceChanged(feed)``: a different feed took over (restart, open, attach); panels start over.
    - ``frameArrived(snapshot)``: a new live frame, whether or not it is being shown (metrics, rates).
    - ``viewChanged(snapshot)``: what every view should show now (live frame, or the frame scrubbed to).
    - ``viewingChanged(seq)``: ``None`` when live, else the history sequence number being viewed.
    - ``eventsArrived(pairs, restarted)``: a new frame came from the feed; ``pairs`` are the (seq, BlockEvent) of
      every frame since the last one taken, oldest first, as the feed's frame carried them (never read back out of
      the History), once for every panel (timeline marks, event log, block history, the inspector's relocation
      check). ``restarted``: a new stream (a new feed, an attached source that restarted) and ``pairs`` are
      everything it has: start over. Emitted before ``frameArrived`` and ``viewChanged`` of the same frame.
    - ``eventsDropped(n)``: the feed let ``n`` events go because the window fell too far behind it.
    - ``historyChanged()``: the History's kept frames changed (the timeline's range follows it).
    - ``problem(Problem)``: something to tell the user once (failures of the feed, refused commands).

    ``signals``: an object with those eight attributes, each with ``connect``, ``disconnect`` and ``emit`` (Qt's
    bound signals, say); None: :class:`PoolSignals`.
    """

    def __init__(self, feed: Feed | None = None, signals=None):
        signals = PoolSignals() if signals is None else signals
        self.signals = signals  # kept alive with the source (a QObject's signals live as long as it does)
        for name in SIGNALS:
            setattr(self, name, getattr(signals, name))
        self.feed: Feed = feed or Feed()
        self.feed.started()
        self.futures = FutureWatcher(on_error=self._command_refused)
        self.live: PoolSnapshot | None = None  # newest frame delivered by the feed
        self.events_snapshot: PoolSnapshot | None = None  # the snapshot the events handed out last came with
        self._live_at = 0.0  # when it was delivered (perf_counter)
        self.view: PoolSnapshot | None = None  # what the views show (== live unless viewing history)
        self.view_changes: ChangeRecord = NO_CHANGE_RECORD  # which blocks of ``view`` may differ from the view before
        # (its ``base``), as the feed's frame said; nothing known for a frame of history
        self.colours = ColourBook()  # its conversations' colours (ids are per source: one book each)
        self.cursor = StepCursor()  # the frame wanted on view, whoever moved it (the source follows it: _follow),
        # and the frame on view (``viewing``)
        self.cursor.subscribe(self._follow)
        self._events_seq: int | None = None  # newest frame whose events went out with eventsArrived
        self._recent: deque = deque(maxlen=KEPT_EVENTS)  # the newest (seq, event) handed out (kept_events)
        self.events_dropped = 0  # events the feed dropped because the window fell too far behind
        self._history_shape = None  # (stream id, first seq, last seq) of the history at the last poll
        # scrubbing (seek_soon): the frame wanted next, the decode under way (its Future), and a generation that
        # every other move (seek, go_live, a new feed) bumps so that a late decode is dropped
        self._scrub_wanted: int | None = None
        self._scrub_decoding: Future | None = None
        self._moves = 0
        self._worker: ThreadPoolExecutor | None = None
        self._next_decode_at = 0.0  # the worker's next decode begins no sooner (perf_counter; see SCRUB_PACE_S)

    @property
    def viewing(self) -> int | None:
        """The history frame on view (None while live): the cursor's ``shown``, which may trail the frame it wants
        while a far frame decodes."""
        return self.cursor.shown

    def connect(self, **slots) -> None:
        """Connect each signal named to its slot (``viewChanged=panel.show``): how a panel starts following this
        source; :meth:`disconnect` with the same slots stops it (the window's active source changed)."""
        for name, slot in slots.items():
            getattr(self, name).connect(slot)

    def disconnect(self, **slots) -> None:
        for name, slot in slots.items():
            getattr(self, name).disconnect(slot)

    @staticmethod
    def switch(old: "PoolSource | None", new: "PoolSource", **slots) -> None:
        """Stop following ``old`` (None: nothing yet) and follow ``new`` through the same ``slots``."""
        if old is not None:
            old.disconnect(**slots)
        new.connect(**slots)

    # ---- what the source can do ----------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self.feed.capabilities

    @property
    def command_blocked_reason(self) -> str:
        """Why a command button is disabled now ("" when it is enabled)."""
        if not self.feed.capabilities.can_command:
            return self.feed.capabilities.read_only_reason or "this source is read-only"
        return ""

    @property
    def history(self):
        return self.feed.history

    # ---- swapping feeds --------------------------------------------------------------------------------
    def set_feed(self, feed: Feed) -> None:
        """Replace the feed (the old one is closed, its pending answers dropped) and tell every panel."""
        old = self.feed
        self.feed = feed
        self._drop_scrub()
        self.futures.clear()
        self.live = self.view = self.events_snapshot = None
        self.view_changes = NO_CHANGE_RECORD
        self._events_seq = self._history_shape = None
        self._recent.clear()
        was_viewing = self.cursor.show(None)
        if old is not feed:
            old.close()
        del old  # let go of it before the new feed starts (a recording freezes the heap then)
        self.sourceChanged.emit(feed)  # the panels let go of the old feed's frames
        self.cursor.move(None)  # the new feed's present (nothing to follow here: the view is reset above)
        if was_viewing:
            self.viewingChanged.emit(None)
        feed.started()
        self.poll()

    def close(self) -> None:
        self._drop_scrub()
        if self._worker is not None:  # a decode under way stops at its next frame (_drop_scrub)
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None
        self.futures.clear()
        self.feed.close()

    # ---- the frame loop -----------------------------------------------------------------------------------
    def poll(self, live_gap: float = 0.0) -> bool:
        """Deliver finished command answers, problems and the feed's new frame; returns whether the view changed.

        ``live_gap``: a new live frame waits until that many seconds after the last live frame went out (the
        window's budget, :class:`~explorer.model.pacer.LivePacer`); the feed keeps it, and the events of every frame
        it passes over, until then, and they go out together. 0: at every poll."""
        self.futures.poll()
        self._decode_next()  # a decode that waited for its pace (SCRUB_PACE_S)
        for problem in self.feed.take_problems():
            self.problem.emit(problem)
        if live_gap > 0 and self.live is not None and time.perf_counter() - self._live_at < live_gap:
            # the History's range waits with the frame: following it here redrew the timeline at every tick while
            # the grid kept to the budget (docs/performance.md, "Live frames and the History's range"); the poll
            # after the gap catches up
            return self._keep_viewed_frame()
        frame = self.feed.poll()  # the view and its events, as one unit
        if frame is not None:
            self._hand_out_events(frame)
        self._check_history()
        if frame is None:
            return self._keep_viewed_frame()
        latest = frame.snapshot
        if latest is self.live:
            return self._keep_viewed_frame()
        self.live = latest
        self._live_at = time.perf_counter()
        self.frameArrived.emit(latest)
        if self.viewing is None:
            self.view, self.view_changes = latest, frame.changes
            self.viewChanged.emit(latest)
            return True
        return self._keep_viewed_frame()

    def _hand_out_events(self, frame) -> None:
        """The events that came with ``frame`` go out once for every panel (``eventsArrived``), and the newest are
        kept for a panel that starts following this source later (:meth:`kept_events`)."""
        if frame.restarted:
            self._recent.clear()
        self._recent.extend(frame.events)
        if frame.seq is not None:
            self._events_seq = frame.seq
        if frame.dropped:
            self.events_dropped += frame.dropped
            self.eventsDropped.emit(frame.dropped)
        self.events_snapshot = frame.snapshot  # handed out before ``live`` moves: a panel may ask what pool it is
        self.eventsArrived.emit(list(frame.events), frame.restarted)

    def _check_history(self) -> None:
        """Say when the history's kept range changed (``historyChanged``): the timeline's range follows what the
        History has written, which may trail the live frame by what its encoder has not written yet."""
        history = self.history
        shape = None if history is None else (history.stream_id, history.first_seq, history.last_seq)
        if shape != self._history_shape:
            self._history_shape = shape
            if history is not None:
                self.historyChanged.emit()

    @property
    def events_seq(self) -> int | None:
        """The newest frame whose events went out with ``eventsArrived`` (None: none yet)."""
        return self._events_seq

    def kept_events(self) -> list:
        """(seq, event) of the newest events already handed out by ``eventsArrived`` (at most KEPT_EVENTS, as
        many as the event log shows): what a panel that starts following this source now (another pane made
        active) reads once; later frames come with the signal."""
        return list(self._recent)

    def block_events(self, block_id: int, upto: int | None = None) -> list:
        """(seq, event) that can concern the block that is ``block_id`` at frame ``upto`` (None: the newest frame
        whose events went out), oldest first: for its story (:class:`~explorer.model.block_history.BlockStory`).
        The past is the History's; the newest frames, which the History may not have written yet (and a source
        without one), come from the events handed out."""
        history = self.history
        kept = history is not None and len(history) > 0
        if upto is not None:
            return history.block_events(block_id, upto) if kept else []
        newest = self._events_seq
        if not kept:
            return list(self._recent)
        last = history.last_seq if newest is None else min(newest, history.last_seq)
        tail = [pair for pair in self._recent if pair[0] > last]
        if any(e.kind == EventKind.RELOCATED for _, e in tail):  # the block had another id at ``last``
            return history.events(history.first_seq, last) + tail
        return history.block_events(block_id, last) + tail

    def _keep_viewed_frame(self) -> bool:
        """While viewing history, follow the viewed frame if the history dropped it (memory budget)."""
        history = self.history
        if self.viewing is None or history is None or len(history) == 0 or self.viewing >= history.first_seq:
            return False
        self.seek(history.first_seq)
        return True

    # ---- history ----------------------------------------------------------------------------------------------
    def seek(self, seq: int) -> PoolSnapshot:
        """Show history frame ``seq`` (clamped to what is kept); the feed keeps running. Raises without history."""
        _history, seq = self._kept(seq)
        if not self.cursor.move(seq) and self.viewing != seq:  # the cursor was there, the view not (yet)
            self._seek_now(seq)
        return self.view

    def _follow(self, cursor: StepCursor) -> None:
        """Show the frame the cursor wants: at once, as soon as it is decoded (a run of moves), or the present. A
        frame the history no longer keeps (dropped between the move and now) is the oldest one kept; with no
        history at all, the present."""
        if cursor.seq is None:
            self._go_live_now()
            return
        try:
            _history, seq = self._kept(cursor.seq)
        except LookupError:
            cursor.move(None)
            return
        if seq != cursor.seq:
            cursor.move(seq, cursor.running)
        elif cursor.running:
            self._seek_soon_now(seq)
        else:
            self._seek_now(seq)

    def _seek_now(self, seq: int) -> None:
        self._drop_scrub()
        try:
            snapshot = self.history.snapshot_at(seq)
        except StreamError as exc:  # a frame the reader refuses (corrupt, impossible): said; the view stays
            self.problem.emit(Problem("Frame not shown", f"frame {seq:,} could not be shown: {exc}"))
            return
        self._show(seq, snapshot)

    def _kept(self, seq: int):
        """(the history, ``seq`` clamped to what it keeps); LookupError without history."""
        history = self.history
        if history is None or len(history) == 0:
            raise LookupError(f"this source keeps no history ({self.feed.kind})")
        return history, min(max(int(seq), history.first_seq), history.last_seq)

    def _show(self, seq: int, snapshot: PoolSnapshot) -> None:
        changed = self.cursor.show(seq)
        self.view, self.view_changes = snapshot, NO_CHANGE_RECORD
        if changed:
            self.viewingChanged.emit(seq)
        self.viewChanged.emit(snapshot)

    def seek_soon(self, seq: int) -> None:
        """Show history frame ``seq`` as soon as it is decoded: at once if that is cheap (next to a frame decoded
        before), else on a worker thread while the views keep the frame they have, so that a drag or play keeps
        the window's frame rate; a newer call replaces a wanted frame whose decoding has not begun. ``scrubbing``
        is true until the last one is on view. Raises LookupError without history."""
        _history, seq = self._kept(seq)
        self.cursor.move(seq, running=True)

    def _seek_soon_now(self, seq: int) -> None:
        history = self.history
        if self._scrub_decoding is None:
            try:
                cheap = history.decode_cost(seq) <= SCRUB_ON_GUI_THREAD
            except LookupError:  # dropped meanwhile: seek says so
                cheap = True
            if cheap:
                self._seek_now(seq)
                return
        self._scrub_wanted = seq
        self._decode_next()

    @property
    def scrubbing(self) -> bool:
        """A frame asked for with :meth:`seek_soon` is not on view yet."""
        return self._scrub_wanted is not None or self._scrub_decoding is not None

    def _decode_next(self) -> None:
        if self._scrub_decoding is not None or self._scrub_wanted is None:
            return
        if self._next_decode_at > time.perf_counter():
            return  # rests (SCRUB_PACE_S): the first poll after its time begins it
        seq, self._scrub_wanted = self._scrub_wanted, None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="history-decode")
        moves = self._moves
        # a decode dropped by another move stops at the next frame: the move's own decode does not wait for it
        future = self._worker.submit(_timed, self.history.snapshot_at, seq, lambda: self._moves != moves)
        self._scrub_decoding = future
        # it lands through the watcher the frame timer polls (poll), on the GUI thread
        self.futures.watch(future, lambda out: self._land_scrub(future, seq, out),
                           lambda exc: self._land_scrub(future, seq, error=exc))

    def _land_scrub(self, future: Future, seq: int, out=None, error: BaseException | None = None) -> None:
        if self._scrub_decoding is not future:
            return  # dropped by another move (or a new feed) meanwhile
        self._scrub_decoding = None
        try:
            if isinstance(error, (LookupError, Cancelled)):
                return  # no longer kept (its budget): the next poll follows it
            if error is not None:  # a frame that does not decode: said, and the scrub goes on
                self._scrub_wanted = None if self._scrub_wanted == seq else self._scrub_wanted
                self.problem.emit(Problem("Frame not shown", f"frame {seq:,} could not be decoded: "
                                          f"{type(error).__name__}: {error}"))
                return
            snapshot, began, ended = out
            # rest as long as it took, and until a frame after it began (see SCRUB_PACE_S), from when it ended: it
            # lands at the next frame of the window, which may be most of that rest later
            self._next_decode_at = max(ended + (ended - began), began + SCRUB_PACE_S)
            self._show(seq, snapshot)
        finally:
            self._decode_next()

    def _drop_scrub(self) -> None:
        """Another move: the frames wanted by seek_soon are no longer; a decode under way stops at its next frame
        (its ``stop`` sees the move) and is dropped."""
        self._moves += 1
        self._scrub_wanted = None
        self._scrub_decoding = None

    def go_live(self) -> None:
        """Back to the newest frame."""
        self.cursor.move(None)

    def _go_live_now(self) -> None:
        self._drop_scrub()
        if not self.cursor.show(None):
            return
        self.viewingChanged.emit(None)
        if self.live is not None:
            self.view, self.view_changes = self.live, NO_CHANGE_RECORD
            self.viewChanged.emit(self.live)

    # ---- commands and queries ---------------------------------------------------------------------------------
    def submit(self, name: str, *args: Any, on_result: Callable[[Any], None] | None = None,
               on_error: Callable[[BaseException], None] | None = None, **kwargs: Any) -> Future:
        """Send a command to the feed and watch its answer (errors go to ``on_error`` or become a problem)."""
        try:
            future = self.feed.submit(name, *args, **kwargs)
        except (PermissionError, ValueError) as exc:
            future = done_future(error=exc)
        return self.futures.watch(future, on_result, on_error)

    def inspect_block(self, block_id: int) -> Future:
        """Details of a block of the view being shown: from the feed (K/V included) when live, else rebuilt from
        the viewed frame and the history's stored tokens (no K/V: they are not kept over time)."""
        if self.viewing is None:
            return self.feed.inspect_live(block_id)
        if self.view is None:
            return done_future(error=LookupError("nothing to inspect yet"))
        try:
            return done_future(block_info_from_snapshot(self.view, block_id, self.history, self.viewing,
                                                  self.feed.token_text))
        except (IndexError, ValueError) as exc:
            return done_future(error=exc)

    def _command_refused(self, exc: BaseException) -> None:
        self.problem.emit(Problem("Command refused", str(exc)))

