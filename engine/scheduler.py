"""Continuous batching: which conversations prefill, which decode, and who is preempted when blocks run out.

Pure bookkeeping on top of :class:`BlockPool` (no torch). Every step first gives each running conversation room for
one more token (a new block when its tail is full, or a private copy when its tail is shared), preempting the most
recently admitted conversation when the pool is exhausted; then it admits waiting conversations whose prompts fit.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool
from .sequence import Sequence
from .snapshot import Status


@dataclass
class ScheduledBatch:
    """What one step computes."""

    decodes: list[Sequence] = field(default_factory=list)  # one new token each
    prefills: list[Sequence] = field(default_factory=list)  # compute K/V of tokens [num_computed, num_tokens)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # copy-on-write (src, dst, num_slots) to run first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """FCFS admission, recompute preemption (newest first), copy-on-write of shared tail blocks."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0
        self.num_cow_copies = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            while not self._can_append(seq):
                if queue:
                    victim = queue.pop()
                    self.preempt(victim)
                    batch.preempted.append(victim)
                else:
                    self.preempt(seq)
                    batch.preempted.append(seq)
                    break
            else:
                self._reserve_slot(seq, batch)
                batch.decodes.append(seq)
        if not batch.preempted:
            self._admit(batch)
        return batch

    def _needs_block(self, seq: Sequence) -> bool:
        """Writing position num_computed needs a block we do not own alone: a fresh one, or a copy of a shared tail."""
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_table):
            return True
        return self.pool.ref_count[seq.block_table[index]] > 1

    def _can_append(self, seq: Sequence) -> bool:
        return not self._needs_block(seq) or self.pool.can_allocate(1)

    def _reserve_slot(self, seq: Sequence, batch: ScheduledBatch) -> None:
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_table):
            seq.block_table.extend(self.pool.allocate(1, seq.seq_id))
            return
        old = seq.block_table[index]
        if self.pool.ref_count[old] > 1:  # copy-on-write: never write into a block someone else reads
            new = self.pool.allocate(1, seq.seq_id)[0]
            filled = seq.num_computed_tokens - index * self.block_size
            self.pool.num_filled[new] = filled
            batch.copies.append((old, new, filled))
            self.pool.free([old])
            seq.block_table[index] = new
            self.num_cow_copies += 1

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold this prompt's leading full blocks. The last token is always computed."""
        hashes = seq.full_block_hashes(self.block_size)
        limit = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _admit(self, batch: ScheduledBatch) -> None:
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self._prefix_hits(seq)
            num_new_tokens = seq.num_tokens - len(hits) * self.block_size
            if num_new_tokens > budget and batch.prefills:
                break
            num_blocks = -(-seq.num_tokens // self.block_size) - len(hits)
            num_revived = sum(1 for b in hits if self.pool.ref_count[b] == 0)  # cached hits leave the free queue
            if not self.pool.can_allocate(num_blocks + num_revived):
                break
            self.waiting.popleft()
            for block in hits:
                self.pool.acquire(block, seq.seq_id)
            seq.block_table = hits + self.pool.allocate(num_blocks, seq.seq_id)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens
            seq.status = Status.RUNNING
            seq.version += 1
            self.running.append(seq)
            batch.prefills.append(seq)
            budget -= num_new_tokens

    # ---- leaving the running set ------------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV (full blocks stay cached), go back to the front of the queue."""
        self._release(seq)
        seq.status = Status.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: Status) -> None:
        if seq in self.running:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.version += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.version += 1
        if seq in self.running:
            self.running.remove(seq)
