"""Bookkeeping of the physical block pool: ref counts, the free queue, prefix-cache hashes, eviction.

Pure Python and numpy (no torch): it decides *which* block ids hold what; :mod:`engine.kv_cache` holds the data.
The per-block arrays are kept current as blocks change, so a snapshot is a handful of array copies.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import numpy as np

from .snapshot import BlockState


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of a full block: it names the whole prefix up to and including this block."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little", signed=False))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def blocks_needed(num_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """Blocks a conversation of ``num_tokens`` prompt tokens holds once it has generated ``max_new_tokens``: K/V is
    stored for every token but the last one sampled."""
    return -(-(num_tokens + max_new_tokens - 1) // block_size)


def random_cycle(n: int, seed: int | None) -> np.ndarray:
    """``new_id`` for a relocation that moves every block: one random cycle through all ``n`` ids (n >= 2), so no
    block keeps its place."""
    perm = np.random.default_rng(seed).permutation(n)
    new_id = np.empty(n, np.int64)
    new_id[perm] = np.roll(perm, -1)
    return new_id


class BlockPool:
    """Which physical blocks are free, used or cached, and by whom.

    Free blocks wait in two O(1) queues: plain ``FREE`` blocks, handed out first, and ``CACHED`` blocks (free but
    holding a full, hashed block of KV) in least-recently-used order, evicted only when no plain block is left.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = np.zeros(num_blocks, np.int32)  # block-table entries naming the block
        self.num_filled = np.zeros(num_blocks, np.int32)  # slots holding K/V
        self.state = np.zeros(num_blocks, np.int8)  # BlockState
        self.owner = np.full(num_blocks, -1, np.int32)  # first owner (used) or last filler (cached); -1 none
        self.last_access = np.zeros(num_blocks, np.int64)  # step of the last allocation, write or reuse
        self.block_hash: list[int | None] = [None] * num_blocks  # prefix hash of a full, cached-able block
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # token ids of a hashed block
        self.block_start: list[int] = [0] * num_blocks  # position of a hashed block's first token
        self.hash_to_block: dict[int, int] = {}  # prefix hash -> block holding it
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.clock = 0  # current engine step, stamped into last_access

    # ---- counts ---------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: plain free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def free_queue(self) -> tuple[int, ...]:
        """Plain free block ids in the order :meth:`allocate` hands them out (cached ones follow, LRU first)."""
        return tuple(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    # ---- allocation -----------------------------------------------------------------------------------------
    def allocate(self, n: int, owner: int) -> list[int]:
        if not self.can_allocate(n):
            raise RuntimeError(f"allocate({n}) with only {self.num_free_blocks} free blocks")
        out = []
        for _ in range(n):
            if self._free:
                block, _ = self._free.popitem(last=False)
            else:
                block, _ = self._cached.popitem(last=False)  # evict the least recently used cached block
                self._forget_hash(block)
            self.ref_count[block] = 1
            self.num_filled[block] = 0
            self.state[block] = BlockState.USED
            self.owner[block] = owner
            self.last_access[block] = self.clock
            out.append(block)
        return out

    def lookup(self, block_hash: int) -> int | None:
        """The block holding this prefix hash, if any (used or cached)."""
        return self.hash_to_block.get(block_hash) if self.enable_prefix_caching else None

    def acquire(self, block: int, owner: int) -> None:
        """Take one more reference to a block that already holds the wanted KV (prefix hit or fork)."""
        if self.ref_count[block] == 0:
            self._cached.pop(block, None)
            self._free.pop(block, None)
            self.state[block] = BlockState.USED
            self.owner[block] = owner
        self.ref_count[block] += 1
        self.last_access[block] = self.clock

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block, tail first, so a conversation's tail blocks are evicted first."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] > 0:
                continue
            if self.block_hash[block] is not None:
                self.state[block] = BlockState.CACHED  # keeps its KV, owner stays as a hint of who filled it
                self._cached[block] = None
            else:
                self.state[block] = BlockState.FREE
                self.num_filled[block] = 0
                self.owner[block] = -1
                self._free[block] = None

    # ---- prefix caching -------------------------------------------------------------------------------------
    def cache_full_block(self, block: int, block_hash: int, token_ids: Sequence[int], start: int) -> None:
        """Register a block that just became full so later prompts with the same prefix can reuse it."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash in self.hash_to_block:  # the same prefix was computed twice; keep the first copy
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(token_ids)
        self.block_start[block] = start
        self.hash_to_block[block_hash] = block

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.hash_to_block.get(h) == block:
            del self.hash_to_block[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None

    # ---- relocation -----------------------------------------------------------------------------------------
    def permute(self, new_id: np.ndarray) -> None:
        """Rename every block: old id b becomes ``new_id[b]`` (a permutation of range(num_blocks))."""
        for name in ("ref_count", "num_filled", "state", "owner", "last_access"):
            old = getattr(self, name)
            moved = np.empty_like(old)
            moved[new_id] = old
            setattr(self, name, moved)
        for name in ("block_hash", "block_tokens", "block_start"):
            old, moved = getattr(self, name), [None] * self.num_blocks
            for b, value in enumerate(old):
                moved[new_id[b]] = value
            setattr(self, name, moved)
        self.hash_to_block = {h: int(new_id[b]) for h, b in self.hash_to_block.items()}
        self._free = OrderedDict((int(new_id[b]), None) for b in self._free)
        self._cached = OrderedDict((int(new_id[b]), None) for b in self._cached)
