"""Publish vLLM-format KV events over ZMQ, as vLLM's ``ZmqEventPublisher`` does, from inside our engine.

A PUB socket sends every batch as ``[topic, 8-byte big-endian seq, payload]``; an optional ROUTER socket answers
replay requests (``[8-byte start seq]``, in a REQ/DEALER envelope) with every buffered batch from that seq on, each
as ``[topic, seq, payload]``, then the end marker ``[b"", -1, b""]``. The buffer is bounded (oldest batches drop
first), so a subscriber that asks for more than it holds sees where its replay starts and knows what it lost.

Unlike vLLM's, ``publish`` encodes and sends on the caller's thread (a few microseconds: PUB never blocks, it drops
at its high-water mark), so the engine knows the sequence number of every batch it hands over. Only the replay
socket has a thread of its own. Each ZMQ socket is used by one thread at a time (the PUB socket under a lock).

The sockets live on a ZMQ context of the publishers' own whose I/O thread is ``SCHED_BATCH`` on Linux: a send wakes
that thread, and at normal policy the wakeup preempted the decoding thread on a busy machine (2 cores, both in
torch), which cost a measurable share of a decode step; as a batch thread it runs when a core frees up or at the
next scheduler tick, without preempting (``bench/kv_events.py --e2e-only``; figures: docs/performance.md, "KV-event
publishing").
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Sequence

import zmq

from kvstream.curve import CurveServer, check_directory, warn_if_open
from kvstream.kv_events.codec import END_SEQ, KVEvent, KVEventError, encode_batch, make_batch, seq_bytes

_CLEAR_NOTE = (" (vLLM's own KV-event consumers cannot speak CURVE: with keys, only this app's watchers can "
               "follow the stream)")


_context: zmq.Context | None = None
_context_lock = threading.Lock()


def _batch_context() -> zmq.Context:
    """A fresh context whose I/O thread is SCHED_BATCH where the OS has that policy (set before any socket: the I/O
    thread starts then)."""
    ctx = zmq.Context()
    if hasattr(os, "SCHED_BATCH") and hasattr(zmq, "THREAD_SCHED_POLICY"):
        ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
    return ctx


def publisher_context() -> zmq.Context:
    """The ZMQ context every publisher's sockets use (made on first use; its I/O thread is SCHED_BATCH where the
    OS has that policy). Never terminated, like ``zmq.Context.instance()``. A publisher with CURVE keys has a
    context of its own (ZMQ runs one authenticator per context)."""
    global _context
    with _context_lock:
        if _context is None:
            _context = _batch_context()
        return _context


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard hosts and ipc/inproc addresses, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """The engine's KV-event publisher: one batch per ``publish`` call, sequence numbers from 0, replay on request.

    Why our own and not vLLM's class: the engine must not depend on vLLM, and the wire (not the class) is the
    contract; the tests hold this one to vLLM's bytes and replay protocol."""

    REPLAY_POLL_MS = 50  # how often the replay thread looks for a close request while no request comes

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_size: int = 10_000, *, data_parallel_rank: int | None = 0, hwm: int = 100_000,
                 bind: bool | None = None, curve: str | None = None) -> None:
        """``curve``: a CURVE key directory (kvstream.curve): both sockets then let in only authorized watchers,
        encrypted. vLLM's own consumers cannot speak CURVE. Bound beyond this machine without it, the publisher
        says once that anyone who can reach the port reads the prompts' tokens."""
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if value is not None and (not isinstance(value, str) or "://" not in value):
                raise KVEventError(f"{name} must be a ZMQ address such as tcp://*:5557, not {value!r}")
        if not isinstance(topic, str):
            raise KVEventError(f"topic must be a string, not {topic!r}")
        for name, value in (("buffer_size", buffer_size), ("hwm", hwm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise KVEventError(f"{name} must be a positive int, not {value!r}")
        make_batch((), 0.0, data_parallel_rank)  # checks the rank
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)  # (seq, payload), oldest first
        self._lock = threading.Lock()  # guards the PUB socket, the buffer and the sequence counter
        self._next_seq = 0
        self._closed = False
        self.num_bad_replay_requests = 0  # replay requests that were not [8-byte seq]; ignored
        self.num_replays = 0  # replay requests answered
        self.num_send_failures = 0  # batches the PUB socket refused (each kept for replay, its seq used)
        self._curve = None
        if curve:
            check_directory(curve, server=True)  # CurveError (a ValueError) before anything is made
            self._curve = CurveServer(curve, _batch_context())
        ctx = self._curve.context if self._curve is not None else publisher_context()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        binds = bind if bind is not None else is_bind_endpoint(endpoint)
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if self._curve is not None:
                self._curve.apply(self._pub)
            if binds:
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # as bound (port resolved)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None  # as bound; None without a replay socket
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * buffer_size + 16)  # a whole replay must fit, never drop
                if self._curve is not None:
                    self._curve.apply(self._replay)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise KVEventError(f"cannot open KV-event sockets ({endpoint}, replay {replay_endpoint}): {exc}") from None
        for given, bound, bound_here in ((endpoint, self.endpoint, binds), (replay_endpoint, self.replay_endpoint,
                                                                            True)):
            if given is not None and bound_here and warn_if_open(given, bound, curve, what="KV events",
                                                                 note=_CLEAR_NOTE):
                break  # one warning says it for both sockets
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kv-event-replay", daemon=True)
            self._thread.start()

    @property
    def next_seq(self) -> int:
        """Sequence number the next batch will get (= batches published so far)."""
        return self._next_seq

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int:
        """Send ``events`` as one batch and keep it for replay; returns its sequence number.

        Bad events raise :class:`KVEventError` and nothing is sent (the sequence number is not used up). A batch
        that is good but cannot be sent (the socket refused it) still takes its sequence number and its place in
        the replay buffer before :class:`KVEventError` says so: watchers then see a gap at the next batch and
        fetch it by replay, instead of missing its blocks without a word."""
        batch = make_batch(events, time.time() if ts is None else ts, self._rank)
        payload = encode_batch(batch)
        with self._lock:
            if self._closed:
                raise KVEventError("the KV-event publisher is closed")
            seq = self._next_seq
            self._next_seq = seq + 1
            self._buffer.append((seq, payload))
            try:
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
            except zmq.ZMQError as exc:
                self.num_send_failures += 1
                raise KVEventError(f"batch {seq} was not sent ({exc}); it keeps its sequence number and waits in "
                                   f"the replay buffer, so watchers see the gap and fetch it by replay") from None
        return seq

    def close(self) -> None:
        """Stop the replay thread and close both sockets; later ``publish`` calls raise. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self._close_sockets()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._curve is not None:  # its context and authenticator go with the sockets
            self._curve.close()
            self._curve = None

    def _serve_replay(self) -> None:
        """Replay thread: answer each request with the buffered batches from its start seq, then the end marker."""
        sock = self._replay
        while not self._closed:
            if not sock.poll(self.REPLAY_POLL_MS):
                continue
            frames = sock.recv_multipart()
            # [identity, b"", seq] from REQ or DEALER-with-delimiter (what vLLM reads); [identity, seq] from a bare
            # DEALER. The reply goes back in the same envelope.
            if len(frames) == 3 and frames[1] == b"" and len(frames[2]) == 8:
                envelope = (frames[0], b"")
            elif len(frames) == 2 and len(frames[1]) == 8:
                envelope = (frames[0],)
            else:
                self.num_bad_replay_requests += 1
                continue
            start = int.from_bytes(frames[-1], "big")
            with self._lock:
                batches = [item for item in self._buffer if item[0] >= start]
            for seq, payload in batches:
                sock.send_multipart(envelope + (self._topic, seq_bytes(seq), payload))
            sock.send_multipart(envelope + (b"", END_SEQ, b""))
            self.num_replays += 1
