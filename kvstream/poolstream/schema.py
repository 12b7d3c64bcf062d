"""The pool stream's wire schema: the message structs, the envelope, :class:`Frame` and :class:`StreamError`.

Why a file of its own: the encoder and the decoder (and the validator, and the tools that read recordings from
their own scripts) must agree on one definition of every field; ``docs/poolstream.md`` documents them.
"""
from __future__ import annotations

import dataclasses
import operator
import typing
from typing import Annotated, Any

import msgspec
import numpy as np
from msgspec import UNSET, Raw, UnsetType

from ..events import BlockEvent
from ..views import BLOCK_ARRAYS, BlockOutcome, ConversationInfo, EngineMetrics, FinishReason, MemoryStats, Status

# 2: tiers and KV cache groups (a version-1 message reads as a one-group pool without tiers)
FORMAT_VERSION = 2  # bumped whenever a reader of the previous version could misread a message
MAGIC = "kvpool"  # first element of every message: what tells a pool-stream message from any other msgpack
ARRAYS = BLOCK_ARRAYS  # the per-block arrays, in wire order
GROUP_ARRAY = "block_group"  # the optional per-block array of a pool with KV cache groups (format 2)
WIRE_ARRAYS = ARRAYS + (GROUP_ARRAY,)  # every per-block array a header may name
TIER_ARRAYS = ("state", "block_hash", "last_access")  # each tier's per-slot arrays, in wire order
TIER_NAMES = ("host", "disk")  # the tiers a pool may have, top down
_BLANK = {"owner": -1}  # value of each per-block array in an empty pool (0 where not listed): keyframes send the rest
# dtypes a per-block array, or its values on the wire, may have (little-endian; a foreign dtype is never built)
_DTYPES = frozenset({"|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8"})
_DTYPE_OK: dict[np.dtype, bool] = {}  # dtype -> in _DTYPES (the check runs six times a frame; remembered, it is free)
_NARROW_RANGES = tuple((np.dtype(d), int(np.iinfo(d).min), int(np.iinfo(d).max))  # smallest first: (dtype, min, max)
                       for d in ("|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8"))


Count = Annotated[int, msgspec.Meta(ge=0)]  # a count: negative ones are malformed


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


class GroupSpec(msgspec.Struct, array_like=True, frozen=True):
    """One KV cache group (KVCacheGroupInfo)."""

    kind: str  # "full_attention" | "sliding_window"
    sliding_window: int | None  # tokens a query reads back; None: all
    layers: tuple[int, ...]  # the model's layer indices in the group


class TierSpec(msgspec.Struct, array_like=True, frozen=True):
    """One lower tier: its size and the dtype of each of its per-slot arrays (TIER_ARRAYS)."""

    num_blocks: int
    dtypes: dict[str, str]


class Header(msgspec.Struct, frozen=True):
    """What a pool is: sent in every keyframe (a subscriber may start at any of them) and in a recording's header."""

    source: str  # what produced the stream: "engine", "vllm", ...
    num_blocks: int  # length of every per-block array
    block_size: int  # token slots per block
    model_name: str  # "builtin", a checkpoint directory or a served model name
    device: str  # where the KV cache lives: "cpu", "cuda:0", ...
    max_model_len: int  # most tokens in one conversation; 0: unknown
    dtypes: dict[str, str]  # numpy dtype of each per-block array (block_hash absent: the source sends no hashes)
    groups: tuple[GroupSpec, ...] = ()  # format 2: the KV cache groups (empty: a plain one-group pool)
    group_tables: int = 0  # format 2: how many per-group table sets the frames carry (0, or one per group)
    tiers: dict[str, TierSpec] = {}  # format 2: the lower tiers that are on, by name
    tokenizer: str = ""  # what turns the stream's token ids into text (PoolSnapshot.tokenizer); "": not said. Added
    # within format 2: a reader without the field skips it (a header is a map), and a header without it reads as ""
    kv_cache_dtype: str = ""  # what the pool stores K/V as (PoolSnapshot.kv_cache_dtype); added as tokenizer was


