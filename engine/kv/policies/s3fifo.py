"""S3-FIFO (Yang et al., SOSP 2023): a small probation queue, a main queue, and a ghost list of recent evictions.

New content enters the small queue (a tenth of the pool); content evicted from it that was never hit leaves only its
hash in the ghost list, and content stored again while its hash is a ghost goes straight to the main queue. Hits only
count (a frequency of at most 3); the queues move on eviction: the small queue's oldest block goes to the main queue
if it was hit since it entered, else it is the victim; the main queue's oldest block is put back at its tail with one
hit less if it had any, else it is the victim. Most one-hit content (a prompt's unique tail) leaves through the small
queue quickly while content hit twice settles in the main queue.

In a pool, blocks in use cannot be evicted: one met at the head of the small queue is promoted (someone is using
it), one at the head of the main queue goes back to its tail, and protected ones are passed over where they stand.
Everything lives in per-block arrays and a ring of ghost hashes, so the pool's checkpoint covers it.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Collection

import numpy as np

from kvstream.views import BlockState

from .base import EvictionPolicy

SMALL, MAIN = 1, 2
SMALL_SHARE = 0.1  # the small queue's share of the pool (the paper's 10%)
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"
    arrays = ("queue", "freq", "qstamp", "ghost", "ghost_at")
    small_share = SMALL_SHARE  # the small queue's share of the pool
    ghost_factor = 1.0 - SMALL_SHARE  # ghost hashes kept, as a multiple of the pool's size (S3-FIFO: the main queue's)
    main_lru = False  # True: a hit block's release moves it to the main queue's tail (S3-LRU)

    def allocate(self, num_blocks: int) -> None:
        self.small_target = max(1, int(num_blocks * self.small_share))
        self.queue = np.zeros(num_blocks, np.int8)  # SMALL, MAIN, or 0 (holds nothing)
        self.freq = np.zeros(num_blocks, np.int8)  # hits since it entered its queue, at most MAX_FREQ
        self.qstamp = np.zeros(num_blocks, np.int64)  # its place in its queue (larger: nearer the tail)
        ghost = int(num_blocks * self.ghost_factor)
        self.ghost = np.zeros(max(1, ghost), np.uint64)  # ring of evicted hashes (0: empty)
        self.ghost_at = np.zeros(1, np.int64)  # the ring's next slot

    # ---- hooks ----------------------------------------------------------------------------------------------
    def stored(self, block: int) -> None:
        key = int(self.pool.block_hash[block])
        slot = self._ghost_index.pop(key, None)
        if slot is not None:
            self.ghost[slot] = 0
        self.freq[block] = 0
        self._enter(block, MAIN if slot is not None else SMALL)

    def revived(self, block: int) -> None:
        self.freq[block] = min(int(self.freq[block]) + 1, MAX_FREQ)
        q = int(self.queue[block])
        if q:
            self._evictable[q] -= 1

    def cached(self, block: int) -> None:
        q = int(self.queue[block])
        if q:
            self._evictable[q] += 1
            if q == MAIN and self.main_lru:  # used again: the main queue's most recent
                self._enter(block, MAIN)

    def dropped(self, block: int, block_hash: int) -> None:
        q = int(self.queue[block])
        if q:
            self._queues[q].pop(block, None)
            self.queue[block] = 0
            if self.pool.state[block] == BlockState.CACHED:
                self._evictable[q] -= 1

    # ---- queues ---------------------------------------------------------------------------------------------
    def _enter(self, block: int, q: int) -> None:
        old = int(self.queue[block])
        cached = self.pool.state[block] == BlockState.CACHED
        if old:
            self._queues[old].pop(block, None)
            self._evictable[old] -= cached
        self._evictable[q] += cached
        self._stamp += 1
        self.qstamp[block] = self._stamp
        self.queue[block] = q
        self._queues[q][block] = None

    def _remember(self, block: int) -> None:
        at = int(self.ghost_at[0])
        old = int(self.ghost[at])
        if old and self._ghost_index.get(old) == at:
            del self._ghost_index[old]
        key = int(self.pool.block_hash[block])
        self.ghost[at] = key
        self._ghost_index[key] = at
        self.ghost_at[0] = (at + 1) % len(self.ghost)

    def _has_evictable(self, q: int, protected: Collection[int]) -> bool:
        if not protected:
            return self._evictable[q] > 0
        state, queue = self.pool.state, self._queues[q]
        return self._evictable[q] > sum(1 for b in protected if b in queue and state[b] == BlockState.CACHED)

    def victim(self, protected: Collection[int] = ()) -> int:
        state, small, main = self.pool.state, self._queues[SMALL], self._queues[MAIN]
        for _ in range(8 * (self.pool.num_blocks + 1)):  # each pass moves or demotes a block: it ends
            from_small = len(small) >= self.small_target or not self._has_evictable(MAIN, protected)
            queue = small if from_small and self._has_evictable(SMALL, protected) else main
            for block in queue:
                if block in protected:
                    continue
                if state[block] != BlockState.CACHED:  # in use: it cannot go
                    self.freq[block] = 0
                    self._enter(block, MAIN)
                elif self.freq[block] > 0 and (queue is small or not self.main_lru):  # hit since it entered: it
                    self.freq[block] = 0 if queue is small else self.freq[block] - 1  # stays, one hit spent
                    self._enter(block, MAIN)
                else:
                    if queue is small:
                        self._remember(block)
                    return block
                break  # the queue changed under the loop: look again
        raise RuntimeError("no evictable cached block (callers check first)")

    def order(self, n: int) -> list[int]:
        """A preview without moving anything: unhit cached blocks of the small queue, then of the main queue,
        then the rest in queue order (the victims the queues' next moves would reach)."""
        state = self.pool.state
        ordered = [b for q in (SMALL, MAIN) for b in self._queues[q] if state[b] == BlockState.CACHED]
        return ([b for b in ordered if self.freq[b] == 0] + [b for b in ordered if self.freq[b] > 0])[:n]

    # ---- rollback -------------------------------------------------------------------------------------------
    def rebuild(self) -> None:
        self._queues = {}
        for q in (SMALL, MAIN):
            blocks = np.flatnonzero(self.queue == q)
            blocks = blocks[np.argsort(self.qstamp[blocks], kind="stable")]
            self._queues[q] = OrderedDict.fromkeys(blocks.tolist())
        self._ghost_index = {int(k): i for i, k in enumerate(self.ghost.tolist()) if k}
        self._stamp = int(self.qstamp.max(initial=0))
        cached = self.pool.state == BlockState.CACHED
        self._evictable = {q: int((cached & (self.queue == q)).sum()) for q in (SMALL, MAIN)}

    def check_invariants(self) -> None:
        held = set(np.flatnonzero(self.pool.block_hash != 0).tolist())
        queued = set(self._queues[SMALL]) | set(self._queues[MAIN])
        assert queued == held, "S3-FIFO's queues and the pool's hashed blocks differ"
        assert not set(self._queues[SMALL]) & set(self._queues[MAIN]), "a block in both queues"
        cached = self.pool.state == BlockState.CACHED
        for q in (SMALL, MAIN):
            assert self._evictable[q] == int((cached & (self.queue == q)).sum()), "S3-FIFO's evictable count is off"


class S3LRUPolicy(S3FIFOPolicy):
    """S3-LRU: S3-FIFO's probation queue and ghost list in front of an LRU main queue.

    Measured on the shipped Mooncake trace (docs/traffic.md), S3-FIFO gains on LRU in a small pool and loses in a
    larger one, because its main queue forgets recency: a block hit again goes back only when the queue reaches it.
    Here a block used again goes to the main queue's tail when released, as LRU would put it, while the probation
    queue (four tenths of the pool) still lets one-time content leave early and the ghost list (twice the pool's
    size) brings back content that returned after it left."""

    name = "s3lru"
    small_share = 0.4
    ghost_factor = 2.0
    main_lru = True
