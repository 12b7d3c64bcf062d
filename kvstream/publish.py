"""The pool stream over the network: ``--publish ENDPOINT`` (PoolStreamPublisher) and ``--attach ENDPOINT``
(PoolStreamSubscriber), over ZMQ.

Why this shape: the engine thread must never wait for the network, a subscriber may join at any time and must see
the pool at once (not after the next keyframe, which may be minutes away at 10 steps/s), and a slow or restarted
peer must recover by itself.

- The publisher's XPUB socket sees every subscription (XPUB_VERBOSE). When one arrives it sends the last keyframe
  and every delta since (its catch-up buffer, at most one keyframe interval) to all subscribers; those that have
  them already skip them by seq. So a late subscriber gets a keyframe first, from the same single endpoint.
- A subscriber that sees a gap (a dropped message, a heartbeat ahead of it) subscribes to a fresh ``resync`` topic,
  which asks for the same catch-up; until it comes it keeps the last good state.
- When no frame went out for a second, the publisher sends a heartbeat (stream id, last seq), so a subscriber tells
  an idle source from a silent one. ZMQ reconnects by itself; the subscriber reports what it sees.

Messages are two-part: ``[b"kvpool.frame", pool-stream message]`` or ``[b"kvpool.heartbeat", msgpack
[magic, format version, stream id, last seq, unix time]]``. The engine thread hands frames to the publisher's own
thread through an inproc socket without blocking; the publisher thread owns the network socket.
"""
from __future__ import annotations

import itertools
import struct
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .history import History
from .poolstream import FORMAT_VERSION, MAGIC, Frame, StreamDecoder, StreamError, frame_of, read_head
from .views import PoolSnapshot

FRAME_TOPIC = b"kvpool.frame"  # first part of a frame message
HEARTBEAT_TOPIC = b"kvpool.heartbeat"  # first part of a heartbeat
RESYNC_TOPIC = b"kvpool.resync."  # a subscription to this prefix (plus a nonce) asks for a catch-up
TOPIC_PREFIX = b"kvpool."  # what a subscriber subscribes to
HEARTBEAT_SECONDS = 1.0  # a heartbeat goes out when no frame did for this long
SILENT_SECONDS = 3.0  # a subscriber that heard nothing for this long says the source is silent
_META = struct.Struct("<qB")  # seq, keyframe: what the publisher thread needs to keep its catch-up buffer
_inproc_ids = itertools.count()


class PublishError(ValueError):
    """An endpoint that cannot be bound or connected (malformed, in use, unsupported transport)."""


class Heartbeat(msgspec.Struct, array_like=True, frozen=True):
    """What a publisher says when it has nothing new: which stream it is and how far it got."""

    magic: str  # MAGIC
    format_version: int
    stream_id: int  # of the frames it publishes (0 before the first)
    last_seq: int  # seq of the last frame it sent (-1 before the first)
    time: float  # its Unix time


_HEARTBEAT_DECODER = msgspec.msgpack.Decoder(Heartbeat)


def _endpoint(endpoint) -> str:
    if not isinstance(endpoint, str) or "://" not in endpoint:
        raise PublishError(f"an endpoint looks like tcp://host:5560 or ipc:///tmp/pool.sock, not {endpoint!r}")
    return endpoint


def _zmq_message(exc: zmq.ZMQError, verb: str, endpoint: str) -> str:
    hint = ""
    if exc.errno == zmq.EADDRINUSE:
        hint = ": the address is in use (another publisher?); pick another port"
    elif exc.errno in (zmq.EINVAL, zmq.EPROTONOSUPPORT):
        hint = ": expected tcp://host:port, tcp://*:port or ipc://path"
    return f"cannot {verb} {endpoint} ({exc.strerror}){hint}"


