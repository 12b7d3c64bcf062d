"""The pool stream's decoder: messages in order -> exactly the snapshots the source had (:class:`StreamDecoder`).

Why a file of its own: it reads what other processes and files hand it, so everything here checks before it
changes anything (a message that does not check raises :class:`StreamError` and leaves the decoder as it was).
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
from types import MappingProxyType
from typing import Any, Mapping

import msgspec
import numpy as np
from msgspec import UNSET

from ..events import BlockEvent
from ..views import ConversationInfo, EngineMetrics, MemoryStats, PoolSnapshot
from .validate import (MAX_TOKEN_ID, TableCounts, check_conversation_values, check_number, check_outcomes,
                       check_size, check_snapshot, check_token_ids)
from .schema import (GROUP_ARRAY, TIER_ARRAYS, TIER_NAMES, WIRE_ARRAYS, _GROUPS_AT, _OUTCOMES_AT, _SOURCES_AT)
from ..views import KV_CACHE_DTYPES, KVCacheGroupInfo, TierView
from .schema import (_BLANK, _BLANK_CONV, _BODY_DECODER, _COMPUTED_AT, _CONV_NAMES, _CONV_VALUES, _DROP_AT, _DTYPES,
                     _ENVELOPE_DECODER, _ENVELOPE_NO_EVENTS_DECODER, _MAGIC_BYTES, _MEMORY_FIELDS, _METRIC_FIELDS,
                     _METRICS_ADDED, _OUT_AT, _PLAIN_AT, _SEQ_AT, _TABLE_AT, _TEXT_AT, _TEXT_OUT_AT, _VERSION_DECODER,
                     ARRAYS, FORMAT_VERSION, MAGIC, ArrayPatch, ConvPatch, Delta, Frame, FrameHead, Grown, Header,
                     Keyframe, Numbers, Packed, StreamError, _short, _why)


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
_UNTRACK_FROM = 16  # shorter tuples are left to the collector (64 made jumps cheaper, collections dearer: see
# docs/performance.md, "History decoding")


def _ints(values) -> tuple:
    """``tuple(values)`` (token or block ids: ints only), left out of the cycle collector's young generation.

    The collector tracks every new tuple and lets one of ints go only after walking it once in a collection. A
    history's checkpoints and rebuilt snapshots of a large pool hold millions of such ids after a few jumps, so the
    young collection that met them took longer than the jump itself. CPython untracks such tuples itself (they
    cannot be part of a cycle); this does it when they are made, on tuples of at least _UNTRACK_FROM ids (most of
    the tuples a jump makes, and nearly all of their ids), for a little more time in the jump and much shorter young
    collections (figures: docs/performance.md, "History decoding"). Only ever given ints: a tuple holding a container
    would then escape cycle collection."""
    out = tuple(values)
    if len(out) >= _UNTRACK_FROM and _UNTRACK is not None:
        _UNTRACK(out)
    return out



def read_head(payload: bytes, events: bool = True) -> FrameHead:
    """Decode a message's envelope (not its body); StreamError if it is not a pool-stream message of a known version.

    ``events=False`` leaves the events out (``()``), for a reader that has them already."""
    # this version's envelope is told by its first 9 bytes (array header, magic, version); the full peek parses the
    # whole message to skip what follows (costly for a large keyframe: docs/performance.md), so it runs only for
    # anything else
    if not (payload[:1] in _FIXARRAYS and payload[1:8] == _MAGIC_BYTES and payload[8:9] == _VERSION_BYTE):
        _check_version(payload)
    try:
        env = (_ENVELOPE_DECODER if events else _ENVELOPE_NO_EVENTS_DECODER).decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StreamError(f"malformed pool-stream message: {_why(exc)}") from None
    if env.seq < 0 or env.step_id < 0:
        raise StreamError(f"malformed pool-stream message: negative frame or step number ({env.seq}, {env.step_id})")
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


def _check_numbers(values: Numbers, fields: dict[str, type], what: str, complete: bool,
                   optional: frozenset = frozenset()) -> None:
    for name, value in values.items():
        kind = fields.get(name)
        if kind is None:
            raise StreamError(f"malformed pool-stream message: {what} has no field {name!r}")
        if kind is int and type(value) is not int:
            raise StreamError(f"malformed pool-stream message: {what}.{name} must be an integer, got {value!r}")
        check_number(what, name, value)
    if complete and len(values) != len(fields):
        missing = sorted(set(fields) - set(values) - optional)
        if not missing:
            return
        raise StreamError(f"malformed pool-stream message: {what} lacks {', '.join(missing)}")


def _make_numbers(cls, fields: dict[str, type], values: Numbers, old=None):
    typed = {k: (float(v) if fields[k] is float else v) for k, v in values.items()}
    return cls(**typed) if old is None else dataclasses.replace(old, **typed)


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
        if gaps.size > n:
            raise StreamError(f"malformed pool-stream message: {name} changes {gaps.size} entries of a pool of {n} "
                              "blocks")
        # every gap below n, before they are added up: an unsigned gap of 2**64 - 1 would wrap to -1 in int64 and
        # write the block before the one meant; with size <= n and gaps < n the sum stays far inside int64
        if gaps.size and (gaps.min() < 0 or gaps.max() >= n):
            raise StreamError(f"malformed pool-stream message: a gap in the indices of {name} is negative or past "
                              f"the pool's {n} blocks")
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


# ---- the decoder -----------------------------------------------------------------------------------------------
class _State:
    """Mutable decoded state of one stream, with the immutable pieces of the last snapshot built from it."""

    __slots__ = ("header", "stream_id", "seq", "step_id", "version", "dtypes", "work", "frozen", "tables",
                 "tables_view", "convs", "conv_objs", "conv_tuple", "metrics", "memory", "snap", "pending", "counts",
                 "dirty", "tier_work", "tier_frozen", "group_tables", "group_view")

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
        self.counts: TableCounts | None = None  # what the last check of a snapshot of this state saw
        self.dirty: list[np.ndarray] | None = None  # indices of the blocks changed since that check (None: any)
        self.tier_work: dict[str, np.ndarray] = {}  # "tier.array" -> writable per-slot array (format 2)
        self.tier_frozen: Any = None  # the tiers as of the last snapshot; None: stale
        self.group_tables: list[dict[int, tuple[int, ...]]] = []  # per KV cache group: conversation id -> ids
        self.group_view: tuple | None = None  # read-only views of group_tables as of the last snapshot; None: stale


def _check_table(cid: int, old: tuple | None, drop: int, tail: tuple, n: int) -> None:
    if drop < 0 or drop > (0 if old is None else len(old)):
        raise StreamError(f"malformed pool-stream message: block table of conversation {cid} drops {drop} entries "
                          f"of {0 if old is None else len(old)}")
    if tail and (min(tail) < -1 or max(tail) >= n):
        raise StreamError(f"malformed pool-stream message: block table of conversation {cid} names a block outside "
                          f"0..{n - 1}")


def _check_order(order: list[int], keys: list[int], what: str) -> None:
    if len(order) != len(keys) or set(order) != set(keys):
        raise StreamError(f"malformed pool-stream message: the {what} order does not list the {what}s it has")


def _check_gone(gone: list, held, seen: set, order, missing: str, what: str) -> None:
    """Check the ids a delta takes away (``gone``: each once, each ``held`` now, none also patched, which is
    ``seen``) and its new order of the rest (None: the order they have). ``missing``: what the refusal says the
    delta does ("removes block tables")."""
    gone_set = set(gone)
    if len(gone_set) != len(gone) or not gone_set.issubset(held) or gone_set & seen:
        raise StreamError(f"malformed pool-stream message: it {missing} that are not there")
    if order is not None:
        keys = [k for k in held if k not in gone_set] + [k for k in seen if k not in held]
        _check_order(order, keys, what)


def _check_conv(p: ConvPatch, old: list | None, n: int) -> tuple:
    """The patch's field values (UNSET where unchanged), checked against the conversation's values ``old``."""
    values = msgspec.structs.astuple(p)
    if old is None:
        if UNSET in values:
            missing = [_CONV_NAMES[i] for i in _CONV_VALUES if values[i] is UNSET and i not in (_GROUPS_AT,
                                                                                              _SOURCES_AT,
                                                                                              _OUTCOMES_AT)]
            if missing:
                raise StreamError(f"malformed pool-stream message: new conversation {p.conversation_id} lacks "
                                  f"{', '.join(missing)}")
            values = tuple(({} if i == _SOURCES_AT else ()) if v is UNSET else v  # format 1: no groups, no sources
                           for i, v in enumerate(values))
        drops = [i for i in _DROP_AT if values[i][0]]
    else:
        drops = [i for i in _DROP_AT if values[i] is not UNSET and values[i][0] > len(old[i])]
    if drops:
        i = drops[0]
        raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id} drops {values[i][0]} "
                          f"of {0 if old is None else len(old[i])} {_CONV_NAMES[i]}")
    table = values[_TABLE_AT]
    if table is not UNSET and table[1] and (min(table[1]) < -1 or max(table[1]) >= n):
        raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id} names a block outside "
                          f"0..{n - 1}")
    for i in _TOKENS_AT:
        if values[i] is not UNSET:
            check_token_ids(values[i][1], p.conversation_id, _CONV_NAMES[i].split("_")[0])
    check_conversation_values(p.conversation_id, {_CONV_NAMES[i]: values[i] for i in _PLAIN_AT
                                                  if values[i] is not UNSET and values[i] is not None
                                                  and i not in (_GROUPS_AT, _SOURCES_AT, _OUTCOMES_AT)})
    if values[_OUTCOMES_AT] is not UNSET:
        check_outcomes(p.conversation_id, values[_OUTCOMES_AT])
    groups = values[_GROUPS_AT]
    if groups is not UNSET and any(t and (min(t) < -1 or max(t) >= n) for t in groups):
        raise StreamError(f"malformed pool-stream message: conversation {p.conversation_id}'s group tables name a "
                          f"block outside 0..{n - 1}")
    return values


_NO_BLOCKS = np.zeros(0, np.int64)
_TOKENS_AT = tuple(i for i in _SEQ_AT if i != _TABLE_AT)  # positions of the token id tuples (prompt, output)


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
    (seq - 1, same stream); a keyframe may come at any time and resets the state (a resync after a gap).

    Every snapshot it builds must also describe a pool that can exist (:mod:`.validate`); one that does not raises
    StreamError naming the rule, is never returned, and leaves the decoder waiting for a keyframe (what it followed
    cannot be trusted)."""

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
            # change, so a copy touches only the rows patched since the last one: a deep copy of every row cost
            # more than a delta's decode (docs/performance.md), and checkpoints are made every 8 frames of a scrub back.
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
            new.tier_work = {k: a.copy() for k, a in state.tier_work.items()}
            new.tier_frozen = state.tier_frozen
            new.group_tables = [dict(g) for g in state.group_tables]
            new.group_view = state.group_view
            out._state = new
        return out

    def snapshot(self) -> PoolSnapshot:
        """The snapshot of the current state (built once per state; shares unchanged pieces with the one before)."""
        state = self._state
        if state is None:
            raise StreamError("no keyframe decoded yet: there is no snapshot")
        if state.snap is None:
            snap = _build(state)
            dirty = state.dirty
            changed = None if dirty is None else np.concatenate(dirty) if dirty else _NO_BLOCKS
            try:
                state.counts = check_snapshot(snap, state.counts, changed)
                state.dirty = []
            except StreamError as exc:
                self._state = None  # what it followed cannot be trusted: wait for a keyframe
                raise StreamError(f"frame {state.seq} refused: {exc}; waiting for a keyframe") from None
            state.snap = snap
        return state.snap


