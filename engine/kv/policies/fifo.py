"""FIFO: the cached block whose content entered the pool earliest goes first; hits do not refresh it.

"Entered" is when its hash was registered (the block was filled and stored, or loaded back from a lower tier). A
block that is evicted and stored again later enters anew. Cheap and scan-resistant in neither direction: it is the
baseline every other policy is measured against, as in kvcache-simulator.
"""
from __future__ import annotations

import heapq
from typing import Collection

import numpy as np

from kvstream.views import BlockState

from .base import EvictionPolicy, heap_victim


class FIFOPolicy(EvictionPolicy):
    name = "fifo"
    arrays = ("stored_at",)

    def allocate(self, num_blocks: int) -> None:
        self.stored_at = np.zeros(num_blocks, np.int64)  # stamp of the block's last store (0: never)
        self._clock = 0

    def stored(self, block: int) -> None:
        self._clock += 1
        self.stored_at[block] = self._clock
        if self.pool.state[block] == BlockState.CACHED:
            heapq.heappush(self._heap, (self._clock, block))

    def cached(self, block: int) -> None:
        heapq.heappush(self._heap, (int(self.stored_at[block]), block))

    def _valid(self, stamp: int, block: int) -> bool:
        return self.pool.state[block] == BlockState.CACHED and self.stored_at[block] == stamp

    def victim(self, protected: Collection[int] = ()) -> int:
        return heap_victim(self._heap, self._valid, protected)

    def order(self, n: int) -> list[int]:
        blocks = self.cached_blocks()
        return blocks[np.argsort(self.stored_at[blocks], kind="stable")][:n].tolist()

    def rebuild(self) -> None:
        blocks = self.cached_blocks()
        self._heap = list(zip(self.stored_at[blocks].tolist(), blocks.tolist()))
        heapq.heapify(self._heap)
        self._clock = int(self.stored_at.max(initial=0))  # stamps only grow: the newest is the clock

    def check_invariants(self) -> None:
        blocks = self.cached_blocks()
        assert (self.stored_at[blocks] > 0).all(), "a cached block was never stored"
        live = {b for s, b in self._heap if self._valid(s, b)}
        assert live == set(blocks.tolist()), "the FIFO heap misses a cached block"
