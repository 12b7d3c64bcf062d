"""vLLM-format KV events on the wire: the event structs, the batch, and a lenient decoder.

What vLLM (>= 0.26) and SGLang publish so that a KV-aware router (Dynamo, llm-d) can tell which prefixes each
instance holds: ``BlockStored`` when full blocks get a prefix hash, ``BlockRemoved`` when a hashed block's KV is
dropped, ``AllBlocksCleared`` when the prefix cache is reset. A batch is the msgpack array
``[ts, events, data_parallel_rank]``; each event a map with a ``"type"`` tag.

The structs mirror vLLM 0.32's field for field and option for option, so :func:`encode_batch` writes the bytes vLLM
writes (the tests decode them with vLLM's own decoder). Reading is lenient, because servers in the field differ:

- events as maps (vLLM, SGLang >= 0.5.15) or as the older tagged arrays ``["BlockStored", hashes, parent, ...]``
  (vLLM before map encoding, SGLang <= 0.5.14);
- hashes as integers (uint64, or SGLang's signed int64) or as bytes (vLLM's 32-byte SHA-256 digests);
- vLLM's batch (``data_parallel_rank``), SGLang's (``attn_dp_rank``, same position) and SGLang 0.4's two-element
  ``[ts, events]``; optional fields left out; fields this module does not know are ignored;
- event types this module does not know are skipped and counted, not fatal.

Anything else (not msgpack, wrong shapes, wrong types) raises :class:`KVEventDecodeError`, a ``ValueError``, with a
message that says where, so a subscriber can count the message and go on.

msgspec only (as vLLM): no torch, no Qt, no hand-written msgpack.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import msgspec

# A block's prefix hash as published: an integer (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default, is
# uint64; SGLang's are int64 and may be negative) or the raw digest bytes (vLLM's SHA-256: 32 bytes).
BlockHash = Union[int, bytes]

MEDIUM_GPU = "GPU"  # vLLM's medium for its own block pool
MEDIUM_CPU = "CPU"  # vLLM's offloading tier (SGLang says "CPU_PINNED")

# Replay socket end marker: the sequence number -1 as 8 signed big-endian bytes (vLLM's END_SEQ).
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventError(ValueError):
    """Bad input to the KV-event codec or publisher; nothing was changed or sent."""


class KVEventDecodeError(KVEventError):
    """A received message is not a KV-event batch this module can read (it says where it went wrong).

    Subscribers count it and skip the message; it is never fatal."""


class KVCacheEvent(msgspec.Struct, frozen=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three event kinds: a msgpack map whose ``"type"`` key is the class name (vLLM's options)."""


class BlockStored(KVCacheEvent, frozen=True):
    """Consecutive full blocks of one request got prefix hashes: a later request with that prefix can reuse them.

    ``token_ids`` holds ``block_size`` tokens per hash, back to back; block i's parent is block i - 1, the first
    one's is ``parent_block_hash`` (None at the start of a sequence). Field order and defaults are vLLM 0.32's."""

    block_hashes: tuple[BlockHash, ...]  # one prefix hash per stored block, in sequence order
    parent_block_hash: BlockHash | None  # hash of the block before block_hashes[0]; None for a sequence's first
    token_ids: tuple[int, ...]  # the blocks' tokens back to back (block_size per block)
    block_size: int  # tokens per block (vLLM's partial-prefix entries carry their own, shorter size)
    lora_id: int | None  # deprecated by vLLM in favour of lora_name; still always sent
    medium: str | None  # where the KV lives: "GPU", "CPU", ...; None when the publisher does not say
    lora_name: str | None  # LoRA adapter the hash is keyed by; None for the base model
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # vLLM: per-block extra hash keys (mm, salt)
    group_idx: int | None = None  # vLLM: KV-cache group (hybrid models have several)
    kv_cache_spec_kind: str | None = None  # vLLM: kind of the group's cache spec ("full_attention", ...)
    kv_cache_spec_sliding_window: int | None = None  # vLLM: the group's sliding window, if any
    locality: str | None = None  # vLLM: "LOCAL" or "REMOTE" relative to the publisher
    ownership: str | None = None  # vLLM: secondary offloading tier that generated it
    session_id: str | None = None  # vLLM / SGLang: session whose request triggered the store (attribution only)
    # No more fields: at 15 map entries msgspec switches from a fixmap to a map16 header, and the bytes would no
    # longer be vLLM's. (SGLang's cache_salt is read and ignored: its hashes are already namespaced by it.)


class BlockRemoved(KVCacheEvent, frozen=True):
    """Hashed blocks lost their KV (evicted, or dropped from a tier): the prefix is no longer cached there."""

    block_hashes: tuple[BlockHash, ...]  # the removed blocks' prefix hashes
    medium: str | None  # the tier they left; None when the publisher does not say
    group_idx: int | None = None  # vLLM: KV-cache group
    locality: str | None = None  # vLLM: "LOCAL" or "REMOTE"
    ownership: str | None = None  # vLLM: secondary offloading tier


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The prefix cache was reset: every stored hash of this instance is gone."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """One publish: the events of one engine step, as the array ``[ts, events, data_parallel_rank]``.

    SGLang's third element is ``attn_dp_rank``; it lands in ``data_parallel_rank``."""

    ts: float  # publisher's wall-clock time of the batch (seconds since the epoch)
    events: tuple[KVEvent, ...]  # in the order they happened
    data_parallel_rank: int | None = None  # rank of the publishing engine (vLLM DP / SGLang attention-DP)