# ---- publisher ---------------------------------------------------------------------------------------------------
class PoolStreamPublisher:
    """A sink that publishes every frame on ``endpoint`` (bound), with catch-up for late subscribers.

    ``write`` never blocks: if the publisher thread falls 10,000 messages behind, frames are dropped and counted
    (subscribers see the gap and resync)."""

    def __init__(self, endpoint: str, *, start: Frame | None = None, heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 context: zmq.Context | None = None):
        self.endpoint = _endpoint(endpoint)  # as given ("tcp://*:5560")
        self.heartbeat_seconds = heartbeat_seconds
        self.frames_written = 0  # frames handed to the publisher thread
        self.frames_dropped = 0  # frames dropped because the publisher thread was too far behind
        self.catch_ups = 0  # catch-ups sent (one per subscription or resync request)
        self.subscriptions = 0  # subscriptions seen
        self._ctx = context or zmq.Context.instance()
        self._xpub = self._ctx.socket(zmq.XPUB)
        self._xpub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._xpub.setsockopt(zmq.LINGER, 0)
        self._xpub.setsockopt(zmq.SNDHWM, 10000)
        try:
            self._xpub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._xpub.close(0)
            raise PublishError(_zmq_message(exc, "publish on", self.endpoint)) from None
        self.bound = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)  # the endpoint actually bound (port chosen)
        name = f"inproc://kvpool-publisher-{next(_inproc_ids)}"
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(name)
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 10000)
        self._push.connect(name)
        self._lock = threading.Lock()  # the push socket is used by whichever thread writes
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"publish {self.endpoint}", daemon=True)
        self._thread.start()
        if start is not None:
            self.write(start)

    def write(self, frame: Frame) -> None:
        if not isinstance(frame, Frame):
            raise TypeError(f"a publisher sends Frames, not {type(frame).__name__}")
        with self._lock:
            if self._closed:
                raise PublishError(f"the publisher on {self.endpoint} is closed")
            try:
                self._push.send_multipart([_META.pack(frame.seq, frame.keyframe), frame.payload],
                                          flags=zmq.NOBLOCK, copy=False)
                self.frames_written += 1
            except zmq.Again:
                self.frames_dropped += 1

    def close(self, timeout: float = 1.0) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(timeout)
        self._push.close(0)

    def __enter__(self) -> "PoolStreamPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- publisher thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        xpub, pull = self._xpub, self._pull
        poller = zmq.Poller()
        poller.register(xpub, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        buffer: list[bytes] = []  # the last keyframe and the deltas after it (empty: no usable keyframe yet)
        last_seq, stream_id, last_sent = -1, 0, time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout=min(100, int(self.heartbeat_seconds * 1000))))
                catch_up = False
                if xpub in ready:
                    while True:
                        try:
                            msg = xpub.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if msg[:1] == b"\x01":  # a subscription (new subscriber or resync request)
                            self.subscriptions += 1
                            catch_up = True
                if pull in ready:
                    while True:
                        try:
                            meta, payload = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        seq, key = _META.unpack(meta.bytes)
                        data = payload.bytes
                        if key:
                            buffer = [data]
                            try:
                                stream_id = read_head(data).stream_id
                            except StreamError:
                                buffer = []
                        elif buffer and seq == last_seq + 1:
                            buffer.append(data)
                        else:
                            buffer = []  # a hole (dropped frame): no catch-up until the next keyframe
                        last_seq = seq
                        xpub.send_multipart([FRAME_TOPIC, data], copy=False)
                        last_sent = time.monotonic()
                if catch_up and buffer:
                    for data in buffer:
                        xpub.send_multipart([FRAME_TOPIC, data], copy=False)
                    self.catch_ups += 1
                    last_sent = time.monotonic()
                if time.monotonic() - last_sent >= self.heartbeat_seconds:
                    beat = msgspec.msgpack.encode(Heartbeat(MAGIC, FORMAT_VERSION, stream_id, last_seq, time.time()))
                    xpub.send_multipart([HEARTBEAT_TOPIC, beat])
                    last_sent = time.monotonic()
        finally:
            xpub.close(0)
            pull.close(0)


# ---- subscriber --------------------------------------------------------------------------------------------------
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


class PoolStreamSubscriber:
    """Reads a pool stream from ``endpoint`` on its own thread into ``history`` and keeps the newest snapshot.

    Never raises from its thread: malformed messages are counted and skipped, gaps trigger a resync, a restarted
    source (a new stream id) starts the history again, and ZMQ reconnects by itself."""

    def __init__(self, endpoint: str, history: History | None = None, *, silent_seconds: float = SILENT_SECONDS,
                 context: zmq.Context | None = None):
        self.endpoint = _endpoint(endpoint)
        self.history = History() if history is None else history  # every frame applied goes here
        self.silent_seconds = silent_seconds
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, 10000)
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
        self._frames = self._malformed = self._gaps = self._resyncs = self._restarts = 0
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
                text += f" ({self._malformed} malformed message{'s' if self._malformed != 1 else ''} skipped)"
            return SubscriberStatus(state, text, self.endpoint, self._connected, self._frames, self._malformed,
                                    self._gaps, self._resyncs, self._restarts, seq, silent, self._last_error)

    def close(self, timeout: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> "PoolStreamSubscriber":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- subscriber thread ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        sub, monitor = self._sub, self._monitor
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
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
                        self._on_message(parts)
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
                decoder.apply(head)
                self._frames += 1
                self._waiting_resync = False  # in step again (a keyframe, or the catch-up's missing deltas)
                if restarted:
                    self._restarts += 1
        except StreamError as exc:
            self._bad(str(exc))
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
