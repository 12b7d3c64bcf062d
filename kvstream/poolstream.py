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
"""
from __future__ import annotations

import dataclasses
import itertools
import operator
import os
import sys
import typing
from types import MappingProxyType
from typing import Annotated, Any, Mapping, Sequence

import msgspec
import numpy as np
from msgspec import UNSET, Raw, UnsetType

from .events import BlockEvent
from .views import BLOCK_ARRAYS, ConversationInfo, EngineMetrics, FinishReason, MemoryStats, PoolSnapshot, Status

FORMAT_VERSION = 1  # bumped whenever a reader of the previous version could misread a message
MAGIC = "kvpool"  # first element of every message: what tells a pool-stream message from any other msgpack
ARRAYS = BLOCK_ARRAYS  # the per-block arrays, in wire order
_BLANK = {"owner": -1}  # value of each per-block array in an empty pool (0 where not listed): keyframes send the rest
# dtypes a per-block array, or its values on the wire, may have (little-endian; a foreign dtype is never built)
_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8"})
_DTYPE_OK: dict[np.dtype, bool] = {}  # dtype -> in _DTYPES (the check costs 3 us, six times a frame)
_NARROW_RANGES = tuple((np.dtype(d), int(np.iinfo(d).min), int(np.iinfo(d).max))  # smallest first: (dtype, min, max)
                       for d in ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8"))


Count = Annotated[int, msgspec.Meta(ge=0)]  # a count: negative ones are malformed


def _gc_untrack():
    """CPython's ``PyObject_GC_UnTrack`` (None on another implementation): see :func:`_ints`."""
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes
        untrack = ctypes.pythonapi.PyObject_GC_UnTrack  # a PyDLL function: called with the GIL held
    except (ImportError, AttributeError, OSError):
        return None
    untrack.argtypes, untrack.restype = [ctypes.py_object], None
    return untrack


_UNTRACK = _gc_untrack()
_UNTRACK_FROM = 16  # shorter tuples are left to the collector (at 64: 1.1 ms a jump instead of 1.7, collection 17 ms)


def _ints(values) -> tuple:
    """``tuple(values)`` (token or block ids: ints only), left out of the cycle collector's young generation.

    The collector tracks every new tuple and lets one of ints go only after walking it once in a collection. A
    history's checkpoints and rebuilt snapshots hold hundreds of thousands of such ids (65,536 blocks, 256
    conversations: 2.4 million after 8 jumps), so the young collection that met them took 50-60 ms, inside one
    jump. CPython untracks such tuples itself (they cannot be part of a cycle); this does it when they are made,
    for 0.2-0.6 us a tuple, on tuples of at least _UNTRACK_FROM ids (in a jump to a run's end, 3,496 of the 4,668
    tuples made, holding 99% of their ids; the jump costs about 1.7 ms more, and the young collection after 8 jumps
    takes 5.9 ms). Only ever given ints: a tuple holding a container would then escape cycle collection."""
    out = tuple(values)
    if len(out) >= _UNTRACK_FROM and _UNTRACK is not None:
        _UNTRACK(out)
    return out


class StreamError(ValueError):
    """A pool-stream message that cannot be used: malformed, foreign, from a newer format, or out of order.

    The decoder that raised it is exactly as it was before the message."""


# ---- wire structs ------------------------------------------------------------------------------------------------
class Packed(msgspec.Struct, array_like=True, frozen=True):
    """A numpy integer array as raw little-endian bytes, in the narrowest dtype that holds its values."""

    dtype: str  # numpy dtype string of ``data``: "|u1", "<i2", "<u8", ...
    data: bytes  # the values, back to back


class ArrayPatch(msgspec.Struct, array_like=True, frozen=True):
    """New values of some entries of one per-block array."""

    gaps: Packed | None  # indices, ascending, as gaps (first index, then index - previous - 1); None: every index
    values: Packed | int  # the new value of each index, or one value for all of them


class Header(msgspec.Struct, frozen=True):
    """What a pool is: sent in every keyframe (a subscriber may start at any of them) and in a recording's header."""

    source: str  # what produced the stream: "engine", "vllm", ...
    num_blocks: int  # length of every per-block array
    block_size: int  # token slots per block
    model_name: str  # "builtin", a checkpoint directory or a served model name
    device: str  # where the KV cache lives: "cpu", "cuda:0", ...
    max_model_len: int  # most tokens in one conversation; 0: unknown
    dtypes: dict[str, str]  # numpy dtype of each per-block array (block_hash absent: the source sends no hashes)


class TablePatch(msgspec.Struct, array_like=True, frozen=True):
    """One conversation's block table: drop ``drop`` ids from the end of the previous one, then append ``tail``."""

    conversation_id: int
    drop: Count  # ids removed from the end of the table the previous frame had (0 for a new table)
    tail: tuple[int, ...]  # physical block ids appended after the drop


SeqPatch = tuple[Count, tuple[int, ...]]  # (items dropped from the end, items appended): token ids, block ids
TextPatch = tuple[Count, str]  # (code points dropped from the end, text appended)
_SHORT = {  # wire key of each ConversationInfo field in a ConvPatch (one letter: 256 patches in a busy frame)
    "conversation_id": "i", "status": "s", "prompt_token_ids": "p", "output_token_ids": "o", "output_text": "x",
    "prompt_text": "q", "block_table": "b", "num_computed_tokens": "n", "num_cached_tokens": "c",
    "max_new_tokens": "m", "temperature": "t", "parent_id": "a", "num_preemptions": "r", "arrival_step": "w",
    "finish_reason": "f", "turns": "u", "label": "l", "group_block_tables": "g",
}


class ConvPatch(msgspec.Struct, frozen=True, omit_defaults=True, rename=_SHORT):
    """The fields of one conversation that changed (all of them for a new one); absent fields are unchanged.

    Field names and order are exactly ConversationInfo's; token tuples and texts are (drop, tail) patches."""

    conversation_id: int
    status: Status | UnsetType = UNSET
    prompt_token_ids: SeqPatch | UnsetType = UNSET
    output_token_ids: SeqPatch | UnsetType = UNSET
    output_text: TextPatch | UnsetType = UNSET
    prompt_text: TextPatch | UnsetType = UNSET
    block_table: SeqPatch | UnsetType = UNSET
    num_computed_tokens: int | UnsetType = UNSET
    num_cached_tokens: int | UnsetType = UNSET
    max_new_tokens: int | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    parent_id: int | None | UnsetType = UNSET
    num_preemptions: int | UnsetType = UNSET
    arrival_step: int | UnsetType = UNSET
    finish_reason: FinishReason | None | UnsetType = UNSET
    turns: tuple[tuple[int, int], ...] | UnsetType = UNSET
    label: str | UnsetType = UNSET
    group_block_tables: tuple[tuple[int, ...], ...] | UnsetType = UNSET


Numbers = dict[str, int | float]  # changed fields of EngineMetrics / MemoryStats by name


class Grown(msgspec.Struct, array_like=True, frozen=True):
    """Conversations that only grew since the frame before, the common case of a decode step, as columns: output
    tokens, output text and block ids appended, num_computed_tokens set; nothing else changed. Entry j of every
    column belongs to conversation ids[j]."""

    ids: Packed  # conversation ids
    token_counts: Packed | int  # output tokens appended to each (one number: the same for all)
    tokens: Packed  # the appended output tokens, back to back
    texts: list[str]  # output text appended to each
    computed: Packed | int  # new num_computed_tokens of each
    block_counts: Packed | int  # block ids appended to each one's block_table
    blocks: Packed  # those block ids, back to back


class Keyframe(msgspec.Struct, frozen=True, tag_field="kind", tag="keyframe"):
    """The whole state: a decoder needs nothing before it."""

    header: Header
    version: int  # the snapshot's version
    arrays: dict[str, ArrayPatch]  # each per-block array as a patch of the blank pool (owner -1, the rest 0)
    tables: list[TablePatch]  # every block table (drop 0), in the snapshot's order
    conversations: list[ConvPatch]  # every conversation with every field, in the snapshot's order
    metrics: Numbers  # every EngineMetrics field
    memory: Numbers | None  # every MemoryStats field; None when the source has none


