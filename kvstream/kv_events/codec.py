"""vLLM-format KV events on the wire: the event structs, the batch, and a lenient decoder.

What vLLM (>= 0.26) and SGLang publish so that a KV-aware router (Dynamo, llm-d) can tell which prefixes each
instance holds: ``BlockStored`` when full blocks get a prefix hash, ``BlockRemoved`` when a hashed block's KV is
dropped, ``AllBlocksCleared`` when the prefix cache is reset. A batch is the msgpack array
``[ts, events, data_parallel_rank]``; each event a map with a ``"type"`` tag.

The structs mirror vLLM 0.34's field for field and option for option (0.32 is the same less ``lookahead_token_ids``;
with ``omit_defaults`` an event that leaves the newer fields at None is the same bytes in both), so
:func:`encode_batch` writes the bytes vLLM writes (the tests decode them with vLLM's own decoder). Reading is
lenient, because servers in the field differ:

- events as maps (vLLM, SGLang >= 0.5.15) or as the older tagged arrays ``["BlockStored", hashes, parent, ...]``
  (vLLM before map encoding, SGLang <= 0.5.14);
- hashes as integers (uint64, or SGLang's signed int64) or as bytes (vLLM's 32-byte SHA-256 digests);
- vLLM's batch (``data_parallel_rank``), SGLang's (``attn_dp_rank``, same position) and SGLang 0.4's two-element
  ``[ts, events]``; optional fields left out; fields this module does not know are ignored;
- event types this module does not know are skipped and counted, not fatal;
- the offloading connector's hash-only placeholders (``token_ids`` empty, ``block_size`` 0) and Mamba groups'
  single-hash state checkpoints (``token_ids`` empty, ``block_size`` kept) are events like any other;
- every medium spelling: vLLM's "GPU", "CPU", "STORAGE" and SGLang's "CPU_PINNED", "DISK", "EXTERNAL"
  (:func:`medium_tier` says which tier each is).

:func:`decode_batch_report` (what the subscriber uses) keeps a batch whose single events are odd (a wrong type in
one field, an empty hash): it drops those events, counts them and says why, and keeps the rest, because one odd
event must not hide the blocks its neighbours describe. :func:`decode_batch` is the strict form for callers that
want all or nothing.

Anything else (not msgpack, wrong shapes, wrong types) raises :class:`KVEventDecodeError`, a ``ValueError``, with a
message that says where, so a subscriber can count the message and go on.

msgspec only (as vLLM): no torch, no Qt, no hand-written msgpack.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence, Union

import msgspec

# A block's prefix hash as published: an integer (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default, is
# uint64; SGLang's are int64 and may be negative) or the raw digest bytes (vLLM's SHA-256: 32 bytes).
BlockHash = Union[int, bytes]

MEDIUM_GPU = "GPU"  # vLLM's medium for its own block pool
MEDIUM_CPU = "CPU"  # vLLM's offloading tier (SGLang says "CPU_PINNED")
MEDIUM_STORAGE = "STORAGE"  # vLLM's storage offloading tier, files (SGLang says "DISK")
TIERS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)  # the tiers DESIGN.md's stored_hashes_by_medium counts

# Every spelling a publisher uses -> the tier it counts as. SGLang's StorageMedium: GPU (L1), CPU_PINNED (L2), DISK
# (L3), EXTERNAL (L4, a shared remote pool: a tier of its own, not one of ours).
_TIER_OF = {"GPU": MEDIUM_GPU, "CPU": MEDIUM_CPU, "CPU_PINNED": MEDIUM_CPU, "STORAGE": MEDIUM_STORAGE,
            "DISK": MEDIUM_STORAGE}


def medium_tier(medium: str | None) -> str | None:
    """The tier a published medium counts as: "GPU", "CPU" (also SGLang's "CPU_PINNED"), "STORAGE" (also SGLang's
    "DISK"); any other spelling is its own tier (upper-cased); None stays None (the publisher did not say)."""
    if medium is None:
        return None
    return _TIER_OF.get(medium.upper(), medium.upper())

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
    one's is ``parent_block_hash`` (None at the start of a sequence). Field order and defaults are vLLM 0.34's.

    Hash-only forms (:attr:`is_placeholder`): the offloading connector's legacy placeholder (one hash, no tokens,
    ``block_size`` 0, no parent) and a Mamba group's state checkpoint (one hash and its parent, no tokens,
    ``kv_cache_spec_kind`` "mamba"). They say where a block's KV lives, not what it holds."""

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
    # vLLM 0.34: tokens beyond each block that its hash covers, one list per block_hashes entry (lookahead hashing)
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    # (SGLang's cache_salt is read and ignored: its hashes are already namespaced by it.)

    @property
    def is_placeholder(self) -> bool:
        """Hashes without their tokens (offloading placeholders, Mamba checkpoints): content must come from
        elsewhere (the same hash stored with tokens on another tier), or is not known."""
        return not self.token_ids


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
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise KVEventError(f"ts must be a finite number of seconds, not {ts!r}")
    if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool)
                                           or not isinstance(data_parallel_rank, int) or data_parallel_rank < 0):
        raise KVEventError(f"data_parallel_rank must be a non-negative int or None, not {data_parallel_rank!r}")
    return KVEventBatch(ts=float(ts), events=events, data_parallel_rank=data_parallel_rank)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack bytes of ``batch``, exactly as vLLM 0.32's publisher encodes the same batch."""
    return _encoder.encode(batch)


