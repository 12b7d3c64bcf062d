"""The project's own pool stream: a pool over time as keyframes and per-frame deltas, in msgspec msgpack.

Why a stream of its own: the explorer watches pools it does not own (another process's engine, a vLLM server
through the plugin, a recording), and every one of them needs the same thing, the exact :class:`PoolSnapshot` the
source had after each change, cheaply enough to send after every step of a 65,536-block pool. A keyframe carries
the whole state; a delta carries only what changed since the frame before it (changed indices and values of the
per-block arrays, changed block tables, changed conversations with their token tuples and texts sent as
"drop this many from the end, then append this tail"), so a decode step costs O(new tokens), not O(pool).

One message is a msgpack array, the **envelope**::

    ["kvpool", FORMAT_VERSION, stream_id, seq, step_id, keyframe, events, body]

``body`` is a map tagged by ``"kind"``: ``"keyframe"`` (:class:`Keyframe`) or ``"delta"`` (:class:`Delta`).
``docs/poolstream.md`` documents every field for people who read recordings from their own scripts.

numpy + msgspec only (no torch, no Qt): the recorder, the ZMQ publisher, the GUI and the vLLM plugin share it.
Nothing is ever pickled; decoding validates every field and raises :class:`StreamError` with a message a user can
act on, leaving the decoder as it was.

The rooms: :mod:`.schema` (the wire structs, :class:`Frame`, :class:`StreamError`), :mod:`.encode`
(:class:`StreamEncoder`), :mod:`.decode` (:class:`StreamDecoder`, :func:`read_head`), :mod:`.publisher` and
:mod:`.subscriber` (``--publish`` / ``--attach`` over ZMQ). The in-memory history is :mod:`kvstream.history`.
"""
from __future__ import annotations

from .decode import StreamDecoder, frame_from_payload, frame_of, read_head
from .encode import StreamEncoder, encode_keyframe
from .schema import (ARRAYS, FORMAT_VERSION, MAGIC, ArrayPatch, Body, ConvPatch, Count, Delta, Frame, FrameHead, Grown,
                     Header, Keyframe, Numbers, Packed, SeqPatch, StreamError, TablePatch, TextPatch, check_frame)

__all__ = ["FORMAT_VERSION", "MAGIC", "StreamError", "Frame", "FrameHead", "Header", "Keyframe", "Delta",
           "StreamEncoder", "StreamDecoder", "read_head", "frame_from_payload", "frame_of", "encode_keyframe",
           "check_frame"]
