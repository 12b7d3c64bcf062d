"""The pool stream's encoder: snapshots of one source -> keyframes and deltas (:class:`StreamEncoder`).

Why a file of its own: it runs on the producer's thread after every step (the engine, the vLLM plugin), so its cost
is the stream's cost; what it may assume about its input (the producer's promises) is documented in
``docs/poolstream.md``.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import msgspec
import numpy as np
from msgspec import UNSET

from ..events import BlockEvent
from ..views import NO_CHANGE_RECORD, ChangeRecord, ConversationInfo, PoolSnapshot
from .schema import (_BLANK, _CONV_KINDS, _CONV_NAMES, _DTYPE_OK, _DTYPES, _ENCODER, _MEMORY_FIELDS, _METRIC_FIELDS,
                     _NARROW_RANGES, _OUT_AT, _PLAIN_AT, _SEQ, _SEQ_AT, _TEXT, _TEXT_AT, ARRAYS, FORMAT_VERSION, MAGIC,
                     ArrayPatch, Body, ConvPatch, Delta, Frame, Grown, Header, Keyframe, Numbers, Packed, StreamError,
                     TablePatch, _BridgedEnvelope, _conv_values, _Envelope, _stable, _why, GROUP_ARRAY, TIER_ARRAYS,
                     WIRE_ARRAYS, GroupSpec, GroupTables, TierSpec, _GROUPS_AT, _SOURCES_AT)


def _plain(kind: type, value: Any) -> int | float:
    return float(value) if kind is float else int(value)


def _numbers(obj, fields: dict[str, type], old=None) -> Numbers:
    """Every field of ``obj`` (old None) or those that differ from ``old``."""
    if old is None:
        return {name: _plain(kind, getattr(obj, name)) for name, kind in fields.items()}
    return {name: _plain(kind, getattr(obj, name)) for name, kind in fields.items()
            if getattr(obj, name) != getattr(old, name)}


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
# is most of the cost of a few entries: docs/performance.md, "Pool-stream encoding")


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
    kw["prompt_token_sources"] = dict(info.prompt_token_sources)  # a Mapping (maybe read-only): msgpack takes dicts
    kw["group_block_tables"] = _wire_groups(info.group_block_tables)
    return ConvPatch(**kw)


def _wire_groups(tables: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """A conversation's group tables as the stream carries them: () for one group, whose table is block_table
    (ConversationInfo rebuilds it), so a plain pool's tables travel once."""
    return () if len(tables) == 1 else tuple(tuple(t) for t in tables)


def _diff_patch(old: ConversationInfo, new: ConversationInfo, grown: bool = False) -> ConvPatch | None:
    """``grown``: the producer's change record says new's outputs start with old's (ChangeRecord.output_prefixes)."""
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
            if i == _GROUPS_AT:
                if len(nv[i]) != 1 or len(ov[i]) != 1:  # one group's table moved with block_table above
                    kw[_CONV_NAMES[i]] = _wire_groups(nv[i])
            else:
                kw[_CONV_NAMES[i]] = dict(nv[i]) if i == _SOURCES_AT else nv[i]
    return ConvPatch(conversation_id=new.conversation_id, **kw)


def _header(snapshot: PoolSnapshot) -> Header:
    dtypes = {name: getattr(snapshot, name).dtype.str for name in ARRAYS[:-1]}
    if snapshot.block_hash is not None:
        dtypes["block_hash"] = snapshot.block_hash.dtype.str
    if snapshot.block_group is not None:
        dtypes[GROUP_ARRAY] = snapshot.block_group.dtype.str
    groups = tuple(GroupSpec(str(g.kind), None if g.sliding_window is None else int(g.sliding_window),
                             tuple(int(x) for x in g.layers)) for g in snapshot.kv_cache_groups)
    tiers = {}
    for name, tier in snapshot.tiers.items():
        for a in (tier.state, tier.block_hash, tier.last_access):
            if not isinstance(a, np.ndarray) or a.shape != (tier.num_blocks,):
                raise StreamError(f"tier {name!r}: every array must have num_blocks ({tier.num_blocks}) entries")
        tiers[str(name)] = TierSpec(int(tier.num_blocks), {n: getattr(tier, n).dtype.str for n in TIER_ARRAYS})
    return Header(str(snapshot.source), int(snapshot.num_blocks), int(snapshot.block_size), str(snapshot.model_name),
                  str(snapshot.device), int(snapshot.max_model_len), dtypes, groups,
                  len(snapshot.group_block_tables) if snapshot.carries_group_tables else 0, tiers,
                  tokenizer=str(snapshot.tokenizer), kv_cache_dtype=str(snapshot.kv_cache_dtype))


