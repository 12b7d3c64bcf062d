"""What a pool may look like: the invariants every decoded frame must satisfy before anyone is shown it.

Why: the decoder checks shape (types, lengths, ids in range), but a well-formed message can still describe a pool
that cannot exist (a block table naming a FREE block, a negative ref count, 20 tokens in a 16-slot block, a NaN
temperature). Shown, such a frame is a lie about the server being watched; so a frame that breaks a rule is refused
with a :class:`StreamError` that names the rule, and the watcher counts it. The rules are the engine's own
(``engine/kv/pool.py`` and ``engine/kv/manager.py`` ``check_invariants``), split in two:

- every source: block states are FREE, USED or CACHED; ref counts are 0 or more, and 0 for FREE and CACHED blocks;
  ``0 <= num_filled <= block_size``, 0 for FREE blocks and ``block_size`` for CACHED ones; FREE blocks have no
  hash and no owner, CACHED ones a hash; owners are -1 or a conversation id; a block table names no block twice
  and only USED blocks; a block's ref count is at least the table entries naming it; a block with one holder is
  owned by it; every block table belongs to a conversation of the frame with that very table; the memory figures
  count the blocks the states say.
- the project's engine (``source == "engine"``) also: ref counts equal the table entries, and USED blocks have a
  reference and an owner. A vLLM server (the plugin) shows its null block USED without a holder and may hold a
  block a moment after its table is gone, so these two are not asked of it.

Conversation fields (token ids, counts, temperatures) and the metrics are checked by the decoder as they arrive
(:func:`check_conversation_values`, :func:`check_number`), so a frame costs O(what changed) there; the pool rules
cost a few vectorized passes over the per-block arrays per snapshot built, with the table references kept up to
date by :class:`TableCounts` from the tables that changed (tuples compared by identity).

numpy only (no torch): the recording reader, the subscriber and headless ``--open`` use it through the decoder.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..views import HIT_MEDIA, MISS_CAUSES, BlockState, PoolSnapshot
from .schema import StreamError

MAX_TOKEN_ID = 2 ** 31 - 1  # token ids are vocabulary indices: int32 in every engine this watches
MAX_ID = 2 ** 31 - 1  # conversation ids and owners: int32 in the per-block owner array
BYTES_PER_BLOCK = 128  # what a decoded block costs, about: six arrays kept twice (working and frozen), the history's
# checkpoints and the grid's colour buffers, rounded up (29 bytes of arrays per copy)
MAX_BLOCKS_CEILING = 2 ** 31  # never more, whatever the memory (index arithmetic stays far inside int64)
_max_blocks: int | None = None  # set_max_blocks(); None: a quarter of the memory available now


def set_max_blocks(limit: int | None) -> None:
    """The most blocks a pool-stream frame may claim in this process (None: a quarter of available memory)."""
    global _max_blocks
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"the largest pool must be a positive number of blocks, not {limit!r}")
    _max_blocks = limit


def _available_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this system: assume a small machine
        return 4 << 30


def max_blocks() -> int:
    """The most blocks a frame may claim now: the configured limit, or what fits in a quarter of available memory."""
    if _max_blocks is not None:
        return min(_max_blocks, MAX_BLOCKS_CEILING)
    return max(1 << 16, min(MAX_BLOCKS_CEILING, _available_bytes() // 4 // BYTES_PER_BLOCK))


def check_size(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """StreamError unless a header's sizes are possible and fit in memory (asked before anything is allocated)."""
    if num_blocks < 1 or block_size < 1 or max_model_len < 0:
        raise StreamError(f"malformed pool-stream message: header says {num_blocks} blocks of {block_size} slots")
    limit = max_blocks()
    if num_blocks > limit:
        how = "the configured maximum" if _max_blocks is not None else "what fits in a quarter of the memory " \
                                                                          "available now"
        raise StreamError(f"refused: the frame claims a pool of {num_blocks:,} blocks, more than {how} "
                          f"({limit:,} blocks)")
    if block_size > 1 << 20:
        raise StreamError(f"refused: the frame claims blocks of {block_size:,} token slots (at most {1 << 20:,})")


def _fail(rule: str, detail: str) -> None:
    raise StreamError(f"impossible pool ({rule}): {detail}")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


