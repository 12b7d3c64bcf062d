"""The pool stream over the network, the receiving side: ``--attach ENDPOINT`` (PoolStreamSubscriber), over ZMQ.

Why this shape (see :mod:`.publisher` for the other side): a subscriber may join at any time and must see the pool
at once, and a dropped message or a restarted source must be recovered by itself. One that sees a gap (a dropped
message, a heartbeat ahead of it) subscribes to a fresh ``resync`` topic, which asks the publisher for its last
keyframe and the deltas since; until they come it keeps the last good state. Heartbeats tell an idle source from a
silent one; ZMQ reconnects by itself, and the subscriber reports what it sees.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..curve import CurveError, apply_client
from ..history import History
from ..views import PoolSnapshot
from .decode import StreamDecoder, frame_of, read_head
from .schema import MAGIC, StreamError
from .transport import (_HEARTBEAT_DECODER, FRAME_TOPIC, FUTURE_FRAMES, HEARTBEAT_TOPIC, MAX_FRAME_RATE, RESYNC_TOPIC,
                        SILENT_SECONDS, TOPIC_PREFIX, PublishError, _endpoint, _zmq_message, Closing, poller_of)


@dataclass(frozen=True)
class SubscriberStatus:
    """How an attached pool is doing, for the window's status line and ``--json``."""

    state: str  # "connecting" | "waiting" (connected, no keyframe yet) | "live" | "silent" | "closed"
    text: str  # the same in words, with counts ("live at frame 812", "silent for 12 s", ...)
    endpoint: str  # what it connects to
    connected: bool  # the transport is connected (ZMQ's monitor says so)
    frames: int  # frames applied
    malformed: int  # messages that could not be used and were skipped
    gaps: int  # times frames went missing (each followed by a resync)
    resyncs: int  # catch-ups asked for
    restarts: int  # times the source began a new stream (its history starts again)
    last_seq: int | None  # seq of the newest frame applied
    silent_seconds: float | None  # seconds since the last message of any kind (None before the first)
    last_error: str  # the latest problem in words ("" if none)
    lost: int = 0  # frames of the stream never applied (missed in gaps and not caught up)