def _keyframe_state(head: FrameHead, body: Keyframe) -> _State:
    h = body.header
    check_size(h.num_blocks, h.block_size, h.max_model_len)  # before the arrays are allocated
    missing = [name for name in ARRAYS[:-1] if name not in h.dtypes]
    unknown = [name for name in h.dtypes if name not in WIRE_ARRAYS]
    bad = [d for d in h.dtypes.values() if d not in _DTYPES]
    if missing or unknown or bad:
        raise StreamError(f"malformed pool-stream message: header dtypes {_short(h.dtypes)}")
    if h.kv_cache_dtype and h.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise StreamError(f"malformed pool-stream message: kv_cache_dtype {_short(h.kv_cache_dtype)}")
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
    _check_header_v2(h)
    for tier, spec in h.tiers.items():
        for name in TIER_ARRAYS:
            dtype = np.dtype(spec.dtypes[name])
            a = np.zeros(spec.num_blocks, dtype)
            patch = body.tiers.get(tier, {}).get(name)
            if patch is not None:
                index, values = _read_patch(patch, f"{tier}.{name}", spec.num_blocks, dtype)
                if index is None:
                    a[:] = values
                else:
                    a[index] = values
            state.tier_work[f"{tier}.{name}"] = a
    if set(body.tiers) - set(h.tiers) or any(set(p) - set(TIER_ARRAYS) for p in body.tiers.values()):
        raise StreamError("malformed pool-stream message: keyframe has tier arrays the header lacks")
    if len(body.group_tables) != h.group_tables:
        raise StreamError(f"malformed pool-stream message: keyframe has {len(body.group_tables)} group table sets, "
                          f"the header says {h.group_tables}")
    for g, patches in enumerate(body.group_tables):
        tables = {}
        for t in patches:
            if t.drop != 0 or t.conversation_id in tables:
                raise StreamError(f"malformed pool-stream message: keyframe group {g} table of conversation "
                                  f"{t.conversation_id} is repeated or not whole")
            _check_table(t.conversation_id, None, 0, t.tail, n)
            tables[t.conversation_id] = _ints(t.tail)
        state.group_tables.append(tables)
    _check_numbers(body.metrics, _METRIC_FIELDS, "metrics", True, _METRICS_ADDED)
    state.metrics = _make_numbers(EngineMetrics, _METRIC_FIELDS, body.metrics)
    if body.memory is not None:
        _check_numbers(body.memory, _MEMORY_FIELDS, "memory", True)
        state.memory = _make_numbers(MemoryStats, _MEMORY_FIELDS, body.memory)
    state.seq, state.step_id, state.version = head.seq, head.step_id, body.version
    return state