# ---- conversation fields and numbers, as the decoder reads them -----------------------------------------------------
def check_token_ids(ids, cid: int, what: str) -> None:
    """Token ids are vocabulary indices: 0 to 2**31 - 1."""
    if len(ids) and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        _fail("token ids", f"conversation {cid} has {what} token id {bad}")


_COUNTS = ("num_computed_tokens", "num_cached_tokens", "max_new_tokens", "num_preemptions", "arrival_step")


def check_conversation_values(cid: int, fields: dict) -> None:
    """The plain fields of a conversation patch (``fields``: name -> new value, unchanged ones absent)."""
    if not 0 <= cid <= MAX_ID:
        _fail("conversation ids", f"conversation id {cid} is outside 0..{MAX_ID}")
    for name in _COUNTS:
        value = fields.get(name)
        if value is not None and value < 0:
            _fail(name, f"conversation {cid} has {name} {value}")
    t = fields.get("temperature")
    if t is not None and not (math.isfinite(t) and t >= 0):
        _fail("temperature", f"conversation {cid} has temperature {t!r}")
    parent = fields.get("parent_id")
    if parent is not None and not 0 <= parent <= MAX_ID:
        _fail("parent_id", f"conversation {cid} was forked from {parent}")
    turns = fields.get("turns")
    if turns and any(a < 0 or b < 0 for a, b in turns):
        _fail("turns", f"conversation {cid} has turns {list(turns)[:4]}")


_OUTCOME_NAMES = frozenset(HIT_MEDIA + MISS_CAUSES)


def check_outcomes(cid: int, outcomes) -> None:
    """A conversation's prompt block outcomes: blocks 0, 1, 2, ... in order, each a known hit medium or miss cause,
    hits first (a hit after a miss is not a prefix hit), an eviction's step and idle time not negative."""
    seen_miss = False
    for i, o in enumerate(outcomes):
        if o.index != i:
            _fail("prompt_block_outcomes", f"conversation {cid}'s outcome {i} names block {o.index}")
        if o.outcome not in _OUTCOME_NAMES:
            _fail("prompt_block_outcomes", f"conversation {cid}'s block {i} has outcome {o.outcome!r}")
        hit = o.outcome in HIT_MEDIA
        if hit and seen_miss:
            _fail("prompt_block_outcomes", f"conversation {cid}'s block {i} is a hit after a miss")
        seen_miss = seen_miss or not hit
        if any(v is not None and v < (-1 if name == "evicted_for" else 0) for name, v in (
                ("evicted_step", o.evicted_step), ("evicted_for", o.evicted_for), ("idle_steps", o.idle_steps))):
            _fail("prompt_block_outcomes", f"conversation {cid}'s block {i} has a negative step or id")


def check_number(what: str, name: str, value) -> None:
    """Metrics and memory figures are counts, times and sizes: finite and not negative (but the one difference)."""
    if name == "num_slots_saved_by_sharing":  # logical minus filled slots: a server may hold blocks no table names
        if not math.isfinite(value):
            _fail(what, f"{what}.{name} is {value!r}")
        return
    if not (math.isfinite(value) and value >= 0):
        _fail(what, f"{what}.{name} is {value!r}")


# ---- the pool --------------------------------------------------------------------------------------------------
_NO_BLOCKS = np.zeros(0, np.int64)