class PoolStreamSubscriber(Closing):
    """Reads a pool stream from ``endpoint`` on its own thread into ``history`` and keeps the newest snapshot.

    Never raises from its thread and never stops: a message that cannot be used for any reason (malformed, a pool
    that cannot exist, an error while handling it) is counted as malformed, its reason kept as ``last_error``, and
    skipped; gaps trigger a resync; a frame from the future (a keyframe of this stream further ahead than the source
    can have got, or a state ahead of what the source's heartbeat says it sent) is refused or dropped, and the
    subscriber resyncs from the next keyframe instead of waiting for frames that will never be newer; a restarted
    source (a new stream id) starts the history again; ZMQ reconnects by itself."""

    def __init__(self, endpoint: str, history: History | None = None, *, silent_seconds: float = SILENT_SECONDS,
                 context: zmq.Context | None = None, curve: str | None = None):
        self.endpoint, spec_curve = _endpoint(endpoint, bind=False)
        self.curve = curve or spec_curve  # CURVE key directory (kvstream.curve): the watcher's key pair
        self.history = History() if history is None else history  # every frame applied goes here
        self.silent_seconds = silent_seconds
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 10000)
        if self.curve:
            try:
                apply_client(self._sub, self.curve)
            except CurveError as exc:
                self._sub.close(0)
                raise PublishError(str(exc)) from None
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        try:
            self._sub.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._monitor.close(0)
            self._sub.close(0)
            raise PublishError(_zmq_message(exc, "attach to", self.endpoint)) from None
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
        self._decoder = StreamDecoder()
        self._lock = threading.Lock()  # guards the decoder and the counters against readers
        self._frames = self._malformed = self._gaps = self._resyncs = self._restarts = self._lost = 0
        self._applied_at = 0.0  # monotonic time the last frame was applied
        self._connected = False
        self._last_message: float | None = None  # monotonic time of the last message
        self._last_resync = 0.0
        self._waiting_resync = False
        self._last_error = ""
        self._nonce = itertools.count()
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"attach {self.endpoint}", daemon=True)
        self._thread.start()

    # ---- readers (any thread) -------------------------------------------------------------------------------
    def latest(self) -> PoolSnapshot | None:
        """The newest snapshot (None before the first keyframe)."""
        with self._lock:
            return None if self._decoder.seq is None else self._decoder.snapshot()

    @property
    def status(self) -> SubscriberStatus:
        with self._lock:
            seq = self._decoder.seq
            silent = None if self._last_message is None else time.monotonic() - self._last_message
            if self._closed:
                state, text = "closed", f"detached from {self.endpoint}"
            elif silent is not None and silent >= self.silent_seconds:
                state = "silent"
                text = f"silent for {silent:.0f} s" + ("" if self._connected else f"; reconnecting to {self.endpoint}")
            elif seq is None:
                if self._connected:
                    state, text = "waiting", f"connected to {self.endpoint}, waiting for the first keyframe"
                else:
                    state, text = "connecting", f"connecting to {self.endpoint}"
            elif self._waiting_resync:
                state, text = "live", f"frames went missing after frame {seq}; catching up"
            else:
                state, text = "live", f"live at frame {seq}"
            if self._malformed:
                text += f" ({self._malformed} malformed message{'s' if self._malformed != 1 else ''} skipped"
                text += f"; last: {self._last_error[:80]})" if self._last_error else ")"
            return SubscriberStatus(state, text, self.endpoint, self._connected, self._frames, self._malformed,
                                    self._gaps, self._resyncs, self._restarts, seq, silent, self._last_error,
                                    self._lost)

    def close(self, timeout: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)

    # ---- subscriber thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        sub, monitor = self._sub, self._monitor
        poller = poller_of(sub, monitor)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout=100))
                if monitor in ready:
                    self._on_monitor()
                if sub in ready:
                    for _ in range(1000):  # drain, but look at the stop flag now and then
                        try:
                            parts = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._on_message(parts)
                        except Exception as exc:  # whatever a message does, the watcher goes on (and says so)
                            self._bad(f"{type(exc).__name__} while reading a message: {exc}")
                if self._waiting_resync and time.monotonic() - self._last_resync > 1.0:
                    self._resync()  # the catch-up did not come (or was lost): ask again
        finally:
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    def _on_monitor(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._lock:
                if event["event"] == zmq.EVENT_CONNECTED:
                    self._connected = True
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._connected = False

    def _bad(self, why: str) -> None:
        with self._lock:
            self._malformed += 1
            self._last_error = why

    def _resync(self) -> None:
        """Ask the publisher for its last keyframe and the deltas since (a fresh subscription does that)."""
        topic = RESYNC_TOPIC + str(next(self._nonce)).encode()
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.setsockopt(zmq.UNSUBSCRIBE, topic)
        with self._lock:
            self._resyncs += 1
            self._waiting_resync = True
        self._last_resync = time.monotonic()

    def _on_message(self, parts: list[bytes]) -> None:
        with self._lock:
            self._last_message = time.monotonic()
        if len(parts) != 2:
            self._bad(f"a message of {len(parts)} parts (a pool stream message has 2)")
            return
        topic, payload = parts
        if topic == HEARTBEAT_TOPIC:
            self._on_heartbeat(payload)
        elif topic == FRAME_TOPIC:
            self._on_frame(payload)
        else:
            self._bad(f"a message with topic {topic[:40]!r}")

    def _on_heartbeat(self, payload: bytes) -> None:
        try:
            beat = _HEARTBEAT_DECODER.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._bad(f"a malformed heartbeat ({exc})")
            return
        if beat.magic != MAGIC:
            self._bad("a heartbeat of another protocol")
            return
        seq, stream = self._decoder.seq, self._decoder.stream_id
        if seq is not None and stream == beat.stream_id and seq > beat.last_seq >= 0:
            # the state is ahead of what the source says it sent: a frame from the future was applied (forged or
            # damaged); drop it and start again from the source's next keyframe
            with self._lock:
                self._decoder = StreamDecoder()
                self._last_error = (f"the view was at frame {seq}, ahead of the source's frame {beat.last_seq}: "
                                    "dropped it, resyncing")
                self._malformed += 1
            seq = None
        behind = beat.last_seq >= 0 and (seq is None or stream != beat.stream_id or beat.last_seq > seq)
        if behind and not self._waiting_resync:
            if seq is not None and stream == beat.stream_id:
                with self._lock:
                    self._gaps += 1
            self._resync()

    def _on_frame(self, payload: bytes) -> None:
        try:
            head = read_head(payload)
        except StreamError as exc:
            self._bad(str(exc))
            return
        decoder = self._decoder
        same = decoder.stream_id == head.stream_id
        if same and head.seq <= decoder.seq:
            return  # a catch-up sent for another subscriber (or a repeat): already applied
        if same and head.seq > decoder.seq + FUTURE_FRAMES + MAX_FRAME_RATE * (time.monotonic() - self._applied_at):
            self._bad(f"frame {head.seq} of this stream is further ahead of frame {decoder.seq} than the source can "
                      "have got: refused (a frame from the future)")
            return
        if not head.keyframe and (not same or head.seq != decoder.seq + 1):
            if not self._waiting_resync:  # the first frame after the gap; the loop asks again every second
                if decoder.seq is not None and same:
                    with self._lock:
                        self._gaps += 1
                self._resync()
            return
        restarted = head.keyframe and not same and decoder.stream_id is not None
        try:
            with self._lock:
                before = decoder.seq if same else None
                decoder.apply(head)
                decoder.snapshot()  # checked here, on this thread: a pool that cannot exist is never shown
                self._frames += 1
                self._applied_at = time.monotonic()
                if before is not None and head.seq > before + 1:
                    self._lost += head.seq - before - 1
                self._waiting_resync = False  # in step again (a keyframe, or the catch-up's missing deltas)
                if restarted:
                    self._restarts += 1
        except StreamError as exc:
            self._bad(str(exc))
            if decoder.seq is None and not self._waiting_resync:  # the decoder waits for a keyframe: ask for one
                self._resync()  # (once; the loop asks again every second until one comes)
            return
        frame = frame_of(head, payload)
        try:
            if restarted:
                self.history.clear()
            self.history.write(frame)
        except StreamError as exc:  # e.g. the frame is older than what the history keeps: start it again
            self.history.clear()
            if head.keyframe:
                self.history.write(frame)
            with self._lock:
                self._last_error = f"history restarted: {exc}"
