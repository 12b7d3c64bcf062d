"""What a pool may look like: the invariants every decoded frame must satisfy before anyone is shown it.

Why: the decoder checks shape (types, lengths, ids in range), but a well-formed message can still describe a pool
that cannot exist (a block table naming a FREE block, a negative ref count, 20 tokens in a 16-slot block, a NaN
temperature). Shown, such a frame is a lie about the server being watched; so a frame that breaks a rule is refused
with a :class:`StreamError` that names the rule, and the watcher counts it. The rules are the engine's own
(``engine/block_pool.py`` and ``engine/kv_cache_manager.py`` ``check_invariants``), split in two:

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

from ..views import BlockState, PoolSnapshot
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


def check_number(what: str, name: str, value) -> None:
    """Metrics and memory figures are counts, times and sizes: finite and not negative (but the one difference)."""
    if name == "num_slots_saved_by_sharing":  # logical minus filled slots: a server may hold blocks no table names
        if not math.isfinite(value):
            _fail(what, f"{what}.{name} is {value!r}")
        return
    if not (math.isfinite(value) and value >= 0):
        _fail(what, f"{what}.{name} is {value!r}")


# ---- the pool --------------------------------------------------------------------------------------------------
class TableCounts:
    """How many table entries name each block, and the sum of their conversation ids, kept up to date from the
    tables that changed since the last check (unchanged tables are the very same tuples)."""

    __slots__ = ("num_blocks", "tables", "counts", "sums", "matched")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.tables: dict[int, tuple] = {}  # the tables as of the last check
        self.counts = np.zeros(num_blocks, np.int64)  # entries naming each block
        self.sums = np.zeros(num_blocks, np.int64)  # sum of the ids of the conversations naming each block
        self.matched: dict[int, tuple] = {}  # cid -> (table, the conversation's block_table) found equal

    def update(self, tables) -> None:
        old = self.tables
        counts, sums = self.counts, self.sums
        for cid, t in old.items():
            if tables.get(cid) is not t and t:
                ids = np.fromiter(t, np.int64, len(t))
                np.subtract.at(counts, ids, 1)
                np.subtract.at(sums, ids, cid)
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
        self.tables = dict(tables)


def check_snapshot(snap: PoolSnapshot, counts: TableCounts | None = None) -> TableCounts:
    """StreamError naming the rule a snapshot breaks (see the module's rules); returns the table counts to give to
    the next check of the same pool (None, or another pool's: counted afresh)."""
    n, bs = snap.num_blocks, snap.block_size
    state, ref, filled, owner = snap.state, snap.ref_count, snap.num_filled, snap.owner
    h = snap.block_hash
    for name in ("state", "ref_count", "num_filled", "owner", "last_access"):
        a = getattr(snap, name)
        if not isinstance(a, np.ndarray) or a.shape != (n,):
            _fail(name, f"{name} is not an array of the pool's {n} blocks")
    bad = (state < BlockState.FREE) | (state > BlockState.CACHED)
    if bad.any():
        b = _first(bad)
        _fail("block states", f"block {b} has state {int(state[b])}, not FREE, USED or CACHED")
    if (ref < 0).any():
        b = _first(ref < 0)
        _fail("ref counts", f"block {b} has ref count {int(ref[b])}")
    bad = (filled < 0) | (filled > bs)
    if bad.any():
        b = _first(bad)
        _fail("fill", f"block {b} holds {int(filled[b])} tokens in {bs} slots")
    bad = (owner < -1) | (owner > MAX_ID)
    if bad.any():
        b = _first(bad)
        _fail("owners", f"block {b} has owner {int(owner[b])}")
    if (snap.last_access < 0).any():
        _fail("last access", f"block {_first(snap.last_access < 0)} was last used at a negative step")
    used = state == BlockState.USED
    free = state == BlockState.FREE
    cached = state == BlockState.CACHED
    bad = ~used & (ref != 0)
    if bad.any():
        b = _first(bad)
        _fail("ref counts", f"{BlockState(int(state[b])).name} block {b} has ref count {int(ref[b])}")
    bad = free & ((filled != 0) | (owner != -1))
    if bad.any():
        b = _first(bad)
        _fail("free blocks", f"FREE block {b} holds {int(filled[b])} tokens or has owner {int(owner[b])}")
    bad = cached & (filled != bs)
    if bad.any():
        b = _first(bad)
        _fail("cached blocks", f"CACHED block {b} holds {int(filled[b])} of {bs} tokens")
    if h is not None:
        if not isinstance(h, np.ndarray) or h.shape != (n,):
            _fail("hashes", f"block_hash is not an array of the pool's {n} blocks")
        bad = (free & (h != 0)) | (cached & (h == 0))
        if bad.any():
            b = _first(bad)
            _fail("hashes", f"{BlockState(int(state[b])).name} block {b} {'has' if h[b] else 'lacks'} a hash")
    strict = snap.source == "engine"
    if strict:
        bad = used & ((ref <= 0) | (owner < 0))
        if bad.any():
            b = _first(bad)
            _fail("used blocks", f"USED block {b} has ref count {int(ref[b])} and owner {int(owner[b])}")
    tables = snap.block_tables
    if counts is None or counts.num_blocks != n:
        counts = TableCounts(n)
    counts.update(tables)
    c = counts.counts
    bad = (c > 0) & ~used
    if bad.any():
        b = _first(bad)
        _fail("block tables", f"a block table names {BlockState(int(state[b])).name} block {b}")
    bad = (c != ref) if strict else (c > ref)
    if bad.any():
        b = _first(bad)
        _fail("ref counts", f"block {b} has ref count {int(ref[b])} but {int(c[b])} table entries name it")
    bad = (c == 1) & (counts.sums != owner)
    if bad.any():
        b = _first(bad)
        _fail("owners", f"block {b} is held by conversation {int(counts.sums[b])} alone but owned by "
                        f"{int(owner[b])}")
    matched = {}
    for cid, t in tables.items():
        conv = snap.conversation(cid)
        if conv is None:
            _fail("block tables", f"conversation {cid} holds blocks but is not in the frame")
        seen = counts.matched.get(cid)
        if seen is None or seen[0] is not t or seen[1] is not conv.block_table:
            if conv.block_table != t:
                _fail("block tables", f"conversation {cid}'s block table differs from the pool's table for it")
        matched[cid] = (t, conv.block_table)
    counts.matched = matched
    mem = snap.memory
    if mem is not None:
        have = np.bincount(state.astype(np.intp, copy=False), minlength=3)
        said = (mem.num_free_blocks, mem.num_used_blocks, mem.num_cached_blocks)
        if tuple(int(x) for x in have[:3]) != said:
            _fail("memory", f"the memory figures count {said[1]} used, {said[2]} cached and {said[0]} free blocks, "
                            f"the states {int(have[1])}, {int(have[2])} and {int(have[0])}")
    return counts