class TableCounts:
    """What the last check of a pool saw, kept so that the next check of the same pool looks only at what changed:
    how many table entries name each block and the sum of their conversation ids (updated from the tables that
    changed: unchanged tables are the very same tuples), the block states and their histogram."""

    __slots__ = ("num_blocks", "tables", "counts", "sums", "matched", "states", "histogram")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.tables: dict[int, tuple] = {}  # the tables as of the last check
        self.counts = np.zeros(num_blocks, np.int64)  # entries naming each block
        self.sums = np.zeros(num_blocks, np.int64)  # sum of the ids of the conversations naming each block
        self.matched: dict[int, tuple] = {}  # cid -> (table, the conversation's block_table) found equal
        self.states: np.ndarray | None = None  # the block states as of the last check
        self.histogram: np.ndarray | None = None  # blocks FREE, USED, CACHED as of the last check

    def update(self, tables) -> np.ndarray:
        """Take the tables of the next snapshot; returns the blocks whose table entries changed."""
        old = self.tables
        counts, sums = self.counts, self.sums
        touched = []
        for cid, t in old.items():
            if tables.get(cid) is not t and t:
                ids = np.fromiter(t, np.int64, len(t))
                np.subtract.at(counts, ids, 1)
                np.subtract.at(sums, ids, cid)
                touched.append(ids)
        for cid, t in tables.items():
            if old.get(cid) is not t and t:
                if not 0 <= cid <= MAX_ID:
                    _fail("conversation ids", f"a block table belongs to conversation id {cid}, outside 0..{MAX_ID}")
                if len(set(t)) != len(t):
                    _fail("block tables", f"the block table of conversation {cid} names a block twice")
                ids = np.fromiter(t, np.int64, len(t))
                if ids.min() < 0 or ids.max() >= self.num_blocks:
                    _fail("block tables", f"the block table of conversation {cid} names a block outside "
                                          f"0..{self.num_blocks - 1}")
                np.add.at(counts, ids, 1)
                np.add.at(sums, ids, cid)
                touched.append(ids)
        self.tables = dict(tables)
        return np.concatenate(touched) if touched else _NO_BLOCKS


def check_snapshot(snap: PoolSnapshot, counts: TableCounts | None = None,
                   changed: np.ndarray | None = None) -> TableCounts:
    """StreamError naming the rule a snapshot breaks (see the module's rules); returns what the check saw, to give
    to the next check of the same pool. ``counts`` from the check of an earlier snapshot of this pool and
    ``changed``, the blocks whose arrays changed since (None: any), let it look at those blocks and the ones whose
    table entries changed only; without them every block is checked."""
    n, bs = snap.num_blocks, snap.block_size
    for name in ("state", "ref_count", "num_filled", "owner", "last_access"):
        a = getattr(snap, name)
        if not isinstance(a, np.ndarray) or a.shape != (n,):
            _fail(name, f"{name} is not an array of the pool's {n} blocks")
    h = snap.block_hash
    if h is not None and (not isinstance(h, np.ndarray) or h.shape != (n,)):
        _fail("hashes", f"block_hash is not an array of the pool's {n} blocks")
    grouped = snap.carries_group_tables
    if grouped:
        _check_groups(snap)
    _check_tiers(snap)
    fresh = counts is None or counts.num_blocks != n or changed is None or counts.states is None or grouped
    if fresh:
        counts = TableCounts(n)
    touched = counts.update(_all_groups(snap) if grouped else snap.block_tables)
    idx = None
    if not fresh:  # the changed blocks, each once (a mask: cheaper than sorting thousands of indices)
        mask = np.zeros(n, np.bool_)
        mask[changed] = True
        mask[touched] = True
        idx = np.flatnonzero(mask)
    if idx is None or idx.size:
        _check_blocks(snap, counts, idx)
    _check_tables(snap, counts)
    _check_memory(snap, counts, idx)
    return counts


def _all_groups(snap: PoolSnapshot) -> dict[int, tuple[int, ...]]:
    """Each conversation's blocks in every group, -1 holes left out: what ref counts and owners count."""
    out: dict[int, list[int]] = {}
    for tables in snap.group_block_tables:
        for cid, t in tables.items():
            out.setdefault(cid, []).extend(b for b in t if b != -1)
    return {cid: tuple(t) for cid, t in out.items()}


_SOURCES = frozenset({"device", "host", "disk", "computed"})