class Delta(msgspec.Struct, frozen=True, omit_defaults=True, tag_field="kind", tag="delta"):
    """What changed since the frame before (``seq - 1`` of the same stream)."""

    version: int  # the snapshot's version
    arrays: dict[str, ArrayPatch] = {}  # changed entries of the per-block arrays that changed
    tables: list[TablePatch] = []  # block tables that changed or appeared
    tables_removed: list[int] = []  # conversations that no longer hold blocks
    tables_order: list[int] | None = None  # the table order, when it is not (kept ones, then new ones)
    conversations: list[ConvPatch] = []  # conversations that changed or entered the snapshot (but the grown ones)
    grown: Grown | None = None  # conversations that only grew (a decode step), as columns
    conversations_dropped: list[int] = []  # conversations that left the snapshot (its finished window)
    conversations_order: list[int] | None = None  # the order, when it is not (kept ones, then new ones)
    metrics: Numbers | None = None  # EngineMetrics fields that changed
    memory: Numbers | None | UnsetType = UNSET  # MemoryStats fields that changed; None: the source has none now


Body = Keyframe | Delta


class _Envelope(msgspec.Struct, array_like=True, frozen=True):
    """One message as encoded (the body as its struct)."""

    magic: str
    format_version: int
    stream_id: int
    seq: int
    step_id: int
    keyframe: bool
    events: tuple[BlockEvent, ...]
    body: Body


class _BridgedEnvelope(_Envelope, array_like=True, frozen=True):
    """A periodic keyframe as encoded, with its bridge: the delta from frame seq - 1 to the same state, so that a
    decoder moving forward applies a delta instead of rebuilding everything (a keyframe of 65,536 blocks and 1,700
    conversations took 20-30 ms to decode, the bridge 0.3 ms). Readers that predate bridges stop at ``body``."""

    bridge: Delta


_NO_BRIDGE = Raw(b"")  # what a message without a bridge decodes to (an empty Raw)


class _RawEnvelope(msgspec.Struct, array_like=True, frozen=True):
    """One message as decoded: everything but the body, which is decoded only when the state is needed."""

    magic: str
    format_version: int
    stream_id: int
    seq: int
    step_id: int
    keyframe: bool
    events: tuple[BlockEvent, ...]
    body: Raw
    bridge: Raw = _NO_BRIDGE  # a keyframe's delta from the frame before (empty: none)


class _RawEnvelopeNoEvents(msgspec.Struct, array_like=True, frozen=True):
    """The same, leaving the events undecoded too (a history already has them)."""

    magic: str
    format_version: int
    stream_id: int
    seq: int
    step_id: int
    keyframe: bool
    events: Raw
    body: Raw
    bridge: Raw = _NO_BRIDGE


class _Version(msgspec.Struct, array_like=True):
    """The first two envelope elements, read before anything else so that a newer format is told as such."""

    magic: Any
    format_version: Any


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.integer):  # a source that hands numpy scalars (token ids from a tensor)
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"{type(obj).__name__} objects cannot go into a pool stream")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_MAGIC_BYTES = msgspec.msgpack.encode(MAGIC)  # how every message goes on after its array header
_VERSION_DECODER = msgspec.msgpack.Decoder(_Version)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_RawEnvelope)
_ENVELOPE_NO_EVENTS_DECODER = msgspec.msgpack.Decoder(_RawEnvelopeNoEvents)
_BODY_DECODER = msgspec.msgpack.Decoder(Body)


class Frame(msgspec.Struct, frozen=True, gc=False):  # gc=False: bytes and events only, never in a cycle
    """One published state of a pool: what files and sockets carry (``payload``) plus what the history indexes.

    Encoded once by the runner's StreamEncoder; every sink (History, Recorder, publisher) gets the same object."""

    seq: int  # frame number within its stream, from 0; deltas follow the frame seq - 1
    step_id: int  # engine step the state was taken after (several frames may share one)
    keyframe: bool  # True: payload holds the whole state
    payload: bytes  # the encoded message
    events: tuple[BlockEvent, ...] = ()  # block events since the previous frame, oldest first
    stream_id: int = 0  # random id of the encoder that made it (a restarted source starts a new stream)
    bridged: bool = False  # a keyframe whose payload carries a bridge from frame seq - 1 (History resumes through it)

    @property
    def nbytes(self) -> int:
        return len(self.payload)


class FrameHead(msgspec.Struct, frozen=True, gc=False):
    """A message's envelope without its body (cheap: what a reader needs to index a frame or skip a duplicate)."""

    stream_id: int
    seq: int
    step_id: int
    keyframe: bool
    events: tuple[BlockEvent, ...]
    body: Raw  # the undecoded body
    bridge: Raw = _NO_BRIDGE  # a keyframe's undecoded delta from frame seq - 1 (empty: none)


def read_head(payload: bytes, events: bool = True) -> FrameHead:
    """Decode a message's envelope (not its body); StreamError if it is not a pool-stream message of a known version.

    ``events=False`` leaves the events out (``()``), for a reader that has them already."""
    # this version's envelope is told by its first 9 bytes (array header, magic, version); the full peek parses the
    # whole message to skip what follows (0.7 ms for a keyframe of 65,536 blocks), so it runs only for anything else
    if not (payload[:1] in _FIXARRAYS and payload[1:8] == _MAGIC_BYTES and payload[8:9] == _VERSION_BYTE):
        _check_version(payload)
    try:
        env = (_ENVELOPE_DECODER if events else _ENVELOPE_NO_EVENTS_DECODER).decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamError(f"malformed pool-stream message: {_why(exc)}") from None
    if env.seq < 0:
        raise StreamError(f"malformed pool-stream message: negative frame number {env.seq}")
    return FrameHead(env.stream_id, env.seq, env.step_id, env.keyframe, env.events if events else (), env.body,
                     env.bridge)


_FIXARRAYS = (b"\x98", b"\x99")  # msgpack headers of the 8- and 9-element envelopes
_VERSION_BYTE = bytes([FORMAT_VERSION])  # a positive fixint


def _check_version(payload: bytes) -> None:
    """StreamError unless ``payload`` starts like a pool-stream message of a version this program reads."""
    try:
        peek = _VERSION_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        if bytes(payload[1:8]) == _MAGIC_BYTES and 0x90 <= payload[0] <= 0x9F:  # ours, but cut short or damaged
            raise StreamError(f"malformed pool-stream message ({_why(exc)})") from None
        raise StreamError(f"not a pool-stream message ({_why(exc)})") from None
    if peek.magic != MAGIC:
        raise StreamError(f"not a pool-stream message (it starts with {_short(peek.magic)}, not {MAGIC!r})")
    version = peek.format_version
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise StreamError(f"malformed pool-stream message: format version {_short(version)}")
    if version > FORMAT_VERSION:
        raise StreamError(f"this pool stream uses format version {version}, newer than this program reads "
                          f"(up to {FORMAT_VERSION}); update the explorer to read it")


def frame_from_payload(payload: bytes) -> Frame:
    """A Frame for an encoded message (envelope decoded and checked; the body is checked when it is applied)."""
    return frame_of(read_head(payload), bytes(payload))


def frame_of(head: FrameHead, payload: bytes) -> Frame:
    """The Frame of a message whose head was read (``read_head``) from ``payload``."""
    return Frame(head.seq, head.step_id, head.keyframe, payload, head.events, head.stream_id, bool(head.bridge))


