"""Bookkeeping of the physical block pool: ref counts, fill, the free queues, prefix-cache hashes.

Pure Python and numpy (no torch): it decides *which* block ids hold what; :mod:`engine.kv.cache` holds the data.
Only :class:`engine.kv.manager.KVCacheManager` calls the mutating methods; they are primitive on purpose
(take a free block, add or drop a reference, mark a block full) and say nothing about conversations.

Every fact lives in a per-block numpy array, so a snapshot is a handful of array copies and a checkpoint for
rolling back a failed step is too: the queues and the hash map are derived from the arrays and rebuilt on restore.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from kvstream.views import NO_HASH, BlockState

from .policies import EvictionPolicy
from .policies.lru import LRUPolicy


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: it names the whole prefix up to and including this block. Never NO_HASH (0),
    which marks blocks without a hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") or 1


def random_cycle(n: int, seed: int | None) -> np.ndarray:
    """``new_id`` for a relocation that moves every block: one random cycle through all ``n`` ids (n >= 2), so no
    block keeps its place."""
    perm = np.random.default_rng(seed).permutation(n)
    new_id = np.empty(n, np.int64)
    new_id[perm] = np.roll(perm, -1)
    return new_id


@dataclass(frozen=True)
class HashedBlock:
    """What a prefix hash names; immutable, so it never needs rolling back (a hash always names the same tokens)."""

    token_ids: tuple[int, ...]  # the block's tokens
    start: int  # position of its first token in the conversation that stored it
    parent_hash: int | None  # hash of the block before it (None for a conversation's first block)
    group: int = 0  # the KV cache group whose cache key names it (kvstream.rules.group_key of the hash)


_ARRAYS = ("ref_count", "num_filled", "state", "owner", "last_access", "block_hash", "queued_at")
_MAX_TOUCHED = 16  # touch_used() calls kept between two take_changes() (steps without a snapshot): then "all"


class BlockPool:
    """Which physical blocks are free, used or cached.

    Free blocks wait in two O(1) queues: plain ``FREE`` blocks, handed out first (oldest freed first), and
    ``CACHED`` blocks (free but holding a full, hashed block of KV) in the order they were released, evicted only
    when no plain block is left. ``queued_at`` stamps each block's place in its queue, so the queues can be rebuilt.
    Which cached block goes first is the eviction ``policy``'s choice (engine.kv.policies; LRU, the release order
    itself, unless told otherwise), and an eviction never takes a block the caller protects.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 policy: EvictionPolicy | None = None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = np.zeros(num_blocks, np.int32)  # block-table entries naming the block
        self.num_filled = np.zeros(num_blocks, np.int32)  # slots holding K/V
        self.state = np.zeros(num_blocks, np.int8)  # BlockState
        self.owner = np.full(num_blocks, -1, np.int32)  # a holder (used) or the last holder (cached); -1 none
        self.last_access = np.zeros(num_blocks, np.int64)  # step of the last allocation, write or read
        self.block_hash = np.zeros(num_blocks, np.uint64)  # prefix hash of a full, registered block; NO_HASH none
        self.queued_at = np.arange(num_blocks, dtype=np.int64)  # order stamp in the free or cached queue
        self._stamp = num_blocks  # next queue stamp
        self.hashed: dict[int, HashedBlock] = {}  # prefix hash -> what it names (kept while some block has it)
        self._dropped: dict[int, HashedBlock] = {}  # records dropped since the last checkpoint (for a restore)
        self.evicted_idle: dict[int, int] = {}  # hash evicted since the last checkpoint -> steps it sat unused
        self.clock = 0  # current engine step, stamped into last_access
        # What changed since the last take_changes() (a snapshot's promise to the pool-stream encoder, which then
        # compares these blocks instead of every array in full): blocks changed one by one, the blocks each
        # touch_used() stamped, or everything (a bulk change, or more than a snapshot's worth of changes).
        self._changed: set[int] = set()
        self._touched: list[np.ndarray] = []
        self._all_changed = True
        self._rebuild_derived()
        self.policy = policy if policy is not None else LRUPolicy()
        self.policy.bind(self)

    # ---- derived structures ---------------------------------------------------------------------------------
    def _rebuild_derived(self) -> None:
        """The queues and hash map from the arrays (after a restore or a relocation)."""
        order = np.argsort(self.queued_at, kind="stable")
        state = self.state[order]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order[state == BlockState.FREE].tolist())
        self._cached: OrderedDict[int, None] = OrderedDict.fromkeys(order[state == BlockState.CACHED].tolist())
        hashed = np.flatnonzero(self.block_hash != NO_HASH)
        self.hash_to_block: dict[int, int] = dict(zip(self.block_hash[hashed].tolist(), hashed.tolist()))
        self.hashed = {h: info for h, info in self.hashed.items() if h in self.hash_to_block}

    # ---- counts ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_queue(self):
        """The cached block ids in the order they were released (oldest first): what LRU evicts in."""
        return self._cached

    @property
    def free_queue(self) -> tuple[int, ...]:
        """Plain free block ids in the order allocation hands them out (cached ones follow, LRU first)."""
        return tuple(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def next_free(self, n: int) -> list[int]:
        """The ids the next ``n`` allocations would take, without taking them."""
        out = list(_first(self._free, n))
        if len(out) < n:
            out += self.policy.order(n - len(out))
        return out

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this prefix hash, if any (used or cached)."""
        return self.hash_to_block.get(block_hash) if self.enable_prefix_caching else None

    # ---- primitive changes (KVCacheManager only) ------------------------------------------------------------
    def take(self, owner: int, protected=()) -> tuple[int, int]:
        """Take the next free block for ``owner`` (USED, ref count 1, empty). Returns (block, evicted hash): a plain
        free block first, else the cached block the policy gives up (never one in ``protected``), whose hash is
        dropped (NO_HASH otherwise)."""
        evicted = NO_HASH
        if self._free:
            block, _ = self._free.popitem(last=False)
        elif self._cached:
            block = self.policy.victim(protected)
            del self._cached[block]
            evicted = int(self.block_hash[block])
            self.evicted_idle[evicted] = self.clock - int(self.last_access[block])
            self._drop_hash(block)
        else:
            raise RuntimeError("BlockPool.take with no free block (callers check can_allocate first)")
        self.ref_count[block] = 1
        self.num_filled[block] = 0
        self.state[block] = BlockState.USED
        self.owner[block] = owner
        self.last_access[block] = self.clock
        self._change(block)
        return block, evicted

    def add_ref(self, block: int, owner: int) -> None:
        """One more reference to a block that already holds the wanted KV (prefix hit or fork)."""
        if self.ref_count[block] == 0:
            revived = self._cached.pop(block, 0) is None  # a cached block taken back (a prefix hit)
            self._free.pop(block, None)
            self.state[block] = BlockState.USED
            if revived:
                self.policy.revived(block)
            self.owner[block] = owner
        self.ref_count[block] += 1
        self.last_access[block] = self.clock
        self._change(block)

    def drop_ref(self, block: int) -> BlockState:
        """One reference less; returns the block's state after (USED while others hold it, then CACHED if it holds
        a hashed block, else FREE)."""
        self.ref_count[block] -= 1
        self._change(block)
        if self.ref_count[block] > 0:
            return BlockState.USED
        self.queued_at[block] = self._stamp
        self._stamp += 1
        if self.block_hash[block] != NO_HASH:
            self.state[block] = BlockState.CACHED  # keeps its KV; owner stays as a hint of who filled it
            self._cached[block] = None
            self.policy.cached(block)
            return BlockState.CACHED
        self.state[block] = BlockState.FREE
        self.num_filled[block] = 0
        self.owner[block] = -1
        self._free[block] = None
        return BlockState.FREE

    def looked_up(self, blocks: list[int]) -> None:
        """An admission saw these blocks' content after its first miss (the eviction policy may care)."""
        self.policy.looked_up(blocks)

    def set_owner(self, block: int, owner: int) -> None:
        self.owner[block] = owner
        self._change(block)

    def set_filled(self, block: int, num_filled: int) -> None:
        self.num_filled[block] = num_filled
        self.last_access[block] = self.clock
        self._change(block)

    def register_hash(self, block: int, block_hash: int, info: HashedBlock) -> bool:
        """Make a just-filled block findable by its prefix hash. False (and nothing changes) when prefix caching is
        off, the block already has a hash, or another block already holds the same prefix (the first copy stays)."""
        if not self.enable_prefix_caching or self.block_hash[block] != NO_HASH or block_hash in self.hash_to_block:
            return False
        self.block_hash[block] = block_hash
        self._change(block)
        self.hash_to_block[block_hash] = block
        self.hashed[block_hash] = info
        self.policy.stored(block)
        return True

    def _drop_hash(self, block: int) -> None:
        h = int(self.block_hash[block])
        if h != NO_HASH:
            self.hash_to_block.pop(h, None)
            self._dropped.setdefault(h, self.hashed.pop(h))
        self.block_hash[block] = NO_HASH
        self._change(block)
        if h != NO_HASH:
            self.policy.dropped(block, h)

    def dropped_record(self, block_hash: int) -> HashedBlock | None:
        """What a hash dropped since the last checkpoint named (an evicted block's tokens, for the lower tiers)."""
        return self._dropped.get(block_hash)

    def clear_hashes(self) -> list[int]:
        """Forget every prefix hash (a reset of the prefix cache): cached blocks become free. Returns the blocks
        that were cached."""
        cached = list(self._cached)
        for block in cached:
            self.state[block] = BlockState.FREE
            self.num_filled[block] = 0
            self.owner[block] = -1
            self._free[block] = None
        self._cached.clear()
        self.block_hash[:] = NO_HASH
        self._lose_track()
        self.hash_to_block.clear()
        for h, record in self.hashed.items():
            self._dropped.setdefault(h, record)
        self.hashed.clear()
        self.policy.reset()
        return cached

    def touch_used(self, step: int) -> None:
        """Every used block was read by attention in this step."""
        used = np.flatnonzero(self.state == BlockState.USED)
        self.last_access[used] = step
        if not self._all_changed:
            self._touched.append(used)
            if len(self._touched) > _MAX_TOUCHED:  # no snapshot taken for many steps
                self._lose_track()

    def permute(self, new_id: np.ndarray) -> None:
        """Rename every block: old id b becomes ``new_id[b]`` (a permutation of range(num_blocks))."""
        for name in _ARRAYS:
            old = getattr(self, name)
            moved = np.empty_like(old)
            moved[new_id] = old
            setattr(self, name, moved)
        self.policy.permute(new_id)
        self._lose_track()
        self._rebuild_derived()
        self.policy.rebuild()

    # ---- what changed ---------------------------------------------------------------------------------------
    def _change(self, block: int) -> None:
        if not self._all_changed:
            self._changed.add(block)
            if len(self._changed) > self.num_blocks // 4:  # a quarter of the pool: comparing all is as cheap
                self._lose_track()

    def _lose_track(self) -> None:
        """Any block may have changed (a bulk change, or too many to keep): no record until the next interval."""
        self._all_changed = True
        self._touched, self._changed = [], set()

    def take_changes(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Which blocks' entries may differ from what they were at the previous call, as two read-only bool masks
        over the pool (True: may have changed; False: certainly unchanged): one for ref_count, num_filled, state,
        owner and block_hash, and a wider one for last_access (every used block, each step). None when any block
        may have changed (the first call, a restore, a relocation, a reset of the prefix cache, or changes kept for
        too long). Starts the next interval."""
        if self._all_changed:
            masks = None
        else:
            mask = np.zeros(self.num_blocks, np.bool_)
            if self._changed:
                mask[np.fromiter(self._changed, np.int64, len(self._changed))] = True
            stamped = mask
            if self._touched:
                stamped = mask.copy()
                for used in self._touched:
                    stamped[used] = True
                stamped.setflags(write=False)
            mask.setflags(write=False)
            masks = (mask, stamped)
        self._changed, self._touched, self._all_changed = set(), [], False
        return masks

    # ---- rollback -------------------------------------------------------------------------------------------
    def checkpoint(self) -> tuple:
        """Everything needed to undo changes made after this call: array copies (cheap even at 65,536 blocks); the
        hashed-block records are immutable, so only the ones dropped from now on are remembered."""
        self._dropped = {}
        self.evicted_idle = {}
        return tuple(getattr(self, name).copy() for name in _ARRAYS) + (self._stamp, self.clock,
                                                                         self.policy.state())

    def restore(self, checkpoint: tuple) -> None:
        *arrays, self._stamp, self.clock, policy_state = checkpoint
        for name, array in zip(_ARRAYS, arrays):
            setattr(self, name, array)
        self.hashed.update(self._dropped)  # records added since are dropped by the rebuild (no block has them)
        self._dropped = {}
        self._lose_track()
        self._rebuild_derived()
        self.policy.restore(policy_state)

    # ---- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self, block_tables: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError unless the bookkeeping is consistent with ``block_tables`` (every table naming
        blocks now): the free queues hold exactly the unused blocks, each in one queue; hash_to_block agrees with
        each block's hash; ref counts equal the table entries naming each block; FREE and CACHED blocks have ref
        count 0; FREE blocks hold nothing; CACHED blocks are full and hashed."""
        counts = np.zeros(self.num_blocks, np.int64)
        for table in block_tables:
            assert len(set(table)) == len(table), f"a block table names a block twice: {list(table)}"
            np.add.at(counts, np.asarray(table, np.int64), 1)
        assert np.array_equal(counts, self.ref_count), \
            f"ref counts differ from table entries at blocks {np.flatnonzero(counts != self.ref_count)[:10]}"
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free) and len(cached) == len(self._cached)
        assert not free & cached, f"blocks in both queues: {sorted(free & cached)[:10]}"
        state = self.state
        assert free == set(np.flatnonzero(state == BlockState.FREE).tolist()), "free queue != FREE blocks"
        assert cached == set(np.flatnonzero(state == BlockState.CACHED).tolist()), "cached queue != CACHED blocks"
        assert (self.ref_count[state != BlockState.USED] == 0).all(), "a FREE or CACHED block has references"
        assert (self.ref_count[state == BlockState.USED] > 0).all(), "a USED block has no reference"
        assert (self.num_filled[state == BlockState.FREE] == 0).all(), "a FREE block holds slots"
        assert (self.block_hash[state == BlockState.FREE] == NO_HASH).all(), "a FREE block has a hash"
        assert (self.block_hash[state == BlockState.CACHED] != NO_HASH).all(), "a CACHED block has no hash"
        assert (self.num_filled[state == BlockState.CACHED] == self.block_size).all(), "a CACHED block is not full"
        hashed = np.flatnonzero(self.block_hash != NO_HASH)
        assert self.hash_to_block == dict(zip(self.block_hash[hashed].tolist(), hashed.tolist())), \
            "hash_to_block disagrees with block_hash"
        assert set(self.hashed) == set(self.hash_to_block), "hashed-block records disagree with hash_to_block"
        assert (self.owner[state == BlockState.USED] >= 0).all(), "a USED block has no owner"
        self.policy.check_invariants()


def _first(queue: OrderedDict, n: int):
    for i, key in enumerate(queue):
        if i >= n:
            return
        yield key