def _check_groups(snap: PoolSnapshot) -> None:
    """KV cache groups: one table set per group, group 0's is block_tables, -1 only as a sliding window's leading
    holes, every block in one group's tables only and of that group (block_group), conversations agree."""
    n = snap.num_blocks
    groups = snap.kv_cache_groups
    if len(snap.group_block_tables) != len(groups):
        _fail("groups", f"{len(snap.group_block_tables)} group table sets for {len(groups)} KV cache groups")
    bg = snap.block_group
    if bg is not None:
        if not isinstance(bg, np.ndarray) or bg.shape != (n,):
            _fail("groups", f"block_group is not an array of the pool's {n} blocks")
        used = snap.state != BlockState.FREE
        bad = used & ((bg < 0) | (bg >= len(groups)))
        if bad.any():
            b = _first(bad)
            _fail("groups", f"block {b} is in group {int(bg[b])}, outside 0..{len(groups) - 1}")
    if dict(snap.group_block_tables[0]) != dict(snap.block_tables):
        _fail("groups", "group 0's block tables are not the pool's block tables")
    for g, (spec, tables) in enumerate(zip(groups, snap.group_block_tables)):
        sliding = spec.kind == "sliding_window"
        for cid, t in tables.items():
            holes = 0
            while holes < len(t) and t[holes] == -1:
                holes += 1
            live = t[holes:]
            if -1 in live or (holes and not sliding):
                _fail("groups", f"conversation {cid}'s table in group {g} has a -1 entry "
                                f"{'after a block' if sliding else 'in a full-attention group'}")
            if live and (min(live) < 0 or max(live) >= n):
                _fail("groups", f"conversation {cid}'s table in group {g} names a block outside 0..{n - 1}")
            if bg is not None and live:
                wrong = [b for b in live if int(bg[b]) != g]
                if wrong:
                    _fail("groups", f"block {wrong[0]} is in conversation {cid}'s group {g} table but belongs to "
                                    f"group {int(bg[wrong[0]])}")
    for conv in snap.conversations:
        cid = conv.conversation_id
        if len(conv.group_block_tables) > 1 or snap.carries_group_tables:
            want = tuple(tuple(tables.get(cid, ())) for tables in snap.group_block_tables)
            if tuple(conv.group_block_tables) != want and any(cid in tables for tables in snap.group_block_tables):
                _fail("groups", f"conversation {cid}'s group tables differ from the pool's tables for it")


def _check_sources(snap: PoolSnapshot) -> None:
    for conv in snap.conversations:
        src = conv.prompt_token_sources
        if src and (set(src) - _SOURCES or any(type(v) is not int or v < 0 for v in src.values())):
            _fail("prompt sources", f"conversation {conv.conversation_id} has prompt token sources {dict(src)}")


def _check_tiers(snap: PoolSnapshot) -> None:
    """Every tier slot is FREE or CACHED, with a hash exactly when CACHED."""
    _check_sources(snap)
    for name, tier in snap.tiers.items():
        if name not in ("host", "disk"):
            _fail("tiers", f"a tier named {name!r} (tiers are host and disk)")
        for a in (tier.state, tier.block_hash, tier.last_access):
            if not isinstance(a, np.ndarray) or a.shape != (tier.num_blocks,):
                _fail("tiers", f"tier {name}'s arrays do not have its {tier.num_blocks} slots")
        st = tier.state
        bad = (st != BlockState.FREE) & (st != BlockState.CACHED)
        if bad.any():
            b = _first(bad)
            _fail("tiers", f"tier {name} slot {b} has state {int(st[b])}, not FREE or CACHED")
        cached = st == BlockState.CACHED
        bad = cached != (tier.block_hash != 0)
        if bad.any():
            b = _first(bad)
            _fail("tiers", f"tier {name} slot {b} is {BlockState(int(st[b])).name} and "
                           f"{'has' if tier.block_hash[b] else 'lacks'} a hash")
        if (tier.last_access < 0).any():
            _fail("tiers", f"tier {name} slot {_first(tier.last_access < 0)} was last used at a negative step")