def _check_header_v2(h: Header) -> None:
    """The format-2 parts of a header: groups, their table count, tiers."""
    for g in h.groups:
        if g.kind not in ("full_attention", "sliding_window") or \
                (g.sliding_window is None) != (g.kind == "full_attention") or \
                (g.sliding_window is not None and g.sliding_window < 1) or any(x < 0 for x in g.layers):
            raise StreamError(f"malformed pool-stream message: KV cache group {_short(g)}")
    if h.group_tables not in (0, len(h.groups)):
        raise StreamError(f"malformed pool-stream message: {h.group_tables} group table sets for "
                          f"{len(h.groups)} groups")
    for tier, spec in h.tiers.items():
        if tier not in TIER_NAMES or spec.num_blocks < 0 or set(spec.dtypes) != set(TIER_ARRAYS) or \
                any(d not in _DTYPES for d in spec.dtypes.values()):
            raise StreamError(f"malformed pool-stream message: tier {_short(tier)} {_short(spec)}")
        check_size(spec.num_blocks, h.block_size, h.max_model_len)


def _check_delta(state: _State, body: Delta) -> tuple[list, list]:
    """Everything that could be wrong with ``body``; returns the decoded array and conversation patches."""
    n = state.header.num_blocks
    arrays = []
    for name, patch in body.arrays.items():
        dtype = state.dtypes.get(name)
        if dtype is None:
            raise StreamError(f"malformed pool-stream message: delta changes {_short(name)}, which this pool lacks")
        arrays.append((name, *_read_patch(patch, name, n, dtype)))
    for tier, patches in body.tiers.items():
        spec = state.header.tiers.get(tier)
        if spec is None or set(patches) - set(TIER_ARRAYS):
            raise StreamError(f"malformed pool-stream message: delta changes tier {_short(tier)}, which this pool "
                              "lacks")
        for name, patch in patches.items():
            key = f"{tier}.{name}"
            arrays.append((key, *_read_patch(patch, key, spec.num_blocks, state.tier_work[key].dtype)))
    if body.group_tables:
        if len(body.group_tables) != len(state.group_tables):
            raise StreamError("malformed pool-stream message: delta patches a different number of group table sets")
        for g, (gt, tables) in enumerate(zip(body.group_tables, state.group_tables)):
            seen = set()
            for t in gt.tables:
                if t.conversation_id in seen:
                    raise StreamError(f"malformed pool-stream message: group {g} table of {t.conversation_id} "
                                      "patched twice")
                seen.add(t.conversation_id)
                _check_table(t.conversation_id, tables.get(t.conversation_id), t.drop, t.tail, n)
            _check_gone(gt.removed, tables, seen, gt.order, f"removes group {g} tables", "group table")
    tables = state.tables
    seen = set()
    for t in body.tables:
        if t.conversation_id in seen:
            raise StreamError(f"malformed pool-stream message: block table of {t.conversation_id} patched twice")
        seen.add(t.conversation_id)
        _check_table(t.conversation_id, tables.get(t.conversation_id), t.drop, t.tail, n)
    _check_gone(body.tables_removed, tables, seen, body.tables_order, "removes block tables", "block table")
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
    _check_gone(body.conversations_dropped, convs, seen, body.conversations_order, "drops conversations",
                "conversation")
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
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise StreamError(f"impossible pool (token ids): a grown conversation has output token id {bad}")
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
    if least(computed) < 0:
        raise StreamError(f"impossible pool (num_computed_tokens): a grown conversation has {least(computed)}")
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
    dirty = state.dirty
    for name, index, values in arrays:
        if "." in name:  # a tier's array
            a = state.tier_work[name]
            if index is None:
                a[:] = values
            else:
                a[index] = values
            state.tier_frozen = None
            continue
        a = state.work[name]
        if index is None:
            a[:] = values
            dirty = None
        else:
            a[index] = values
            if dirty is not None:
                dirty.append(index)
        state.frozen[name] = None
    state.dirty = dirty
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
    for g, gt in enumerate(body.group_tables):
        tables = state.group_tables[g]
        for cid in gt.removed:
            del tables[cid]
        for t in gt.tables:
            old = tables.get(t.conversation_id)
            tables[t.conversation_id] = _ints(t.tail) if old is None else \
                _ints((old[:len(old) - t.drop] if t.drop else old) + t.tail)
        if gt.order is not None:
            state.group_tables[g] = {cid: tables[cid] for cid in gt.order}
        state.group_view = None
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
                vals[_SOURCES_AT] = {}
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
    if state.tier_frozen is None:
        tiers = {}
        for tier, spec in h.tiers.items():
            parts = []
            for name in TIER_ARRAYS:
                f = state.tier_work[f"{tier}.{name}"].copy()
                f.setflags(write=False)
                parts.append(f)
            tiers[tier] = TierView(spec.num_blocks, *parts)
        state.tier_frozen = MappingProxyType(tiers)
    if state.group_view is None:
        state.group_view = tuple(MappingProxyType(dict(g)) for g in state.group_tables)
    return PoolSnapshot(
        step_id=state.step_id, block_size=h.block_size, num_blocks=h.num_blocks, ref_count=arrays["ref_count"],
        num_filled=arrays["num_filled"], state=arrays["state"], owner=arrays["owner"],
        last_access=arrays["last_access"], block_tables=state.tables_view, conversations=state.conv_tuple,
        metrics=state.metrics, memory=state.memory, model_name=h.model_name, max_model_len=h.max_model_len,
        device=h.device, block_hash=arrays.get("block_hash"), version=state.version, source=h.source,
        kv_cache_groups=tuple(KVCacheGroupInfo(g.kind, g.sliding_window, tuple(g.layers)) for g in h.groups),
        group_block_tables=state.group_view, block_group=arrays.get(GROUP_ARRAY), tiers=state.tier_frozen,
        tokenizer=h.tokenizer, kv_cache_dtype=h.kv_cache_dtype)