def _why(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---- numbers: EngineMetrics / MemoryStats as maps of changed fields ---------------------------------------------
def _number_fields(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        assert kind in (int, float), f"{cls.__name__}.{f.name}: the pool stream carries only int and float fields"
        out[f.name] = kind
    return out


_METRIC_FIELDS = _number_fields(EngineMetrics)
_MEMORY_FIELDS = _number_fields(MemoryStats)


def _plain(kind: type, value: Any) -> int | float:
    return float(value) if kind is float else int(value)


def _numbers(obj, fields: dict[str, type], old=None) -> Numbers:
    """Every field of ``obj`` (old None) or those that differ from ``old``."""
    if old is None:
        return {name: _plain(kind, getattr(obj, name)) for name, kind in fields.items()}
    return {name: _plain(kind, getattr(obj, name)) for name, kind in fields.items()
            if getattr(obj, name) != getattr(old, name)}


def _check_numbers(values: Numbers, fields: dict[str, type], what: str, complete: bool) -> None:
    for name, value in values.items():
        kind = fields.get(name)
        if kind is None:
            raise StreamError(f"malformed pool-stream message: {what} has no field {name!r}")
        if kind is int and type(value) is not int:
            raise StreamError(f"malformed pool-stream message: {what}.{name} must be an integer, got {value!r}")
    if complete and len(values) != len(fields):
        missing = sorted(set(fields) - set(values))
        raise StreamError(f"malformed pool-stream message: {what} lacks {', '.join(missing)}")


def _make_numbers(cls, fields: dict[str, type], values: Numbers, old=None):
    typed = {k: (float(v) if fields[k] is float else v) for k, v in values.items()}
    return cls(**typed) if old is None else dataclasses.replace(old, **typed)


# ---- per-block arrays ------------------------------------------------------------------------------------------
def _narrow(values: np.ndarray, lo: int | None = None, hi: int | None = None) -> Packed:
    """``values`` in the narrowest integer dtype holding lo..hi (their min and max, computed if not given)."""
    if values.dtype == np.bool_:
        return Packed("|b1", values.tobytes())
    if values.size == 0:
        return Packed("|u1", b"")
    if lo is None:
        lo, hi = int(values.min()), int(values.max())
    dt = _narrow_dtype(lo, hi)
    return Packed(dt.str, (values if values.dtype == dt else values.astype(dt)).tobytes())


def _narrow_dtype(lo: int, hi: int) -> np.dtype:
    """The narrowest integer dtype holding lo..hi."""
    for dt, dt_min, dt_max in _NARROW_RANGES:
        if dt_min <= lo and hi <= dt_max:
            return dt
    raise StreamError(f"values {lo}..{hi} do not fit 64 bits")  # unreachable for numpy integer arrays


def _patch(values: np.ndarray, index: np.ndarray | None) -> ArrayPatch:
    """``values`` (at ascending ``index``; None: all) as a patch; one value for all when they are equal."""
    if index is not None and 0 < index.size <= _SMALL_PATCH and values.dtype != np.bool_:
        return _small_patch(values.tolist(), index.tolist())
    gaps = None
    if index is not None and index.size:
        steps = np.empty(index.size, np.int64)  # [changed] gaps between ascending indices
        steps[0] = index[0]
        np.subtract(index[1:], index[:-1], out=steps[1:])
        steps[1:] -= 1
        gaps = _narrow(steps, 0, int(steps.max()))
    if values.size == 0 or values.dtype == np.bool_:
        return ArrayPatch(gaps, _narrow(values))
    lo, hi = int(values.min()), int(values.max())
    if lo == hi:
        return ArrayPatch(gaps, lo)
    return ArrayPatch(gaps, _narrow(values, lo, hi))


_SMALL_PATCH = 64  # up to this many changed entries, a patch is made from Python lists (numpy's per-call overhead
# is most of the cost of a few entries: 15 us for 10 of them, against a few us this way)


def _small_patch(values: list[int], index: list[int]) -> ArrayPatch:
    """:func:`_patch` of a few entries, the same bytes."""
    steps = [index[0]]
    steps += [b - a - 1 for a, b in zip(index, index[1:])]
    gaps = _narrow_list(steps, 0, max(steps))
    lo, hi = min(values), max(values)
    return ArrayPatch(gaps, lo if lo == hi else _narrow_list(values, lo, hi))


def _narrow_list(values: list[int], lo: int, hi: int) -> Packed:
    """:func:`_narrow` of a list of ints whose min and max are ``lo`` and ``hi``."""
    dt = _narrow_dtype(lo, hi)
    return Packed(dt.str, np.array(values, dt).tobytes())


def _column(values: list[int]) -> Packed | int:
    """A column of ints: one number when they are all equal."""
    first = values[0]
    return first if values.count(first) == len(values) else _narrow(np.array(values, np.int64))


def _read_column(column: Packed | int, count: int, what: str) -> list[int] | int:
    """The column's values, or its one value for all (an int)."""
    if isinstance(column, int):
        return column
    values = _unpack(column, what)
    if values.size != count:
        raise StreamError(f"malformed pool-stream message: {what} has {values.size} entries for {count}")
    return values.tolist()


def _unpack(packed: Packed, what: str) -> np.ndarray:
    if packed.dtype not in _DTYPES:
        raise StreamError(f"malformed pool-stream message: {what} has dtype {_short(packed.dtype)}")
    dt = np.dtype(packed.dtype)
    if len(packed.data) % dt.itemsize:
        raise StreamError(f"malformed pool-stream message: {what} has {len(packed.data)} bytes, not a multiple of "
                          f"{dt.itemsize}")
    return np.frombuffer(packed.data, dt)


def _fits(values: np.ndarray | int, dtype: np.dtype) -> bool:
    if isinstance(values, np.ndarray):
        if values.size == 0 or np.can_cast(values.dtype, dtype, "safe"):
            return True
        lo, hi = int(values.min()), int(values.max())
    else:
        lo = hi = values
    if dtype == np.bool_:
        return lo >= 0 and hi <= 1
    info = np.iinfo(dtype)
    return info.min <= lo and hi <= info.max


def _read_patch(patch: ArrayPatch, name: str, n: int, dtype: np.dtype):
    """(index or None, values or scalar) of a patch, checked against an array of length n and ``dtype``."""
    index = None
    if patch.gaps is not None:
        gaps = _unpack(patch.gaps, f"{name} indices")
        if gaps.dtype.kind == "i" and gaps.size and gaps.min() < 0:
            raise StreamError(f"malformed pool-stream message: negative gap in the indices of {name}")
        index = np.cumsum(gaps.astype(np.int64) + 1) - 1  # [changed] ascending indices
        if index.size and index[-1] >= n:
            raise StreamError(f"malformed pool-stream message: {name} index {int(index[-1])} is past the pool's "
                              f"{n} blocks")
    count = n if index is None else index.size
    values = patch.values
    if isinstance(values, Packed):
        values = _unpack(values, f"{name} values")
        if values.size != count:
            raise StreamError(f"malformed pool-stream message: {name} has {values.size} values for {count} blocks")
    if not _fits(values, dtype):
        raise StreamError(f"malformed pool-stream message: {name} values do not fit {dtype}")
    return index, values


# ---- conversations ---------------------------------------------------------------------------------------------
_CONV_NAMES = tuple(f.name for f in dataclasses.fields(ConversationInfo))
assert _CONV_NAMES == tuple(ConvPatch.__struct_fields__), "ConvPatch must list ConversationInfo's fields in order"
_SEQ, _TEXT, _PLAIN = 0, 1, 2
_CONV_KINDS = tuple(_SEQ if n in ("prompt_token_ids", "output_token_ids", "block_table")
                    else _TEXT if n in ("output_text", "prompt_text") else _PLAIN for n in _CONV_NAMES)
_CONV_VALUES = tuple(i for i in range(len(_CONV_NAMES)) if i)  # value fields (all but the id)
_SEQ_AT = tuple(i for i in _CONV_VALUES if _CONV_KINDS[i] == _SEQ)  # positions of the token / block id tuples
_TEXT_AT = tuple(i for i in _CONV_VALUES if _CONV_KINDS[i] == _TEXT)  # positions of the texts
_PLAIN_AT = tuple(i for i in _CONV_VALUES if _CONV_KINDS[i] == _PLAIN)  # positions of the other fields
_DROP_AT = _SEQ_AT + _TEXT_AT
_TABLE_AT = _CONV_NAMES.index("block_table")
_conv_values = operator.attrgetter(*_CONV_NAMES)  # ConversationInfo -> its field values (one C call)
_GROWING = ("output_token_ids", "output_text", "block_table", "num_computed_tokens")  # what a Grown entry changes
_stable = operator.attrgetter(*[n for n in _CONV_NAMES if n not in _GROWING])  # the fields a Grown entry keeps
_OUT_AT, _TEXT_OUT_AT, _COMPUTED_AT = (_CONV_NAMES.index(n) for n in _GROWING[:2] + _GROWING[3:])
_BLANK_CONV = tuple(() if k == _SEQ else "" if k == _TEXT else None for k in _CONV_KINDS)  # before a new one's patch


def _seq_patch(old: tuple, new: tuple) -> tuple:
    n = len(old)
    if len(new) >= n and new[:n] == old:
        return (0, tuple(new[n:]))
    common = 0
    for a, b in zip(old, new):
        if a != b:
            break
        common += 1
    return (n - common, tuple(new[common:]))


def _text_patch(old: str, new: str) -> tuple:
    if new.startswith(old):
        return (0, new[len(old):])
    lo, hi = 0, min(len(old), len(new))  # longest common prefix by bisection (slice compares run in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if old[:mid] == new[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return (len(old) - lo, new[lo:])


def _full_patch(info: ConversationInfo) -> ConvPatch:
    kw = {}
    for name, kind in zip(_CONV_NAMES, _CONV_KINDS):
        value = getattr(info, name)
        kw[name] = (0, tuple(value)) if kind == _SEQ else (0, value) if kind == _TEXT else value
    return ConvPatch(**kw)


def _diff_patch(old: ConversationInfo, new: ConversationInfo, grown: bool = False) -> ConvPatch | None:
    """``grown``: the producer promised that new's outputs start with old's (PoolSnapshot.output_prefixes)."""
    ov, nv = _conv_values(old), _conv_values(new)
    if ov == nv:
        return None
    kw = {}
    for i in _SEQ_AT:
        if grown and i == _OUT_AT:
            if len(nv[i]) != len(ov[i]):
                kw[_CONV_NAMES[i]] = (0, tuple(nv[i][len(ov[i]):]))
        elif ov[i] != nv[i]:
            kw[_CONV_NAMES[i]] = _seq_patch(ov[i], nv[i])
    for i in _TEXT_AT:
        if ov[i] != nv[i]:
            kw[_CONV_NAMES[i]] = _text_patch(ov[i], nv[i])
    for i in _PLAIN_AT:
        if ov[i] != nv[i]:
            kw[_CONV_NAMES[i]] = nv[i]
    return ConvPatch(conversation_id=new.conversation_id, **kw)


def _header(snapshot: PoolSnapshot) -> Header:
    dtypes = {name: getattr(snapshot, name).dtype.str for name in ARRAYS[:-1]}
    if snapshot.block_hash is not None:
        dtypes["block_hash"] = snapshot.block_hash.dtype.str
    return Header(str(snapshot.source), int(snapshot.num_blocks), int(snapshot.block_size), str(snapshot.model_name),
                  str(snapshot.device), int(snapshot.max_model_len), dtypes)


def _order_patch(old_keys, new_keys: list, removed: set) -> list | None:
    """None when ``new_keys`` is (old keys still there, in order) then the new ones, as a decoder puts them; else
    the order itself."""
    kept = [k for k in old_keys if k not in removed]
    if new_keys[:len(kept)] == kept and not set(new_keys[len(kept):]) & set(old_keys):
        return None
    return list(new_keys)


# ---- the encoder -----------------------------------------------------------------------------------------------
def _new_stream_id() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1  # 63 bits: a msgpack int everywhere


class StreamEncoder:
    """Turns the snapshots of one source into frames: a keyframe first, then deltas, and a keyframe again after
    ``keyframe_interval`` frames or ``keyframe_after_bytes`` bytes of deltas (whichever comes first: this bounds
    what a late subscriber or a random jump must decode) and whenever the pool's header changes.

    One per source; ``encode`` is called from one thread (the engine thread). Frames are encoded once and shared by
    every sink."""

    def __init__(self, keyframe_interval: int = 256, *, keyframe_after_bytes: int = 1 << 20,
                 stream_id: int | None = None):
        for name, value in (("keyframe_interval", keyframe_interval), ("keyframe_after_bytes", keyframe_after_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.keyframe_interval = keyframe_interval  # frames from one keyframe to the next, at most
        self.keyframe_after_bytes = keyframe_after_bytes  # bytes of deltas from one keyframe to the next, about
        self.stream_id = _new_stream_id() if stream_id is None else int(stream_id)  # tells restarted sources apart
        self._seq = -1  # seq of the last frame
        self._since_key = 0  # frames since the last keyframe
        self._bytes_since_key = 0  # payload bytes of the deltas since the last keyframe
        self._prev: PoolSnapshot | None = None  # state of the last frame
        self._prev_arrays: dict[str, np.ndarray] = {}
        self._prev_convs: dict[int, ConversationInfo] = {}
        self._prev_stable: dict[int, tuple] = {}  # conversation id -> _stable() of the last frame's (each made once)
        self._header: Header | None = None

    @property
    def last_seq(self) -> int:
        """seq of the last frame encoded (-1 before the first)."""
        return self._seq

    def encode(self, snapshot: PoolSnapshot, events: Sequence[BlockEvent] = ()) -> Frame:
        """The next frame: ``snapshot`` plus the block events that led to it."""
        if not isinstance(snapshot, PoolSnapshot):
            raise TypeError(f"encode() takes a PoolSnapshot, not {type(snapshot).__name__}")
        events = tuple(events)
        for e in events:
            if not isinstance(e, BlockEvent):
                raise TypeError(f"events must be BlockEvents, got {type(e).__name__}")
        arrays = self._arrays(snapshot)
        header = _header(snapshot)
        key = (self._prev is None or header != self._header or self._since_key + 1 >= self.keyframe_interval
               or self._bytes_since_key >= self.keyframe_after_bytes)
        bridge = None
        if key:
            if self._prev is not None and header == self._header:  # a periodic keyframe: bridge it
                bridge, stable, prev_convs = self._delta_body(snapshot, arrays)
            else:
                stable = {c.conversation_id: _stable(c) for c in snapshot.conversations}
                prev_convs = {c.conversation_id: c for c in snapshot.conversations}
            body = self._keyframe_body(snapshot, header, arrays)
        else:
            body, stable, prev_convs = self._delta_body(snapshot, arrays)
        frame = self._frame(self._seq + 1, snapshot.step_id, key, events, body, bridge)
        self._seq += 1
        self._since_key = 0 if key else self._since_key + 1
        self._bytes_since_key = 0 if key else self._bytes_since_key + len(frame.payload)
        self._prev, self._prev_arrays, self._header = snapshot, arrays, header
        self._prev_convs = prev_convs
        self._prev_stable = stable
        return frame

    def keyframe(self) -> Frame:
        """A keyframe of the last encoded state, with its seq (for a sink that joins mid-stream); no events."""
        if self._prev is None:
            raise StreamError("nothing encoded yet: there is no state to make a keyframe of")
        body = self._keyframe_body(self._prev, self._header, self._prev_arrays)
        return self._frame(self._seq, self._prev.step_id, True, (), body)

    def _frame(self, seq: int, step_id: int, key: bool, events: tuple, body: Body, bridge: Delta | None = None) \
            -> Frame:
        try:
            if bridge is None:
                envelope = _Envelope(MAGIC, FORMAT_VERSION, self.stream_id, seq, int(step_id), key, events, body)
            else:
                envelope = _BridgedEnvelope(MAGIC, FORMAT_VERSION, self.stream_id, seq, int(step_id), key, events,
                                            body, bridge)
            payload = _ENCODER.encode(envelope)
        except (TypeError, OverflowError, msgspec.EncodeError) as exc:
            raise StreamError(f"cannot encode this snapshot: {_why(exc)}") from None
        return Frame(seq, int(step_id), key, payload, events, self.stream_id, bridge is not None)

    def _arrays(self, snapshot: PoolSnapshot) -> dict[str, np.ndarray]:
        out = {}
        for name in ARRAYS:
            a = getattr(snapshot, name)
            if a is None:
                continue
            if not isinstance(a, np.ndarray) or a.shape != (snapshot.num_blocks,):
                raise StreamError(f"snapshot.{name} must be an array of num_blocks ({snapshot.num_blocks}) entries")
            ok = _DTYPE_OK.get(a.dtype)
            if ok is None:
                ok = _DTYPE_OK[a.dtype] = a.dtype.newbyteorder("<").str in _DTYPES
            if not ok:
                raise StreamError(f"snapshot.{name} has dtype {a.dtype}, which the pool stream does not carry")
            if a.flags.writeable:  # views are read-only by contract; copy one that is not, we compare against it
                a = a.copy()
            out[name] = a
        return out

    @staticmethod
    def _keyframe_body(snapshot: PoolSnapshot, header: Header, arrays: dict[str, np.ndarray]) -> Keyframe:
        patches = {}
        for name, a in arrays.items():
            index = np.flatnonzero(a != _BLANK.get(name, 0))  # [non-blank]
            if index.size == 0:
                continue
            dense = index.size * 4 > a.size
            patches[name] = _patch(a if dense else a[index], None if dense else index)
        tables = [TablePatch(int(cid), 0, tuple(t)) for cid, t in snapshot.block_tables.items()]
        memory = None if snapshot.memory is None else _numbers(snapshot.memory, _MEMORY_FIELDS)
        return Keyframe(header, int(snapshot.version), patches, tables,
                        [_full_patch(c) for c in snapshot.conversations],
                        _numbers(snapshot.metrics, _METRIC_FIELDS), memory)

    def _delta_body(self, snapshot: PoolSnapshot, arrays: dict[str, np.ndarray]) \
            -> tuple[Delta, dict[int, tuple], dict[int, ConversationInfo]]:
        """The delta from the last frame to ``snapshot``, and ``_stable()`` of each of its conversations and the
        conversations by id."""
        prev = self._prev
        patches = {}
        promise = snapshot.changed_blocks  # the producer's record of the blocks that may have changed since prev
        masks = promise[1] if promise is not None and promise[0] is prev else None
        maybes: dict[int, np.ndarray] = {}  # id(mask) -> its blocks (arrays share masks)
        for name, a in arrays.items():
            b = self._prev_arrays[name]
            if a is b:
                continue
            if masks is None:
                index = np.flatnonzero(a != b)  # [changed]
            else:  # only those: six arrays of 65,536 read in full, cold, were most of a frame's cost in the app
                mask = masks[name]
                maybe = maybes.get(id(mask))
                if maybe is None:
                    maybe = maybes[id(mask)] = np.flatnonzero(mask)  # [maybe]
                index = maybe[a[maybe] != b[maybe]]
            if index.size:
                patches[name] = _patch(a[index], index)
        # block tables
        old_tables, new_tables = prev.block_tables, snapshot.block_tables
        tables = []
        for cid, t in new_tables.items():
            o = old_tables.get(cid)
            if o is None:
                tables.append(TablePatch(int(cid), 0, tuple(t)))
            elif o is not t and o != t:
                drop, tail = _seq_patch(o, t)
                tables.append(TablePatch(int(cid), drop, tail))
        table_ids = list(new_tables)
        if table_ids == list(old_tables):  # the same conversations in the same order: most frames
            removed, order = [], None
        else:
            removed = [cid for cid in old_tables if cid not in new_tables]
            order = _order_patch(old_tables.keys(), table_ids, set(removed))
        # conversations: the ones that only grew go in columns, the others as patches. This loop runs for every
        # conversation of every frame: plain attribute loads (faster than attrgetters here), and ints appended to
        # a few lists (a tuple per grown conversation, unpacked at the end, measured 10% slower per frame)
        old_convs, old_stable = self._prev_convs, self._prev_stable
        get_old = old_convs.get
        prefixes = snapshot.output_prefixes  # the producer's promises: outputs that only grew, known by identity
        new_stable = {}  # this frame's _stable() per conversation: the next frame's old ones
        new_convs = {}  # conversation id -> info: the next frame's old ones
        convs = []
        g_ids, g_counts, g_tokens, g_texts, g_computed, g_bcounts, g_blocks = [], [], [], [], [], [], []
        for c in snapshot.conversations:
            cid = c.conversation_id
            new_convs[cid] = c
            o = get_old(cid)
            if o is c:
                new_stable[cid] = old_stable[cid]
                continue
            st = new_stable[cid] = _stable(c)
            if o is not None and old_stable[cid] == st:
                oo = o.output_token_ids
                no = c.output_token_ids
                ot = o.output_text
                nt = c.output_text
                ob = o.block_table
                nb = c.block_table
                n = len(oo)
                m = len(ob)
                if (prefixes.get(cid) is oo or no[:n] == oo) and nt.startswith(ot) and (nb is ob or nb[:m] == ob):
                    if len(no) == n and len(nt) == len(ot) and len(nb) == m and \
                            o.num_computed_tokens == c.num_computed_tokens:
                        continue  # equal, though not the same object
                    g_ids.append(cid)
                    g_counts.append(len(no) - n)
                    g_tokens.extend(no[n:])
                    g_texts.append(nt[len(ot):])
                    g_computed.append(c.num_computed_tokens)
                    g_bcounts.append(len(nb) - m)
                    if len(nb) != m:
                        g_blocks.extend(nb[m:])
                    continue
            p = _full_patch(c) if o is None else _diff_patch(o, c, prefixes.get(cid) is o.output_token_ids)
            if p is not None:
                convs.append(p)
        grown = None
        if g_ids:
            grown = Grown(_narrow(np.array(g_ids)), _column(g_counts), _narrow(np.array(g_tokens, np.int64)),
                          g_texts, _column(g_computed), _column(g_bcounts), _narrow(np.array(g_blocks, np.int64)))
        new_ids = list(new_convs)
        if new_ids == list(old_convs):
            dropped, conv_order = [], None
        else:
            new_set = set(new_ids)
            dropped = [cid for cid in old_convs if cid not in new_set]
            conv_order = _order_patch(old_convs.keys(), new_ids, set(dropped))
        metrics = None
        if snapshot.metrics is not prev.metrics and snapshot.metrics != prev.metrics:
            metrics = _numbers(snapshot.metrics, _METRIC_FIELDS, prev.metrics)
        memory: Any = UNSET
        if snapshot.memory is None:
            if prev.memory is not None:
                memory = None
        elif prev.memory is None:
            memory = _numbers(snapshot.memory, _MEMORY_FIELDS)
        elif snapshot.memory is not prev.memory and snapshot.memory != prev.memory:
            memory = _numbers(snapshot.memory, _MEMORY_FIELDS, prev.memory)
        return Delta(int(snapshot.version), patches, tables, removed, order, convs, grown, dropped, conv_order,
                     metrics, memory), new_stable, new_convs


def encode_keyframe(snapshot: PoolSnapshot, seq: int, stream_id: int, events: Sequence[BlockEvent] = ()) -> Frame:
    """A keyframe for ``snapshot`` at ``seq`` of stream ``stream_id`` (a history re-keying its oldest kept frame)."""
    enc = StreamEncoder(stream_id=stream_id)
    arrays = enc._arrays(snapshot)
    body = enc._keyframe_body(snapshot, _header(snapshot), arrays)
    return enc._frame(seq, snapshot.step_id, True, tuple(events), body)


# ---- the decoder -----------------------------------------------------------------------------------------------
class _State:
    """Mutable decoded state of one stream, with the immutable pieces of the last snapshot built from it."""

    __slots__ = ("header", "stream_id", "seq", "step_id", "version", "dtypes", "work", "frozen", "tables",
                 "tables_view", "convs", "conv_objs", "conv_tuple", "metrics", "memory", "snap", "pending")

    def __init__(self, header: Header, stream_id: int):
        self.header = header  # the pool's header
        self.stream_id = stream_id
        self.seq = -1  # seq of the frame the state is at
        self.step_id = 0
        self.version = 0
        self.dtypes = {name: np.dtype(d) for name, d in header.dtypes.items()}  # per-block array dtypes
        self.work: dict[str, np.ndarray] = {}  # writable per-block arrays
        self.frozen: dict[str, np.ndarray | None] = {}  # read-only copy of each as of the last snapshot; None: stale
        self.tables: dict[int, tuple[int, ...]] = {}  # conversation id -> block ids, in order
        self.tables_view: Mapping | None = None  # read-only view of tables as of the last snapshot; None: stale
        self.convs: dict[int, list] = {}  # conversation id -> field values (token fields may be lists), in order
        self.conv_objs: dict[int, ConversationInfo] = {}  # built ConversationInfo of the unchanged ones
        self.conv_tuple: tuple | None = None  # snapshot.conversations as of the last snapshot; None: stale
        self.metrics = EngineMetrics()
        self.memory: MemoryStats | None = None
        self.snap: PoolSnapshot | None = None  # the last snapshot built; None: stale
        # Decode steps not yet applied to the rows: (ids, one token each [ids], texts, computed) per frame, oldest
        # first. Applied in one go when anything reads the rows (a build, a patch or drop of one of those
        # conversations), so that a run of 60 deltas costs one extend per conversation, not 60 (see _flush).
        self.pending: list[tuple[list[int], np.ndarray, list[str], Any]] = []


def _check_table(cid: int, old: tuple | None, drop: int, tail: tuple, n: int) -> None:
    if drop < 0 or drop > (0 if old is None else len(old)):
        raise StreamError(f"malformed pool-stream message: block table of conversation {cid} drops {drop} entries "
                          f"of {0 if old is None else len(old)}")
    if tail and (min(tail) < 0 or max(tail) >= n):
        raise StreamError(f"malformed pool-stream message: block table of conversation {cid} names a block outside "
                          f"0..{n - 1}")


def _check_order(order: list[int], keys: list[int], what: str) -> None:
    if len(order) != len(keys) or set(order) != set(keys):
        raise StreamError(f"malformed pool-stream message: the {what} order does not list the {what}s it has")


def _check_conv(p: ConvPatch, old: list | None, n: int) -> tuple:
    """The patch's field values (UNSET where unchanged), checked against the conversation's values ``old``."""
    values = msgspec.structs.astuple(p)
    if old is None:
        if UNSET in values:
            missing = [_CONV_NAMES[i] for i in _CONV_VALUES if values[i] is UNSET]
            raise StreamError(f"malformed pool-stream message: new conversation {p.conversation_id} lacks "
                              f"{', '.join(missing)}")
        drops = [i for i in _DROP_AT if values[i][0]]
    else:
        drops = [i for i in _DROP_AT if values[i] is not UNSET and values[i][0] > len(old[i])]
    if drops:
        i = drops[0]
        raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id} drops {values[i][0]} "
                          f"of {0 if old is None else len(old[i])} {_CONV_NAMES[i]}")
    table = values[_TABLE_AT]
    if table is not UNSET and table[1] and (min(table[1]) < 0 or max(table[1]) >= n):
        raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id} names a block outside "
                          f"0..{n - 1}")
    return values