def _tier_arrays(snapshot: PoolSnapshot) -> dict[str, np.ndarray]:
    """Each tier's arrays, keyed "tier.array" (copies of writable ones: the encoder compares against them)."""
    out = {}
    for name, tier in snapshot.tiers.items():
        for n in TIER_ARRAYS:
            a = getattr(tier, n)
            out[f"{name}.{n}"] = a.copy() if a.flags.writeable else a
    return out


def _by_tier(patches: dict[str, ArrayPatch]) -> dict[str, dict[str, ArrayPatch]]:
    out: dict[str, dict[str, ArrayPatch]] = {}
    for key, patch in patches.items():
        tier, name = key.split(".", 1)
        out.setdefault(tier, {})[name] = patch
    return out


def _tables_delta(old_tables, new_tables) -> tuple[list, list, list | None]:
    """(patches, removed ids, order or None) from one set of block tables to the next."""
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
        return tables, [], None
    removed = [cid for cid in old_tables if cid not in new_tables]
    return tables, removed, _order_patch(old_tables.keys(), table_ids, set(removed))


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
        self._seq = -1  # seq of the last frame (the encoder's own count, or the producer's numbers it was given)
        self._since_key = 0  # frames since the last keyframe
        self._bytes_since_key = 0  # payload bytes of the deltas since the last keyframe
        self._prev: PoolSnapshot | None = None  # state of the last frame
        self._prev_arrays: dict[str, np.ndarray] = {}
        self._prev_tiers: dict[str, np.ndarray] = {}  # the last frame's tier arrays ("tier.array"), as compared
        self._prev_convs: dict[int, ConversationInfo] = {}
        self._prev_stable: dict[int, tuple] = {}  # conversation id -> _stable() of the last frame's (each made once)
        self._header: Header | None = None

    @property
    def last_seq(self) -> int:
        """seq of the last frame encoded (-1 before the first)."""
        return self._seq

    def encode(self, snapshot: PoolSnapshot, events: Sequence[BlockEvent] = (),
               changes: ChangeRecord | None = None, seq: int | None = None) -> Frame:
        """The next frame: ``snapshot`` plus the block events that led to it. ``changes``: what the producer knows
        changed since the snapshot before (None: nothing known, every block and conversation is compared). The
        frame's bytes are the same either way: the record only spares the comparisons.

        ``seq``: the frame's number as its producer counts its publications (the engine runner's
        :attr:`~kvstream.views.PoolUpdate.seq`, which the window's frames carry too), so that the stream is numbered
        once; None: the one after the last frame. A number past the next one (an update that was not encoded)
        starts a keyframe, since a reader cannot apply a delta across the frames missing."""
        if not isinstance(snapshot, PoolSnapshot):
            raise TypeError(f"encode() takes a PoolSnapshot, not {type(snapshot).__name__}")
        if seq is None:
            seq = self._seq + 1
        elif isinstance(seq, bool) or not isinstance(seq, int) or seq <= self._seq:
            raise ValueError(f"a frame's seq must be an int past the last frame's ({self._seq}), got {seq!r}")
        self._changes = NO_CHANGE_RECORD if changes is None else changes  # read by _delta_body
        events = tuple(events)
        for e in events:
            if not isinstance(e, BlockEvent):
                raise TypeError(f"events must be BlockEvents, got {type(e).__name__}")
        arrays = self._arrays(snapshot)
        tiers = _tier_arrays(snapshot) if snapshot.tiers else {}
        header = _header(snapshot)
        key = (self._prev is None or header != self._header or self._since_key + 1 >= self.keyframe_interval
               or self._bytes_since_key >= self.keyframe_after_bytes or seq != self._seq + 1)
        bridge = None
        if key:
            if self._prev is not None and header == self._header and seq == self._seq + 1:  # periodic: bridged
                bridge, stable, prev_convs = self._delta_body(snapshot, arrays, tiers)
            else:
                stable = {c.conversation_id: _stable(c) for c in snapshot.conversations}
                prev_convs = {c.conversation_id: c for c in snapshot.conversations}
            body = self._keyframe_body(snapshot, header, arrays)
        else:
            body, stable, prev_convs = self._delta_body(snapshot, arrays, tiers)
        self._changes = None  # it names the snapshot before: not kept past this frame
        frame = self._frame(seq, snapshot.step_id, key, events, body, bridge)
        self._seq = seq
        self._since_key = 0 if key else self._since_key + 1
        self._bytes_since_key = 0 if key else self._bytes_since_key + len(frame.payload)
        self._prev, self._prev_arrays, self._header = snapshot, arrays, header
        self._prev_tiers = tiers
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
        for name in WIRE_ARRAYS:
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
        tier_patches = {}
        for key, a in _tier_arrays(snapshot).items():
            index = np.flatnonzero(a != 0)  # [non-blank]
            if index.size:
                dense = index.size * 4 > a.size
                tier_patches[key] = _patch(a if dense else a[index], None if dense else index)
        group_tables = [[TablePatch(int(cid), 0, tuple(t)) for cid, t in g.items()]
                        for g in snapshot.group_block_tables] if snapshot.carries_group_tables else []
        return Keyframe(header, int(snapshot.version), patches, tables,
                        [_full_patch(c) for c in snapshot.conversations],
                        _numbers(snapshot.metrics, _METRIC_FIELDS), memory, _by_tier(tier_patches), group_tables)

    def _delta_body(self, snapshot: PoolSnapshot, arrays: dict[str, np.ndarray], tiers: dict[str, np.ndarray]) \
            -> tuple[Delta, dict[int, tuple], dict[int, ConversationInfo]]:
        """The delta from the last frame to ``snapshot``, and ``_stable()`` of each of its conversations and the
        conversations by id."""
        prev = self._prev
        patches = {}
        changes = self._changes  # the producer's record of the blocks that may have changed since prev
        masks = changes.block_masks if changes.base is prev else None
        maybes: dict[int, np.ndarray] = {}  # id(mask) -> its blocks (arrays share masks)
        for name, a in arrays.items():
            b = self._prev_arrays[name]
            if a is b:
                continue
            if masks is None or name not in masks:
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
        tables, removed, order = _tables_delta(prev.block_tables, snapshot.block_tables)
        # conversations: the ones that only grew go in columns, the others as patches. This loop runs for every
        # conversation of every frame: plain attribute loads (faster than attrgetters here), and ints appended to
        # a few lists (a tuple per grown conversation, unpacked at the end, was slower: docs/performance.md,
        # "Pool-stream encoding")
        old_convs, old_stable = self._prev_convs, self._prev_stable
        get_old = old_convs.get
        prefixes = self._changes.output_prefixes  # the producer's record: outputs that only grew, known by identity
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
        tier_patches = {}
        old_tiers = self._prev_tiers
        for key, a in tiers.items():
            b = old_tiers[key]  # the header (so the tiers and their sizes) is the same as prev's
            if a is b:
                continue
            index = np.flatnonzero(a != b)  # [changed]
            if index.size:
                tier_patches[key] = _patch(a[index], index)
        group_tables = []
        if snapshot.carries_group_tables and snapshot.group_block_tables is not prev.group_block_tables and \
                snapshot.group_block_tables != prev.group_block_tables:
            group_tables = [GroupTables(*_tables_delta(o, g))
                            for o, g in zip(prev.group_block_tables, snapshot.group_block_tables)]
        return Delta(int(snapshot.version), patches, tables, removed, order, convs, grown, dropped, conv_order,
                     metrics, memory, _by_tier(tier_patches), group_tables), new_stable, new_convs


def encode_keyframe(snapshot: PoolSnapshot, seq: int, stream_id: int, events: Sequence[BlockEvent] = ()) -> Frame:
    """A keyframe for ``snapshot`` at ``seq`` of stream ``stream_id`` (a history re-keying its oldest kept frame)."""
    enc = StreamEncoder(stream_id=stream_id)
    arrays = enc._arrays(snapshot)
    body = enc._keyframe_body(snapshot, _header(snapshot), arrays)
    return enc._frame(seq, snapshot.step_id, True, tuple(events), body)
