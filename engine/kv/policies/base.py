"""The one small interface through which the pool asks which cached block to give up first.

The pool (:class:`engine.kv.pool.BlockPool`) keeps every fact about a block; a policy keeps only what its choice
needs (stamps, queues, a heap) and hears of each change through five calls: a block's content was stored (its hash
registered), it became cached (its last reference went), it was revived (a prefix hit took a cached block back), its
hash was dropped (evicted or cleared), or an admission looked past its first miss and saw it. The pool asks
:meth:`EvictionPolicy.victim` when it must evict, never evicting a block the admission in progress protects.

A policy's state lives in per-block numpy arrays named in ``arrays`` (and, for S3-FIFO's ghost list, arrays too), so
the pool's checkpoint copies them with its own and a rollback or a relocation rebuilds the rest from them: a failed
step leaves the policy exactly as it was, as it leaves the pool.
"""
from __future__ import annotations

import abc
import heapq
from typing import Callable, Collection, Iterable

import numpy as np

from kvstream.views import BlockState


class EvictionPolicy(abc.ABC):
    """Chooses which CACHED block (free, but holding a reusable prefix) an allocation evicts."""

    name = ""  # as --eviction-policy spells it
    needs_future = False  # True: only a trace replay, which knows every request to come, can offer it
    arrays: tuple[str, ...] = ()  # per-block arrays copied by the pool's checkpoint, permuted by a relocation

    def bind(self, pool) -> None:
        """Attach to ``pool`` (its ``num_blocks`` sizes the arrays) and build the derived state."""
        self.pool = pool
        self.allocate(pool.num_blocks)
        self.rebuild()

    def allocate(self, num_blocks: int) -> None:
        """Make the per-block arrays (zeroed: no block has a history yet)."""

    # ---- what the pool tells the policy ---------------------------------------------------------------------
    def stored(self, block: int) -> None:
        """``block``'s content was registered under its prefix hash (it entered the cache)."""

    def cached(self, block: int) -> None:
        """``block``'s last reference went: it is evictable now (the pool has put it at the tail of its queue)."""

    def revived(self, block: int) -> None:
        """A cached ``block`` got a reference again (a prefix hit): it is not evictable while held."""

    def dropped(self, block: int, block_hash: int) -> None:
        """``block`` lost its hash (evicted, or the prefix cache was reset): it holds nothing reusable now."""

    def looked_up(self, blocks: Iterable[int]) -> None:
        """An admission saw these cached blocks after its first miss: their content is wanted now, but not as
        hits (the prompt recomputes them). A policy that ranks by what is wanted next updates them."""

    @abc.abstractmethod
    def victim(self, protected: Collection[int] = ()) -> int:
        """The cached block to evict next, never one in ``protected``; the pool then evicts it (calling
        :meth:`dropped`). Called only when the pool has an evictable block outside ``protected``."""

    def order(self, n: int) -> list[int]:
        """The first ``n`` cached blocks in the order this policy would evict them now (for previews)."""
        out: list[int] = []
        taken: set[int] = set()
        while len(out) < n and len(taken) < self.pool.num_cached_blocks:
            # a preview must change nothing: policies whose choice has side effects override this
            block = self.victim(taken)
            out.append(block)
            taken.add(block)
        return out

    # ---- rollback and relocation ----------------------------------------------------------------------------
    def state(self) -> tuple:
        """Copies of everything :meth:`restore` needs (the pool's checkpoint holds them)."""
        return tuple(getattr(self, name).copy() for name in self.arrays)

    def restore(self, state: tuple) -> None:
        for name, array in zip(self.arrays, state):
            setattr(self, name, array)
        self.rebuild()

    def permute(self, new_id: np.ndarray) -> None:
        """Old block b is now ``new_id[b]`` (the pool rebuilds the policy afterwards)."""
        for name in self.arrays:
            old = getattr(self, name)
            if len(old) == len(new_id):
                moved = np.empty_like(old)
                moved[new_id] = old
                setattr(self, name, moved)

    def rebuild(self) -> None:
        """Derived structures (heaps, queues) from the arrays and the pool's own arrays."""

    def reset(self) -> None:
        """The prefix cache was cleared: every block's history goes."""
        self.allocate(self.pool.num_blocks)
        self.rebuild()

    def check_invariants(self) -> None:
        """Raise AssertionError unless the policy's view of the pool agrees with the pool."""

    # ---- helpers --------------------------------------------------------------------------------------------
    def cached_blocks(self) -> np.ndarray:
        return np.flatnonzero(self.pool.state == BlockState.CACHED)


def heap_victim(heap: list[tuple], valid: Callable[..., bool], protected: Collection[int],
                fallback: Iterable[int] = ()) -> int:
    """The block of ``heap``'s first entry that is still valid and not protected (an entry's last item is its block).

    Heap-ordered policies push an entry whenever a block's key changes and never search the heap to remove the old
    one: such entries go stale (the block was revived, evicted or stored again since) and ``valid(*entry)`` drops
    them as they reach the top, which keeps every hook O(log n). Protected entries are set aside and pushed back.
    ``fallback``: blocks to take, in order, when no entry qualifies (the radix cache's cached blocks when every one
    is extended by a block in use)."""
    skipped = []
    try:
        while heap:
            entry = heap[0]
            if not valid(*entry):
                heapq.heappop(heap)
                continue
            if entry[-1] in protected:
                skipped.append(heapq.heappop(heap))
                continue
            return entry[-1]
    finally:
        for entry in skipped:
            heapq.heappush(heap, entry)
    for block in fallback:
        if block not in protected:
            return block
    raise RuntimeError("no evictable cached block (callers check first)")