@dataclass(frozen=True)
class DecodeReport:
    """What :func:`decode_batch_report` made of one payload: the batch (odd events left out) and what it skipped."""

    batch: KVEventBatch  # the events that could be read, in order
    unknown: int  # events of a type this module does not know (a newer publisher), skipped
    odd: tuple[str, ...]  # one line per event dropped because it could not be read ("event 3 (BlockStored): ...")


def decode_batch(payload: bytes) -> KVEventBatch:
    """Read one batch in any form listed in the module docstring; unknown event types are dropped.

    Raises :class:`KVEventDecodeError` if ``payload`` is not a batch, or if any event in it is odd (all or
    nothing; :func:`decode_batch_report` keeps the rest)."""
    return decode_batch_counted(payload)[0]


def decode_batch_counted(payload: bytes) -> tuple[KVEventBatch, int]:
    """:func:`decode_batch`, plus how many events of an unknown type it skipped."""
    report = decode_batch_report(payload)
    if report.odd:
        raise KVEventDecodeError(report.odd[0])
    return report.batch, report.unknown


def decode_batch_report(payload: bytes) -> DecodeReport:
    """Read one batch, keeping every event that can be read: odd events are dropped and said, not fatal.

    Raises :class:`KVEventDecodeError` only when ``payload`` is not a batch at all (not msgpack, not the array
    ``[ts, events, rank]``, a ts that is not a finite number, events that are not an array, a rank that is not an
    integer): then there is nothing to keep."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KVEventDecodeError(f"payload must be bytes, not {type(payload).__name__}")
    try:  # fast path: the current form (vLLM 0.32-0.34, SGLang >= 0.5.15), typed in one pass
        batch = _typed_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        batch = None
    if batch is not None:
        _check_ts(batch.ts)
        return _drop_odd(batch, 0, [])
    try:
        raw = _any_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    except RecursionError:  # msgspec follows nesting on the C stack up to Python's limit, then says so
        raise KVEventDecodeError("nested too deeply to be a KV-event batch") from None
    return _lenient_batch(raw)


def _check_ts(ts: Any) -> None:
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventDecodeError(f"batch ts must be a number; got {_what(ts)}")
    if not math.isfinite(ts):
        raise KVEventDecodeError(f"batch ts must be a finite number of seconds; got {ts!r}")


def _lenient_batch(raw: Any) -> DecodeReport:
    """A batch from the generic msgpack value, accepting every variant the module docstring lists."""
    if not isinstance(raw, list) or not 2 <= len(raw) <= 8:
        raise KVEventDecodeError(f"a batch is the array [ts, events, rank]; got {_what(raw)}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    _check_ts(ts)
    if not isinstance(events, list):
        raise KVEventDecodeError(f"batch events must be an array; got {_what(events)}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError(f"batch rank must be an integer or nil; got {_what(rank)}")
    out, unknown, odd = [], 0, []
    for i, item in enumerate(events):
        try:
            fields = _event_fields(item, i)
        except KVEventDecodeError as exc:
            odd.append(str(exc))
            continue
        if fields is None:
            unknown += 1
            continue
        try:
            out.append(msgspec.convert(fields, type=KVEvent))
        except msgspec.ValidationError as exc:
            odd.append(f"event {i} ({fields['type']}): {exc}")
    return _drop_odd(KVEventBatch(ts=float(ts), events=tuple(out), data_parallel_rank=rank), unknown, odd)


def _event_fields(item: Any, i: int) -> dict | None:
    """One event as a field map with its ``type`` (None for an unknown type), from a map or an old tagged array."""
    if isinstance(item, dict):
        kind = item.get("type")
        fields = {k: v for k, v in item.items() if isinstance(k, str)}  # a key that is not a name names nothing
    elif isinstance(item, list) and item:
        kind, fields = item[0], {}
        if isinstance(kind, str) and kind in _POSITIONAL:
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


def _drop_odd(batch: KVEventBatch, unknown: int, odd: list[str]) -> DecodeReport:
    """The batch without the events that break rules the types alone do not carry, and why each went."""
    keep, dropped = [], []
    for i, event in enumerate(batch.events):
        problem = _event_problem(event)
        if problem is None:
            keep.append(event)
        else:
            dropped.append(f"event {i} ({type(event).__name__}): {problem}")
    if dropped:
        batch = KVEventBatch(ts=batch.ts, events=tuple(keep), data_parallel_rank=batch.data_parallel_rank)
    return DecodeReport(batch=batch, unknown=unknown, odd=tuple(odd) + tuple(dropped))


def _event_problem(event: KVEvent) -> str | None:
    """Why ``event`` cannot be used, or None."""
    if isinstance(event, AllBlocksCleared):
        return None
    hashes = event.block_hashes
    if isinstance(event, BlockStored):
        hashes = hashes + (event.parent_block_hash,)
    for h in hashes:
        if isinstance(h, bytes) and not h:
            return "an empty byte string is not a block hash"
    if isinstance(event, BlockStored):
        if event.block_size < 0:
            return f"block_size must not be negative, got {event.block_size}"
        if event.block_size == 0 and event.token_ids:
            return "block_size must be positive when tokens are sent (0 is for hash-only placeholders)"
        if event.group_idx is not None and event.group_idx < 0:
            return f"group_idx must not be negative, got {event.group_idx}"
    elif event.group_idx is not None and event.group_idx < 0:
        return f"group_idx must not be negative, got {event.group_idx}"
    return None


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
