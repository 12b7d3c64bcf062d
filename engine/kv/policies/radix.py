"""Radix: SGLang's radix cache, the least recently used leaf of the prefix tree goes first.

SGLang keeps cached prefixes as a tree (a node per block of tokens, children extend their parent) and evicts only
leaves, least recently used first; a parent whose last child goes becomes a leaf in its turn. So a prefix is always
held whole from the root: a block is never kept after the block it extends is gone (which LRU over blocks can do,
wasting the child). Here the tree is the pool's own: a block's parent is the block holding the prefix hash its
record names (the content before it), and a leaf is a cached block no held block extends. "Recently used" is the
order the pool released its blocks in (LRU's). If every cached block is extended by a block in use, the least
recently used cached block goes (SGLang would have nothing evictable then).
"""
from __future__ import annotations

import heapq
from typing import Collection

from kvstream.rules import group_key
from kvstream.views import BlockState

from .base import EvictionPolicy, heap_victim


class RadixPolicy(EvictionPolicy):
    name = "radix"

    def _parent_key(self, record) -> int | None:
        if record.parent_hash is None:
            return None
        return group_key(record.parent_hash, record.group)

    def stored(self, block: int) -> None:
        record = self.pool.hashed[int(self.pool.block_hash[block])]
        parent = self._parent_key(record)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def cached(self, block: int) -> None:
        if not self._children.get(int(self.pool.block_hash[block])):
            heapq.heappush(self._heap, (int(self.pool.queued_at[block]), block))

    def dropped(self, block: int, block_hash: int) -> None:
        record = self.pool.dropped_record(block_hash)
        parent = self._parent_key(record) if record is not None else None
        if parent is None:
            return
        left = self._children.get(parent, 0) - 1
        if left > 0:
            self._children[parent] = left
            return
        self._children.pop(parent, None)
        above = self.pool.hash_to_block.get(parent)
        if above is not None and self.pool.state[above] == BlockState.CACHED:  # a leaf now
            heapq.heappush(self._heap, (int(self.pool.queued_at[above]), above))

    def _leaf(self, stamp: int, block: int) -> bool:
        pool = self.pool
        return (pool.state[block] == BlockState.CACHED and stamp == pool.queued_at[block]
                and not self._children.get(int(pool.block_hash[block])))

    def victim(self, protected: Collection[int] = ()) -> int:
        # no leaf: every cached block is extended by a block in use; the oldest cached then
        return heap_victim(self._heap, self._leaf, protected, fallback=self.pool.cached_queue())

    def order(self, n: int) -> list[int]:
        leaves = sorted((s, b) for s, b in self._heap if self._leaf(s, b))
        out = [b for _, b in dict.fromkeys(leaves)][:n]
        for block in self.pool.cached_queue():
            if len(out) >= n:
                break
            if block not in out:
                out.append(block)
        return out

    def rebuild(self) -> None:
        pool = self.pool
        self._children: dict[int, int] = {}
        for key in pool.hash_to_block:
            parent = self._parent_key(pool.hashed[key])
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
        self._heap = [(int(pool.queued_at[b]), b) for b in pool.cached_queue()
                      if not self._children.get(int(pool.block_hash[b]))]
        heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        pool = self.pool
        children: dict[int, int] = {}
        for key in pool.hash_to_block:
            parent = self._parent_key(pool.hashed[key])
            if parent is not None:
                children[parent] = children.get(parent, 0) + 1
        assert children == self._children, "the radix tree's child counts disagree with the pool's records"
        leaves = {b for b in pool.cached_queue() if not children.get(int(pool.block_hash[b]))}
        assert leaves <= {b for s, b in self._heap if self._leaf(s, b)}, "a cached leaf is missing from the heap"
