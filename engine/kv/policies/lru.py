"""LRU, vLLM v1's free block queue: the least recently released cached block goes first.

vLLM keeps free blocks in one doubly linked queue; a finished request's blocks join its tail in reverse order (its
last block first, so a prefix's deeper blocks are evicted before the blocks they extend) and eviction takes the
head. The pool already keeps its cached blocks in exactly that order (release order), so this policy only reads it.
A prefix hit takes a block out of the queue; nothing else reorders it.
"""
from __future__ import annotations

from typing import Collection

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def victim(self, protected: Collection[int] = ()) -> int:
        for block in self.pool.cached_queue():
            if block not in protected:
                return block
        raise RuntimeError("no evictable cached block (callers check first)")

    def order(self, n: int) -> list[int]:
        out = []
        for block in self.pool.cached_queue():
            if len(out) >= n:
                break
            out.append(block)
        return out