def _apply_conv(values: tuple, vals: list) -> None:
    """Apply checked patch ``values`` to a conversation's field values ``vals`` (in place)."""
    for i in _SEQ_AT:
        v = values[i]
        if v is not UNSET:
            cur = vals[i]
            if type(cur) is not list:
                cur = vals[i] = list(cur)  # mutable while patches arrive; a tuple again when a snapshot is built
            if v[0]:
                del cur[len(cur) - v[0]:]
            cur.extend(v[1])
    for i in _TEXT_AT:
        v = values[i]
        if v is not UNSET:
            vals[i] = (vals[i][:len(vals[i]) - v[0]] if v[0] else vals[i]) + v[1]
    for i in _PLAIN_AT:
        v = values[i]
        if v is not UNSET:
            vals[i] = v


class StreamDecoder:
    """Rebuilds, from a pool stream's messages in order, exactly the snapshots its source had.

    ``feed`` checks the whole message before it touches anything: a malformed, foreign, newer-format or
    out-of-order message raises StreamError and leaves the decoder as it was. A delta must follow the frame before it
    (seq - 1, same stream); a keyframe may come at any time and resets the state (a resync after a gap)."""

    def __init__(self) -> None:
        self._state: _State | None = None

    @property
    def seq(self) -> int | None:
        """seq of the frame the decoder is at; None before its first keyframe."""
        return None if self._state is None else self._state.seq

    @property
    def stream_id(self) -> int | None:
        return None if self._state is None else self._state.stream_id

    @property
    def header(self) -> Header | None:
        return None if self._state is None else self._state.header

    def feed(self, payload: bytes) -> tuple[PoolSnapshot, tuple[BlockEvent, ...], int]:
        """Apply one message: (the snapshot after it, its block events, its seq)."""
        head = read_head(payload)
        self.apply(head)
        return self.snapshot(), head.events, head.seq

    def apply(self, head: FrameHead) -> None:
        """Apply a message already read with :func:`read_head`, without building a snapshot (fast-forward). A
        keyframe that follows this decoder's frame is applied through its bridge when it has one."""
        if head.bridge and self._bridge(head):
            return
        try:
            body = _BODY_DECODER.decode(head.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StreamError(f"malformed pool-stream message (frame {head.seq}): {_why(exc)}") from None
        if isinstance(body, Keyframe) != head.keyframe:
            raise StreamError(f"malformed pool-stream message (frame {head.seq}): its envelope and body disagree on "
                              "whether it is a keyframe")
        if isinstance(body, Keyframe):
            self._state = _keyframe_state(head, body)
            return
        state = self._state
        if state is None:
            raise StreamError(f"frame {head.seq} is a delta and no keyframe came before it: wait for a keyframe")
        if head.stream_id != state.stream_id:
            raise StreamError(f"frame {head.seq} is a delta of another stream (the source restarted): wait for a "
                              "keyframe")
        if head.seq != state.seq + 1:
            raise StreamError(f"frame {head.seq} is a delta but the decoder is at frame {state.seq}: "
                              f"{'frames are missing' if head.seq > state.seq else 'it came before'}; wait for a "
                              "keyframe")
        _apply_delta(state, head, body, *_check_delta(state, body))

    def _bridge(self, head: FrameHead) -> bool:
        """Apply keyframe ``head`` as its bridge delta if this decoder is at the frame before, in the same stream;
        False (nothing changed) otherwise, or if the bridge does not check: the keyframe itself is then decoded."""
        state = self._state
        if state is None or head.stream_id != state.stream_id or head.seq != state.seq + 1:
            return False
        try:
            body = _BODY_DECODER.decode(head.bridge)
            if not isinstance(body, Delta):
                return False
            checked = _check_delta(state, body)
        except (msgspec.DecodeError, msgspec.ValidationError, StreamError):
            return False
        _apply_delta(state, head, body, *checked)
        return True

    def copy(self) -> "StreamDecoder":
        """An independent decoder at the same frame (a history's checkpoint)."""
        out = StreamDecoder()
        state = self._state
        if state is not None:
            new = _State(state.header, state.stream_id)
            new.seq, new.step_id, new.version = state.seq, state.step_id, state.version
            new.work = {name: a.copy() for name, a in state.work.items()}
            new.frozen = dict(state.frozen)
            new.tables, new.tables_view = dict(state.tables), state.tables_view
            # Conversation rows become immutable (tuples, their token fields tuples too) and both decoders share
            # them; the next patch of a row in either makes it a list again (_row). Finished conversations never
            # change, so a copy touches only the rows patched since the last one: a deep copy of every row took
            # 10 ms at 256 conversations, and checkpoints are made every 8 frames of a scrub back.
            convs = state.convs
            for cid, vals in convs.items():
                if type(vals) is list:
                    for i in _SEQ_AT:
                        if type(vals[i]) is list:
                            vals[i] = _ints(vals[i])
                    convs[cid] = tuple(vals)
            new.convs = dict(convs)
            new.conv_objs, new.conv_tuple = dict(state.conv_objs), state.conv_tuple
            new.pending = list(state.pending)  # its entries are never changed: both decoders apply them
            new.metrics, new.memory, new.snap = state.metrics, state.memory, state.snap
            out._state = new
        return out

    def snapshot(self) -> PoolSnapshot:
        """The snapshot of the current state (built once per state; shares unchanged pieces with the one before)."""
        state = self._state
        if state is None:
            raise StreamError("no keyframe decoded yet: there is no snapshot")
        if state.snap is None:
            state.snap = _build(state)
        return state.snap


def _keyframe_state(head: FrameHead, body: Keyframe) -> _State:
    h = body.header
    if h.num_blocks < 1 or h.block_size < 1 or h.max_model_len < 0:
        raise StreamError(f"malformed pool-stream message: header says {h.num_blocks} blocks of {h.block_size} slots")
    missing = [name for name in ARRAYS[:-1] if name not in h.dtypes]
    unknown = [name for name in h.dtypes if name not in ARRAYS]
    bad = [d for d in h.dtypes.values() if d not in _DTYPES]
    if missing or unknown or bad:
        raise StreamError(f"malformed pool-stream message: header dtypes {_short(h.dtypes)}")
    state = _State(h, head.stream_id)
    n = h.num_blocks
    for name, dtype in state.dtypes.items():
        a = np.full(n, _BLANK.get(name, 0), dtype)
        patch = body.arrays.get(name)
        if patch is not None:
            index, values = _read_patch(patch, name, n, dtype)
            if index is None:
                a[:] = values
            else:
                a[index] = values
        state.work[name] = a
        state.frozen[name] = None
    extra = set(body.arrays) - set(state.dtypes)
    if extra:
        raise StreamError(f"malformed pool-stream message: keyframe has arrays the header lacks: {sorted(extra)}")
    for t in body.tables:
        if t.drop != 0 or t.conversation_id in state.tables:
            raise StreamError(f"malformed pool-stream message: keyframe block table of conversation "
                              f"{t.conversation_id} is repeated or not whole")
        _check_table(t.conversation_id, None, 0, t.tail, n)
        state.tables[t.conversation_id] = _ints(t.tail)
    for p in body.conversations:
        if p.conversation_id in state.convs:
            raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id} appears twice")
        vals = list(_check_conv(p, None, n))  # every field present, nothing dropped: take the values as they are
        for i in _SEQ_AT:
            vals[i] = _ints(vals[i][1])
        for i in _TEXT_AT:
            vals[i] = vals[i][1]
        state.convs[p.conversation_id] = tuple(vals)  # shared by copies until patched (see copy)
    _check_numbers(body.metrics, _METRIC_FIELDS, "metrics", True)
    state.metrics = _make_numbers(EngineMetrics, _METRIC_FIELDS, body.metrics)
    if body.memory is not None:
        _check_numbers(body.memory, _MEMORY_FIELDS, "memory", True)
        state.memory = _make_numbers(MemoryStats, _MEMORY_FIELDS, body.memory)
    state.seq, state.step_id, state.version = head.seq, head.step_id, body.version
    return state


