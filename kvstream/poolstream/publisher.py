"""The pool stream over the network, the sending side: ``--publish ENDPOINT`` (PoolStreamPublisher), over ZMQ
(the receiving side, ``--attach``, is :mod:`.subscriber`).

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

import threading
import time

import msgspec
import zmq

from ..curve import CurveError, CurveServer, warn_if_open
from .decode import read_head
from .schema import FORMAT_VERSION, MAGIC, Frame, StreamError, check_frame
from .transport import (_META, FRAME_TOPIC, HEARTBEAT_SECONDS, HEARTBEAT_TOPIC, Heartbeat, PublishError, _endpoint,
                        _inproc_ids, _zmq_message, Closing, poller_of)


class PoolStreamPublisher(Closing):
    """A sink that publishes every frame on ``endpoint`` (bound), with catch-up for late subscribers.

    ``write`` never blocks: if the publisher thread falls 10,000 messages behind, frames are dropped and counted
    (subscribers see the gap and resync)."""

    def __init__(self, endpoint: str, *, heartbeat_seconds: float = HEARTBEAT_SECONDS,
                 context: zmq.Context | None = None, curve: str | None = None):
        self.endpoint, spec_curve = _endpoint(endpoint, bind=True)  # as given ("tcp://*:5560"), without options
        self.curve = curve or spec_curve  # CURVE key directory (kvstream.curve): only authorized watchers get in
        self._curve = None
        if self.curve:
            try:
                self._curve = CurveServer(self.curve)
            except CurveError as exc:
                raise PublishError(str(exc)) from None
            context = self._curve.context  # its authenticator is per context
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
        if self._curve is not None:
            self._curve.apply(self._xpub)
        try:
            self._xpub.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._xpub.close(0)
            if self._curve is not None:
                self._curve.close()
            raise PublishError(_zmq_message(exc, "publish on", self.endpoint)) from None
        self.bound = self._xpub.getsockopt_string(zmq.LAST_ENDPOINT)  # the endpoint actually bound (port chosen)
        warn_if_open(self.endpoint, self.bound, self.curve)
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

    def write(self, frame: Frame) -> None:
        check_frame(frame, "a publisher sends")
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
        if self._curve is not None and not self._thread.is_alive():  # its sockets are closed: the context may end
            self._curve.close()

    # ---- publisher thread -----------------------------------------------------------------------------------
    def _loop(self) -> None:
        xpub, pull = self._xpub, self._pull
        poller = poller_of(xpub, pull)
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
