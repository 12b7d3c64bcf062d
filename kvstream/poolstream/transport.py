"""What the pool stream's publisher and subscriber share on the wire: topics, the heartbeat, errors.

Messages are two-part: ``[b"kvpool.frame", pool-stream message]`` or ``[b"kvpool.heartbeat", msgpack
[magic, format version, stream id, last seq, unix time]]`` (see :mod:`.publisher` for why the protocol has this
shape).
"""
from __future__ import annotations

import itertools
import struct

import msgspec
import zmq

from ..endpoints import EndpointError, stream_spec

FRAME_TOPIC = b"kvpool.frame"  # first part of a frame message
HEARTBEAT_TOPIC = b"kvpool.heartbeat"  # first part of a heartbeat
RESYNC_TOPIC = b"kvpool.resync."  # a subscription to this prefix (plus a nonce) asks for a catch-up
TOPIC_PREFIX = b"kvpool."  # what a subscriber subscribes to
HEARTBEAT_SECONDS = 1.0  # a heartbeat goes out when no frame did for this long
FUTURE_FRAMES = 100_000  # a keyframe of the stream a subscriber follows may be this many frames ahead of it, plus
MAX_FRAME_RATE = 10_000  # this many a second since it last applied one (no source publishes faster); further ahead
# is a frame from the future: applied, it would make every genuine frame after it look "already applied"
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


def _endpoint(spec, bind: bool) -> tuple[str, str | None]:
    """``ENDPOINT[,curve=DIR]`` checked by the one rule (kvstream.endpoints): (endpoint, key directory or None);
    PublishError with its reason otherwise."""
    try:
        return stream_spec(spec, bind=bind)
    except EndpointError as exc:
        raise PublishError(str(exc)) from None


class Closing:
    """A publisher's or subscriber's ``with`` block: it is closed at the end (its thread stopped, its sockets
    closed), however the block ends."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def poller_of(*sockets: zmq.Socket) -> zmq.Poller:
    """A poller that waits for any of ``sockets`` to have a message (a publisher's or subscriber's thread loop)."""
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    return poller


def _zmq_message(exc: zmq.ZMQError, verb: str, endpoint: str) -> str:
    hint = ""
    if exc.errno == zmq.EADDRINUSE:
        hint = ": the address is in use (another publisher?); pick another port"
    elif exc.errno in (zmq.EINVAL, zmq.EPROTONOSUPPORT):
        hint = ": expected tcp://host:port, tcp://*:port or ipc://path"
    return f"cannot {verb} {endpoint} ({exc.strerror}){hint}"