def _check_delta(state: _State, body: Delta) -> tuple[list, list]:
    """Everything that could be wrong with ``body``; returns the decoded array and conversation patches."""
    n = state.header.num_blocks
    arrays = []
    for name, patch in body.arrays.items():
        dtype = state.dtypes.get(name)
        if dtype is None:
            raise StreamError(f"malformed pool-stream message: delta changes {_short(name)}, which this pool lacks")
        arrays.append((name, *_read_patch(patch, name, n, dtype)))
    tables = state.tables
    seen = set()
    for t in body.tables:
        if t.conversation_id in seen:
            raise StreamError(f"malformed pool-stream message: block table of {t.conversation_id} patched twice")
        seen.add(t.conversation_id)
        _check_table(t.conversation_id, tables.get(t.conversation_id), t.drop, t.tail, n)
    removed = set(body.tables_removed)
    if len(removed) != len(body.tables_removed) or not removed.issubset(tables) or removed & seen:
        raise StreamError("malformed pool-stream message: it removes block tables that are not there")
    if body.tables_order is not None:
        keys = [k for k in tables if k not in removed] + [k for k in seen if k not in tables]
        _check_order(body.tables_order, keys, "block table")
    if (body.conversations or body.conversations_dropped) and state.pending:
        waiting = set().union(*[p[0] for p in state.pending])
        if any(p.conversation_id in waiting for p in body.conversations) or \
                not waiting.isdisjoint(body.conversations_dropped):
            _flush(state)  # patches read those rows, drops remove them: the decode steps before come first
    convs = state.convs
    seen = {p.conversation_id for p in body.conversations}
    if len(seen) != len(body.conversations):
        raise StreamError("malformed pool-stream message: a conversation is patched twice")
    get = convs.get
    patches = [(p.conversation_id, _check_conv(p, get(p.conversation_id), n)) for p in body.conversations]
    grown = None if body.grown is None else _check_grown(body.grown, convs, seen, n)
    if grown is not None:
        seen.update(grown[0])
    dropped = set(body.conversations_dropped)
    if len(dropped) != len(body.conversations_dropped) or not dropped.issubset(convs) or dropped & seen:
        raise StreamError("malformed pool-stream message: it drops conversations that are not there")
    if body.conversations_order is not None:
        keys = [k for k in convs if k not in dropped] + [k for k in seen if k not in convs]
        _check_order(body.conversations_order, keys, "conversation")
    if body.metrics is not None:
        _check_numbers(body.metrics, _METRIC_FIELDS, "metrics", False)
    if body.memory is not UNSET and body.memory is not None:
        _check_numbers(body.memory, _MEMORY_FIELDS, "memory", state.memory is None)
    return arrays, patches, grown


