"""Continuous batching: which conversations compute how many tokens this step, and who is preempted when blocks
run out.

Bookkeeping only (no torch), and it never touches the pool itself: it asks the :class:`KVCacheManager`. Each step
shares a token budget (``max_num_batched_tokens``) as vLLM v1 does: running conversations first, in admission
order (a decode takes 1 token, a prompt still being prefilled takes a chunk of what is left), then waiting ones are
admitted with their prefix-cache hits and a first chunk. When a running conversation cannot get a block, the most
recently admitted one is preempted (recompute) until it can.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvstream.views import FinishReason, Status

from .kv.manager import KVCacheManager
from .sequence import Sequence


@dataclass
class ScheduledBatch:
    """What one step computes: ``seqs[i]`` computes its next ``num_tokens[i]`` tokens."""

    seqs: list[Sequence] = field(default_factory=list)  # running order; single-token work is moved first by the runner
    num_tokens: list[int] = field(default_factory=list)  # tokens each computes this step (>= 1)
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # copy-on-write (src, dst, num_slots) to run first
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    """FCFS admission under a per-step token budget, chunked prefill, recompute preemption (newest first)."""

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 chunked_prefill: bool = True):
        self.manager = manager
        self.block_size = manager.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill  # False: whole prompts only (one may exceed the budget if alone)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order; the last one is preempted first
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_room(self) -> bool:
        """Whether one more conversation may run now (max_num_seqs)."""
        return len(self.running) < self.max_num_seqs

    def run_now(self, seq: Sequence) -> None:
        """A fork of a running conversation joins the running set at once (the caller checked has_room)."""
        seq.status = Status.RUNNING
        seq.version += 1
        self.running.append(seq)

    # ---- one step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        manager = self.manager
        budget = self.max_num_batched_tokens
        queue = deque(self.running)
        while queue and budget > 0:
            seq = queue.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            while not manager.can_allocate(manager.num_blocks_for(seq, n)):
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.copies += manager.allocate_slots(seq, n)
                batch.add(seq, n)
                budget -= n
        if not batch.preempted:
            self._admit(batch, budget)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        manager, bs = self.manager, self.block_size
        while self.waiting and self.has_room() and budget > 0:
            seq = self.waiting[0]
            hits = manager.prefix_hits(seq)
            remaining = seq.num_tokens - len(hits) * bs
            if self.chunked_prefill:
                n = min(remaining, budget)
            elif remaining > budget and batch.seqs:
                break
            else:
                n = remaining
            if not manager.can_allocate(manager.num_blocks_for(seq, n, hits)):
                break
            self.waiting.popleft()
            batch.copies += manager.admit(seq, hits, n)
            seq.num_cached_tokens = seq.num_computed_tokens
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens
            seq.status = Status.RUNNING
            seq.version += 1
            self.running.append(seq)
            batch.add(seq, n)
            batch.admitted.append(seq)
            budget -= n

    # ---- leaving the running set ------------------------------------------------------------------------------
    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV (full blocks stay cached), go back to the front of the queue."""
        self.manager.preempt(seq)
        self.running.remove(seq)
        seq.status = Status.PREEMPTED
        seq.num_preemptions += 1
        seq.version += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: Status, reason: FinishReason) -> None:
        if seq in self.running:
            self.manager.free(seq)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.finish_reason = reason
        seq.version += 1

    # ---- rollback ---------------------------------------------------------------------------------------------
    def checkpoint(self) -> tuple:
        return list(self.running), list(self.waiting), self.num_preemptions, self.prefix_queries, self.prefix_hits

    def restore(self, checkpoint: tuple) -> None:
        running, waiting, self.num_preemptions, self.prefix_queries, self.prefix_hits = checkpoint
        self.running = running
        self.waiting = deque(waiting)
