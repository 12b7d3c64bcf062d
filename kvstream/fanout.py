"""From the runner's published snapshots to pool-stream frames: encode once, hand the same frame to every sink.

The engine runner calls its observers with one :class:`~kvstream.views.PoolUpdate` (the snapshot, its events and
the engine's record of what changed) on the engine thread each time it publishes. The window's History, a
``--record`` file and a ``--publish`` socket all want the same thing, a :class:`kvstream.poolstream.Frame`, so one
:class:`FrameFanout` encodes each update once and writes the frame to each sink. A sink that raises is dropped and reported (:meth:`FrameFanout.take_failures`); the others, and the
engine, go on. Qt-free: headless runs use it too.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Sequence

from kvstream.poolstream import StreamEncoder
from kvstream.views import PoolUpdate


QUEUE_FRAMES = 16  # snapshots a threaded fanout holds before the engine waits for it (a slow disk holds the engine
# back a little rather than the recording falling behind without bound)
_STOP = object()


class FrameFanout:
    """A runner observer: ``fanout(update)`` encodes one frame and writes it to every sink.

    ``first``: a snapshot to encode at once (the runner's newest, when attaching to a runner that is already
    running), so the sinks start with a keyframe of the present and not with whatever frame comes next.

    ``threaded``: encode and write on a thread of the fanout's own, in order, so the engine thread only hands the
    snapshot over (snapshots are immutable). Encoding a large pool's frame is milliseconds of Python; on its own
    thread it overlaps the next step, whose model runs without the GIL (figures: bench/stream.py record,
    docs/gui.md). :meth:`flush` waits for what was handed over; :meth:`stop` ends the
    thread after that, :meth:`close` also closes the sinks.
    """

    def __init__(self, sinks: Sequence[object], *, first=None, keyframe_interval: int = 256,
                 threaded: bool = False):
        self.encoder = StreamEncoder(keyframe_interval=keyframe_interval)  # one encoding for all sinks
        self._sinks = list(sinks)  # objects with write(frame); a failed one is removed
        self._failures: list[str] = []  # why sinks were dropped, taken by the GUI thread
        self._lock = threading.Lock()  # the engine thread writes failures, the GUI thread takes them
        self.frames = 0  # frames encoded
        self.written: tuple[int, object] | None = None  # (seq, snapshot) of the newest frame every sink was given
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False  # stop() was called: no more frames are taken
        self._stop_queued = False  # the thread's stop is in its queue
        if threaded:
            self._queue = queue.Queue(QUEUE_FRAMES)
            self._thread = threading.Thread(target=self._run, name="pool-stream encoder", daemon=True)
            self._thread.start()
        if first is not None:
            self(first, ())

    @property
    def sinks(self) -> list[object]:
        with self._lock:
            return list(self._sinks)

    def __call__(self, update, events=None) -> None:
        """Take one :class:`PoolUpdate`; ``fanout(snapshot, events)``, from a producer that hands snapshots on
        alone, makes an update with no change record (:meth:`PoolUpdate.of`: the encoder compares everything)."""
        if events is not None or not isinstance(update, PoolUpdate):
            update = PoolUpdate.of(update, events or ())
        if self._queue is None:
            self._encode(update)
        elif not self._stopping:
            self._queue.put(update)
        else:
            raise RuntimeError("this fanout was stopped: it takes no more frames")

    def _encode(self, update: PoolUpdate) -> None:
        try:
            frame = self.encoder.encode(update.snapshot, update.events, update.changes, update.seq)
        except Exception as exc:
            if self._queue is None:
                raise  # on the caller's thread: the runner reports it
            with self._lock:  # on the fanout's thread: said like a failing sink's, the next frames are tried
                self._failures.append(f"a frame could not be encoded: {type(exc).__name__}: {exc}")
            return
        self.frames += 1
        for sink in list(self._sinks):
            try:
                sink.write(frame)
            except Exception as exc:  # a full disk or a closed socket stops that output, not the engine
                with self._lock:
                    self._sinks.remove(sink)
                    self._failures.append(f"{_name(sink)} stopped: {type(exc).__name__}: {exc}")
        self.written = (frame.seq, update.snapshot)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):
                    item.set()  # flush(): everything before it is written
                else:
                    self._encode(item)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every frame handed over so far is written (at once when not threaded); False on timeout (a
        sink holding the thread with the queue full counts against the timeout too)."""
        thread = self._thread
        if thread is None:
            return True
        if self._stopping:  # what was handed over is written once the thread ends
            thread.join(timeout)
            return not thread.is_alive()
        deadline = _deadline(timeout)
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(_left(deadline))

    def stop(self, timeout: float | None = 10.0) -> bool:
        """Write what was handed over and end the fanout's thread (the sinks stay open); True once it ended (at
        once if not threaded), False if a sink still holds it after ``timeout`` (call again to wait on)."""
        thread = self._thread
        if thread is None:
            return True
        deadline = _deadline(timeout)
        self._stopping = True  # no more frames are taken
        if not self._stop_queued:
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:  # a sink holds the thread and the queue is full
                return False
            self._stop_queued = True
        thread.join(_left(deadline))
        if thread.is_alive():
            return False
        self._thread = None
        return True

    def take_failures(self) -> list[str]:
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def close(self) -> None:
        """Write what was handed over, then close every sink that can be closed (files, sockets)."""
        self.stop(timeout=None)
        for sink in self._sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    """Seconds to ``deadline`` (None: no limit)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _name(sink) -> str:
    path = getattr(sink, "path", None)
    return f"{type(sink).__name__} ({path})" if path else type(sink).__name__
