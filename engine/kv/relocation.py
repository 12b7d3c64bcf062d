"""Moving blocks to other physical ids, and the proof that it changes nothing attention computes.

Relocation is the source text's lesson made into an operation: every used and cached block goes to another
physical id, its K/V moves with it, the tables are rewritten, and the attention output of every running
conversation is the same bit for bit. The K/V copy costs what moves (the non-free blocks), not the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence as Seq

import numpy as np

from kvstream.views import BlockState

from .pool import random_cycle
from ..errors import EngineError
from ..sequence import Sequence


@dataclass(frozen=True)
class RelocationReport:
    """What :meth:`Engine.relocate_and_verify` moved, and the proof that attention did not change."""

    mapping: dict  # old physical id -> new physical id, for every used or cached block that moved
    num_moved: int
    max_abs_diff: float  # max |attention output before - after| over running conversations and layers
    num_conversations_checked: int
    lookahead_steps: int = 0  # steps decoded twice, from the old layout and from the new one, then rolled back
    tokens_identical: bool = True  # those steps produced the same tokens for every conversation
    num_tokens_compared: int = 0


def new_ids(pool, running: Seq[Sequence], seed: int | None, compact: bool) -> np.ndarray:
    """The permutation a relocation applies: a random cycle (no block keeps its id), or packing used blocks at the
    low ids in logical order (running conversations' tables first, then cached blocks)."""
    n = pool.num_blocks
    if not compact:
        return random_cycle(n, seed)
    order: list[int] = []
    seen = np.zeros(n, bool)
    for s in running:
        for b in [b for g in range(1 + len(s.extra_tables)) for b in s.group_table(g)]:  # every KV cache group
            if b >= 0 and not seen[b]:  # (-1: a block a sliding window released)
                seen[b] = True
                order.append(b)
    order += [int(b) for b in np.flatnonzero(pool.state == BlockState.CACHED) if not seen[b]]
    seen[order] = True
    order += np.flatnonzero(~seen).tolist()
    new_id = np.empty(n, np.int64)
    new_id[np.asarray(order, dtype=np.int64)] = np.arange(n)
    return new_id


def relocate(manager, kv, seqs: Iterable[Sequence], running: Seq[Sequence], seed: int | None, compact: bool,
             on_rollback: Callable[[Callable[[], None]], None]) -> dict[int, int]:
    """Move every used and cached block: the K/V in ``kv``, then the pool and every table through ``manager`` (the
    pool's one writer). Runs inside the caller's transaction: ``on_rollback`` takes the undo that puts the K/V
    back. Returns old id -> new id for the blocks that moved."""
    pool = manager.pool
    new_id = new_ids(pool, running, seed, compact)
    moved = np.flatnonzero(pool.state != BlockState.FREE)
    targets = new_id[moved]
    try:  # what is overwritten, then every moving block, go to temporaries first: fails before writing anything
        overwritten = kv.save_blocks(np.setdiff1d(targets, moved).tolist())
        kv.move_blocks(moved.tolist(), targets.tolist())
    except (RuntimeError, MemoryError) as exc:
        raise EngineError(f"not enough memory to move {len(moved):,} blocks "
                          f"({len(moved) * kv.bytes_per_block / 2**20:.0f} MiB of K/V): {exc}") from None

    def put_back() -> None:  # the K/V back where it was, byte for byte, if the transaction rolls back
        kv.move_blocks(targets.tolist(), moved.tolist())
        kv.restore_slots(overwritten)

    on_rollback(put_back)
    manager.relocate(new_id, seqs)
    return {int(b): int(new_id[b]) for b in moved if new_id[b] != b}


def probe_attention(runner, running: Seq[Sequence]) -> dict[int, np.ndarray]:
    """Attention output of each running conversation's last computed token, every layer: [layers, heads, dim]."""
    seqs = [s for s in running if s.num_computed_tokens > 0]
    if not seqs:
        return {}
    stacked = runner.probe(seqs)  # [layers, seqs, heads, dim]
    return {s.seq_id: stacked[:, i] for i, s in enumerate(seqs)}


def report(before: dict, after: dict, expected: dict, got: dict, mapping: dict[int, int],
           lookahead: int) -> RelocationReport:
    """The proof of a relocation from the attention probed before and after it and the tokens the next
    ``lookahead`` steps gave from the old layout (``expected``) and from the new one (``got``)."""
    diff = max((float(np.abs(before[k] - after[k]).max()) for k in before), default=0.0)
    return RelocationReport(mapping, len(mapping), diff, len(before), lookahead, expected == got,
                            sum(len(t) for t in expected.values()))
