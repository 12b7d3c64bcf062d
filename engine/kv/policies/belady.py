"""Belady: the cached block whose content is wanted again furthest in the future goes first.

The optimum of classic caching, and an upper bound to measure online policies against; it needs the future, so only
a trace replay, which knows every request to come, can offer it (``Future``: the replay driver answers when a
prefix hash is next looked up). "Next use" is the next lookup of the block's prefix hash by a request that has not
been admitted yet, counted in lookups (request, then block position), so of two blocks wanted by the same request
the deeper one goes first; blocks never wanted again go first of all, the longest released among them first.

On a pool, Belady is not the optimum of prefix caching (a block is useful only while its whole prefix is held, and
a request holds all its blocks while it runs), but it is the bound operators know: the gap between LRU and it is
what a better online policy can win at most, roughly.
"""
from __future__ import annotations

import heapq
from typing import Collection, Iterable, Protocol

import numpy as np

from kvstream.views import BlockState

from .base import EvictionPolicy, heap_victim

NEVER = 1 << 62  # the next use of content no request will look up again


class Future(Protocol):
    """What a trace replay knows: when a prefix hash is next looked up, after the requests admitted so far."""

    def next_use(self, block_hash: int) -> int:
        """A position in the trace's sequence of lookups (larger: later), or NEVER."""


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    needs_future = True
    arrays = ("next_use",)

    def __init__(self, future: Future):
        self.future = future

    def allocate(self, num_blocks: int) -> None:
        self.next_use = np.full(num_blocks, NEVER, np.int64)  # each cached block's next use, as of when it was
        #                                                       cached or last looked up

    def _rank(self, block: int) -> None:
        self.next_use[block] = self.future.next_use(int(self.pool.block_hash[block]))
        heapq.heappush(self._heap, (-int(self.next_use[block]), int(self.pool.queued_at[block]), block))

    def cached(self, block: int) -> None:
        self._rank(block)

    def looked_up(self, blocks: Iterable[int]) -> None:
        # the lookup that was the block's next use is happening now: its next use is the one after
        for block in blocks:
            if self.pool.state[block] == BlockState.CACHED:
                self._rank(block)

    def _valid(self, key: int, stamp: int, block: int) -> bool:
        return (self.pool.state[block] == BlockState.CACHED and -key == self.next_use[block]
                and stamp == self.pool.queued_at[block])

    def victim(self, protected: Collection[int] = ()) -> int:
        return heap_victim(self._heap, self._valid, protected)

    def order(self, n: int) -> list[int]:
        blocks = self.cached_blocks()
        keys = np.lexsort((self.pool.queued_at[blocks], -self.next_use[blocks]))
        return blocks[keys][:n].tolist()

    def rebuild(self) -> None:
        blocks = self.cached_blocks()
        self._heap = [(-int(u), int(s), int(b)) for u, s, b in
                      zip(self.next_use[blocks], self.pool.queued_at[blocks], blocks)]
        heapq.heapify(self._heap)

    def check_invariants(self) -> None:
        live = {b for k, s, b in self._heap if self._valid(k, s, b)}
        assert live == set(self.cached_blocks().tolist()), "the Belady heap misses a cached block"