def _check_grown(g: Grown, convs: dict, patched: set, n: int) -> tuple:
    ids = _unpack(g.ids, "grown ids").tolist()
    count = len(ids)
    unknown = [cid for cid in ids if cid not in convs or cid in patched]
    if unknown or len(set(ids)) != count:
        raise StreamError(f"malformed pool-stream message: grown conversations {unknown[:5] or ids[:5]} are not "
                          "there, repeated or also patched")
    token_counts = _read_column(g.token_counts, count, "grown token counts")
    tokens = _unpack(g.tokens, "grown tokens")
    if token_counts != 1:  # one token each stays an array (see _State.pending)
        tokens = tokens.tolist()
    block_counts = _read_column(g.block_counts, count, "grown block counts")
    blocks = _unpack(g.blocks, "grown blocks").tolist()
    computed = _read_column(g.computed, count, "grown num_computed_tokens")

    def total(counts):
        return counts * count if isinstance(counts, int) else sum(counts)

    def least(counts):
        return counts if isinstance(counts, int) else min(counts, default=0)

    if len(g.texts) != count or total(token_counts) != len(tokens) or total(block_counts) != len(blocks) or \
            least(token_counts) < 0 or least(block_counts) < 0:
        raise StreamError("malformed pool-stream message: the grown columns do not line up")
    if blocks and (min(blocks) < 0 or max(blocks) >= n):
        raise StreamError(f"malformed pool-stream message: a grown block table names a block outside 0..{n - 1}")
    return ids, token_counts, tokens, g.texts, computed, block_counts, blocks