class TablePatch(msgspec.Struct, array_like=True, frozen=True):
    """One conversation's block table: drop ``drop`` ids from the end of the previous one, then append ``tail``."""

    conversation_id: int
    drop: Count  # ids removed from the end of the table the previous frame had (0 for a new table)
    tail: tuple[int, ...]  # physical block ids appended after the drop


class GroupTables(msgspec.Struct, array_like=True, frozen=True):
    """What changed in one KV cache group's block tables (entries may be -1: released by a sliding window)."""

    tables: list[TablePatch]  # tables that changed or appeared
    removed: list[int]  # conversations whose table in this group is gone
    order: list[int] | None  # the table order, when it is not (kept ones, then new ones)


SeqPatch = tuple[Count, tuple[int, ...]]  # (items dropped from the end, items appended): token ids, block ids
TextPatch = tuple[Count, str]  # (code points dropped from the end, text appended)
_SHORT = {  # wire key of each ConversationInfo field in a ConvPatch (one letter: 256 patches in a busy frame)
    "conversation_id": "i", "status": "s", "prompt_token_ids": "p", "output_token_ids": "o", "output_text": "x",
    "prompt_text": "q", "block_table": "b", "num_computed_tokens": "n", "num_cached_tokens": "c",
    "max_new_tokens": "m", "temperature": "t", "parent_id": "a", "num_preemptions": "r", "arrival_step": "w",
    "finish_reason": "f", "turns": "u", "label": "l", "group_block_tables": "g", "prompt_token_sources": "k",
    "prompt_block_outcomes": "y",
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
    prompt_token_sources: dict[str, int] | UnsetType = UNSET
    prompt_block_outcomes: tuple[BlockOutcome, ...] | UnsetType = UNSET


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
    tiers: dict[str, dict[str, ArrayPatch]] = {}  # format 2: each tier's arrays as patches of an empty tier (all 0)
    group_tables: list[list[TablePatch]] = []  # format 2: every group's tables (header.group_tables of them)


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
    tiers: dict[str, dict[str, ArrayPatch]] = {}  # format 2: changed slots of each tier's arrays
    group_tables: list[GroupTables] = []  # format 2: one per group when any group's tables changed; empty: none did


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
    decoder moving forward applies a delta instead of rebuilding everything (a large keyframe costs tens of times
    its bridge to decode: docs/performance.md, "History decoding"). Readers that predate bridges stop at ``body``."""

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


def check_frame(value, taker: str) -> None:
    """TypeError unless ``value`` is a Frame, saying what ``taker`` takes ("a publisher sends": "a publisher sends
    Frames, not dict"): every sink refuses anything else before it touches its file or socket."""
    if not isinstance(value, Frame):
        raise TypeError(f"{taker} Frames, not {type(value).__name__}")


class FrameHead(msgspec.Struct, frozen=True, gc=False):
    """A message's envelope without its body (cheap: what a reader needs to index a frame or skip a duplicate)."""

    stream_id: int
    seq: int
    step_id: int
    keyframe: bool
    events: tuple[BlockEvent, ...]
    body: Raw  # the undecoded body
    bridge: Raw = _NO_BRIDGE  # a keyframe's undecoded delta from frame seq - 1 (empty: none)


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
# metrics added after format 2 first shipped: a keyframe written before them lacks them (read as 0, which
# EngineMetrics.prompt_block_totals reads as "not counted")
_METRICS_ADDED = frozenset(name for name in _METRIC_FIELDS if name.startswith("prompt_blocks_"))
_MEMORY_FIELDS = _number_fields(MemoryStats)


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
_BLANK_CONV = tuple(() if k == _SEQ or n in ("group_block_tables", "prompt_block_outcomes") else "" if k == _TEXT
                    else None
                    for n, k in zip(_CONV_NAMES, _CONV_KINDS))
_SOURCES_AT = _CONV_NAMES.index("prompt_token_sources")  # a dict: blank is a fresh {} per conversation
_OUTCOMES_AT = _CONV_NAMES.index("prompt_block_outcomes")  # absent from streams written before it existed
_GROUPS_AT = _CONV_NAMES.index("group_block_tables")  # before a new one's patch