_encoder = msgspec.msgpack.Encoder()
_typed_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_any_decoder = msgspec.msgpack.Decoder()

# Fields an old array-encoded event lists after its tag, in order (the prefix of each class's fields).
_POSITIONAL = {name: cls.__struct_fields__ for name, cls in EVENT_TYPES.items()}
# Fields without a default that an event may leave out: they read as None.
_NULLABLE_REQUIRED = {"BlockStored": ("parent_block_hash", "lora_id", "medium", "lora_name"),
                      "BlockRemoved": ("medium",), "AllBlocksCleared": ()}


def make_batch(events: Sequence[KVEvent], ts: float, data_parallel_rank: int | None = None) -> KVEventBatch:
    """A batch of ``events``, checked: every one must be one of the three event structs."""
    events = tuple(events)
    for i, event in enumerate(events):
        if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
            raise KVEventError(f"event {i} is a {type(event).__name__}, not BlockStored, BlockRemoved or "
                               f"AllBlocksCleared")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventError(f"ts must be a number of seconds, not {ts!r}")
    if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool)
                                           or not isinstance(data_parallel_rank, int) or data_parallel_rank < 0):
        raise KVEventError(f"data_parallel_rank must be a non-negative int or None, not {data_parallel_rank!r}")
    return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch``, exactly as vLLM 0.32's publisher encodes the same batch."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read one batch in any form listed in the module docstring; unknown event types are dropped.

    Raises :class:`KVEventDecodeError` if ``payload`` is not a batch."""
    return decode_batch_counted(payload)[0]


def decode_batch_counted(payload: bytes) -> tuple[KVEventBatch, int]:
    """:func:`decode_batch`, plus how many events of an unknown type it skipped."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KVEventDecodeError(f"payload must be bytes, not {type(payload).__name__}")
    try:  # fast path: the current form (vLLM 0.32, SGLang >= 0.5.15), typed in one pass
        batch = _typed_decoder.decode(payload)
    except msgspec.DecodeError:
        batch = None
    if batch is not None:
        _check(batch)
        return batch, 0
    try:
        raw = _any_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    return _lenient_batch(raw)


def _lenient_batch(raw: Any) -> tuple[KVEventBatch, int]:
    """A batch from the generic msgpack value, accepting every variant the module docstring lists."""
    if not isinstance(raw, list) or not 2 <= len(raw) <= 8:
        raise KVEventDecodeError(f"a batch is the array [ts, events, rank]; got {_what(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch ts must be a number; got {_what(ts)}")
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events must be an array; got {_what(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError(f"batch rank must be an integer or nil; got {_what(rank)}")
    out, unknown = [], 0
    for i, item in enumerate(events):
        fields = _event_fields(item, i)
        if fields is None:
            unknown += 1
            continue
        try:
            out.append(msgspec.convert(fields, type=KVEvent))
        except msgspec.ValidationError as exc:
            raise KVEventDecodeError(f"event {i} ({fields['type']}): {exc}") from None
    batch = KVEventBatch(ts=float(ts), events=tuple(out), data_parallel_rank=rank)
    _check(batch)
    return batch, unknown


def _event_fields(item: Any, i: int) -> dict | None:
    """One event as a field map with its ``type`` (None for an unknown type), from a map or an old tagged array."""
    if isinstance(item, dict):
        kind = item.get("type")
        fields = dict(item)
    elif isinstance(item, list) and item:
        kind, fields = item[0], {}
        if kind in _POSITIONAL:
            names = _POSITIONAL[kind]
            fields = dict(zip(names, item[1:1 + len(names)]))
            fields["type"] = kind
    else:
        raise KVEventDecodeError(f"event {i} must be a map or a tagged array; got {_what(item)}")
    if not isinstance(kind, str):
        raise KVEventDecodeError(f"event {i} has no string type tag; got {_what(kind)}")
    if kind not in EVENT_TYPES:
        return None
    for name in _NULLABLE_REQUIRED[kind]:
        fields.setdefault(name, None)
    return fields


def _check(batch: KVEventBatch) -> None:
    """Rules the types alone do not carry."""
    for i, event in enumerate(batch.events):
        if isinstance(event, AllBlocksCleared):
            continue
        for h in event.block_hashes + ((event.parent_block_hash,) if isinstance(event, BlockStored) else ()):
            if isinstance(h, bytes) and not h:
                raise KVEventDecodeError(f"event {i}: an empty byte string is not a block hash")
        if isinstance(event, BlockStored) and event.block_hashes and event.block_size <= 0:
            raise KVEventDecodeError(f"event {i}: block_size must be positive, got {event.block_size}")


def _what(value: Any) -> str:
    """A short description of a wrong value for an error message."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def seq_bytes(seq: int) -> bytes:
    """A sequence number as the wire's 8 big-endian bytes."""
    return seq.to_bytes(8, "big")


def parse_frames(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """``(topic, seq, payload)`` of one multipart message ``[topic, 8-byte big-endian seq, payload]``."""
    if len(frames) != 3:
        raise KVEventDecodeError(f"a KV-event message has 3 frames [topic, seq, payload]; got {len(frames)}")
    topic, seq, payload = (bytes(f) for f in frames)
    if len(seq) != 8:
        raise KVEventDecodeError(f"the sequence frame must be 8 bytes; got {len(seq)}")
    return topic, int.from_bytes(seq, "big"), payload