def _append_runs(rows: list, at: int, counts: list[int] | int, flat: list) -> None:
    """Append to field ``at`` of each row its run of ``flat`` (``counts`` items each, or that many for all)."""
    if counts == 1:  # one token per conversation: a decode step
        pairs = zip(rows, flat)
    elif isinstance(counts, int):
        if not counts:
            return
        pairs = ((vals, flat[j * counts:(j + 1) * counts]) for j, vals in enumerate(rows))
    else:
        starts = itertools.accumulate(counts, initial=0)
        pairs = ((vals, flat[start:start + k]) for vals, k, start in zip(rows, counts, starts) if k)
    for vals, items in pairs:
        cur = vals[at]
        if type(cur) is not list:
            cur = vals[at] = list(cur)  # mutable while patches arrive (see _apply_conv)
        if counts == 1:
            cur.append(items)
        else:
            cur.extend(items)


def _row(convs: dict, cid: int) -> list:
    """Conversation ``cid``'s row of field values, made a list of its own if it is shared (a tuple: see copy)."""
    vals = convs[cid]
    if type(vals) is not list:
        vals = convs[cid] = list(vals)
    return vals


def _apply_grown(grown: tuple, state: _State) -> None:
    ids, token_counts, tokens, texts, computed, block_counts, blocks = grown
    convs = state.convs
    if token_counts == 1:  # a decode step: its tokens, texts and counts wait in pending (blocks go in now)
        state.pending.append((ids, tokens, texts, computed))
        if isinstance(block_counts, int):
            if block_counts:
                _append_runs([_row(convs, cid) for cid in ids], _TABLE_AT, block_counts, blocks)
        else:
            got = [(cid, k) for cid, k in zip(ids, block_counts) if k]
            _append_runs([_row(convs, cid) for cid, _ in got], _TABLE_AT, [k for _, k in got], blocks)
        return
    _flush(state)
    rows = [_row(convs, cid) for cid in ids]
    _append_runs(rows, _OUT_AT, token_counts, tokens)
    _append_runs(rows, _TABLE_AT, block_counts, blocks)
    _grew(state, ids, rows, texts, computed)