def _check_blocks(snap: PoolSnapshot, counts: TableCounts, idx: np.ndarray | None) -> None:
    """The rules of each block, for the blocks ``idx`` (None: all)."""
    bs = snap.block_size

    def pick(a):
        return a if idx is None else a[idx]

    def at(mask) -> int:  # the block id of the first True in a mask over the picked blocks
        b = int(np.flatnonzero(mask)[0])
        return b if idx is None else int(idx[b])

    state, ref, filled, owner = pick(snap.state), pick(snap.ref_count), pick(snap.num_filled), pick(snap.owner)
    bad = (state < BlockState.FREE) | (state > BlockState.CACHED)
    if bad.any():
        b = at(bad)
        _fail("block states", f"block {b} has state {int(snap.state[b])}, not FREE, USED or CACHED")
    if (ref < 0).any():
        b = at(ref < 0)
        _fail("ref counts", f"block {b} has ref count {int(snap.ref_count[b])}")
    bad = (filled < 0) | (filled > bs)
    if bad.any():
        b = at(bad)
        _fail("fill", f"block {b} holds {int(snap.num_filled[b])} tokens in {bs} slots")
    bad = (owner < -1) | (owner > MAX_ID)
    if bad.any():
        b = at(bad)
        _fail("owners", f"block {b} has owner {int(snap.owner[b])}")
    last = pick(snap.last_access)
    if (last < 0).any():
        _fail("last access", f"block {at(last < 0)} was last used at a negative step")
    used = state == BlockState.USED
    free = state == BlockState.FREE
    cached = state == BlockState.CACHED
    bad = ~used & (ref != 0)
    if bad.any():
        b = at(bad)
        _fail("ref counts", f"{BlockState(int(snap.state[b])).name} block {b} has ref count {int(snap.ref_count[b])}")
    bad = free & ((filled != 0) | (owner != -1))
    if bad.any():
        b = at(bad)
        _fail("free blocks", f"FREE block {b} holds {int(snap.num_filled[b])} tokens or has owner "
                             f"{int(snap.owner[b])}")
    bad = cached & (filled != bs)
    if bad.any():
        b = at(bad)
        _fail("cached blocks", f"CACHED block {b} holds {int(snap.num_filled[b])} of {bs} tokens")
    if snap.block_hash is not None:
        h = pick(snap.block_hash)
        bad = (free & (h != 0)) | (cached & (h == 0))
        if bad.any():
            b = at(bad)
            _fail("hashes", f"{BlockState(int(snap.state[b])).name} block {b} "
                            f"{'has' if snap.block_hash[b] else 'lacks'} a hash")
    strict = snap.source == "engine"
    if strict:
        bad = used & ((ref <= 0) | (owner < 0))
        if bad.any():
            b = at(bad)
            _fail("used blocks", f"USED block {b} has ref count {int(snap.ref_count[b])} and owner "
                                 f"{int(snap.owner[b])}")
    c = pick(counts.counts)
    bad = (c > 0) & ~used
    if bad.any():
        b = at(bad)
        _fail("block tables", f"a block table names {BlockState(int(snap.state[b])).name} block {b}")
    bad = (c != ref) if strict else (c > ref)
    if bad.any():
        b = at(bad)
        _fail("ref counts", f"block {b} has ref count {int(snap.ref_count[b])} but {int(counts.counts[b])} table "
                            "entries name it")
    bad = (c == 1) & (pick(counts.sums) != owner)
    if bad.any():
        b = at(bad)
        _fail("owners", f"block {b} is held by conversation {int(counts.sums[b])} alone but owned by "
                        f"{int(snap.owner[b])}")


def _check_tables(snap: PoolSnapshot, counts: TableCounts) -> None:
    """Every block table belongs to a conversation of the frame, whose own block_table is that table."""
    matched = {}
    seen = counts.matched
    for cid, t in snap.block_tables.items():
        conv = snap.conversation(cid)
        if conv is None:
            _fail("block tables", f"conversation {cid} holds blocks but is not in the frame")
        was = seen.get(cid)
        if (was is None or was[0] is not t or was[1] is not conv.block_table) and conv.block_table != t:
            _fail("block tables", f"conversation {cid}'s block table differs from the pool's table for it")
        matched[cid] = (t, conv.block_table)
    counts.matched = matched


def _check_memory(snap: PoolSnapshot, counts: TableCounts, idx: np.ndarray | None) -> None:
    """The memory figures count the blocks the states say (the histogram kept up to date from the changed
    blocks; only called once every block's state is known to be FREE, USED or CACHED)."""
    state = snap.state
    if idx is None:
        counts.histogram = np.bincount(state.astype(np.intp), minlength=3)
        counts.states = state.copy()
    elif idx.size:
        new = state[idx]
        counts.histogram -= np.bincount(counts.states[idx].astype(np.intp), minlength=3)
        counts.histogram += np.bincount(new.astype(np.intp), minlength=3)
        counts.states[idx] = new
    mem = snap.memory
    if mem is not None:
        have = counts.histogram
        said = (mem.num_free_blocks, mem.num_used_blocks, mem.num_cached_blocks)
        if tuple(int(x) for x in have[:3]) != said:
            _fail("memory", f"the memory figures count {said[1]} used, {said[2]} cached and {said[0]} free blocks, "
                            f"the states {int(have[1])}, {int(have[2])} and {int(have[0])}")