def _grew(state: _State, ids: list[int], rows: list, texts, computed: list[int] | int) -> None:
    """The rest of a growth, after its tokens: texts appended, num_computed_tokens set, their infos rebuilt."""
    for vals, text in zip(rows, texts):
        if text:
            vals[_TEXT_OUT_AT] += text
    if isinstance(computed, int):
        for vals in rows:
            vals[_COMPUTED_AT] = computed
    else:
        for vals, value in zip(rows, computed):
            vals[_COMPUTED_AT] = value
    objs = state.conv_objs
    if objs:
        pop = objs.pop
        for cid in ids:
            pop(cid, None)


def _flush(state: _State) -> None:
    """Apply the pending decode steps to the rows: per run of frames with the same conversations, each one's tokens
    in one extend and its texts in one join."""
    pending = state.pending
    if not pending:
        return
    state.pending = []
    convs = state.convs
    start = 0
    while start < len(pending):
        ids = pending[start][0]
        end = start + 1
        while end < len(pending) and pending[end][0] == ids:
            end += 1
        run = pending[start:end]
        start = end
        rows = [_row(convs, cid) for cid in ids]
        tokens = np.stack([p[1] for p in run], axis=1).ravel().tolist()  # [ids, frames]: each one's run in a row
        _append_runs(rows, _OUT_AT, len(run), tokens)
        _grew(state, ids, rows, run[0][2] if len(run) == 1 else map("".join, zip(*[p[2] for p in run])), run[-1][3])


def _apply_delta(state: _State, head: FrameHead, body: Delta, arrays: list, patches: list, grown) -> None:
    """Apply a checked delta (nothing here can fail)."""
    for name, index, values in arrays:
        a = state.work[name]
        if index is None:
            a[:] = values
        else:
            a[index] = values
        state.frozen[name] = None
    if body.tables or body.tables_removed or body.tables_order is not None:
        tables = state.tables
        for cid in body.tables_removed:
            del tables[cid]
        for t in body.tables:
            old = tables.get(t.conversation_id)
            if old is None:
                tables[t.conversation_id] = _ints(t.tail)
            else:
                tables[t.conversation_id] = _ints((old[:len(old) - t.drop] if t.drop else old) + t.tail)
        if body.tables_order is not None:
            state.tables = {cid: tables[cid] for cid in body.tables_order}
        state.tables_view = None
    if body.conversations or grown or body.conversations_dropped or body.conversations_order is not None:
        convs, objs = state.convs, state.conv_objs
        for cid in body.conversations_dropped:
            del convs[cid]
            objs.pop(cid, None)
        for cid, values in patches:
            if cid in convs:
                vals = _row(convs, cid)
            else:
                vals = convs[cid] = list(_BLANK_CONV)
                vals[0] = cid
            _apply_conv(values, vals)
            objs.pop(cid, None)
        if grown is not None:
            _apply_grown(grown, state)
        if body.conversations_order is not None:
            state.convs = {cid: convs[cid] for cid in body.conversations_order}
        state.conv_tuple = None
    if body.metrics:
        state.metrics = _make_numbers(EngineMetrics, _METRIC_FIELDS, body.metrics, state.metrics)
    if body.memory is not UNSET:
        if body.memory is None:
            state.memory = None
        elif state.memory is None:
            state.memory = _make_numbers(MemoryStats, _MEMORY_FIELDS, body.memory)
        elif body.memory:
            state.memory = _make_numbers(MemoryStats, _MEMORY_FIELDS, body.memory, state.memory)
    state.seq, state.step_id, state.version = head.seq, head.step_id, body.version
    state.snap = None


def _build(state: _State) -> PoolSnapshot:
    _flush(state)
    arrays = {}
    for name, a in state.work.items():
        f = state.frozen[name]
        if f is None:
            f = a.copy()
            f.setflags(write=False)
            state.frozen[name] = f
        arrays[name] = f
    if state.tables_view is None:
        state.tables_view = MappingProxyType(dict(state.tables))
    if state.conv_tuple is None:
        objs = state.conv_objs
        out = []
        for cid, vals in state.convs.items():
            info = objs.get(cid)
            if info is None:
                for i, v in enumerate(vals):
                    if type(v) is list:  # a token field patched since the last build: a tuple again until the next
                        vals[i] = _ints(v)
                info = ConversationInfo(*vals)
                objs[cid] = info
            out.append(info)
        state.conv_tuple = tuple(out)
    h = state.header
    return PoolSnapshot(
        step_id=state.step_id, block_size=h.block_size, num_blocks=h.num_blocks, ref_count=arrays["ref_count"],
        num_filled=arrays["num_filled"], state=arrays["state"], owner=arrays["owner"],
        last_access=arrays["last_access"], block_tables=state.tables_view, conversations=state.conv_tuple,
        metrics=state.metrics, memory=state.memory, model_name=h.model_name, max_model_len=h.max_model_len,
        device=h.device, block_hash=arrays.get("block_hash"), version=state.version, source=h.source)


def __getattr__(name: str):
    if name == "History":  # docs/architecture.md's API names it here; it lives in its own file (history.py)
        from .history import History
        return History
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FORMAT_VERSION", "MAGIC", "StreamError", "Frame", "FrameHead", "Header", "Keyframe", "Delta",
           "StreamEncoder", "StreamDecoder", "History", "read_head", "frame_from_payload", "frame_of",
           "encode_keyframe"]
