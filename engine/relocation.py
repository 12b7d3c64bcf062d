"""Moving blocks to other physical ids, and the proof that it changes nothing attention computes.

Relocation is the source text's lesson made into an operation: every used and cached block goes to another
physical id, its K/V moves with it, the tables are rewritten, and the attention output of every running
conversation is the same bit for bit. The K/V copy costs what moves (the non-free blocks), not the whole cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvstream.views import BlockState

from .block_pool import random_cycle
from .errors import EngineError
from .validation import check_bool, check_int, check_seed

if TYPE_CHECKING:
    from .engine import Engine


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


def new_ids(engine: "Engine", seed: int | None, compact: bool) -> np.ndarray:
    """The permutation a relocation applies: a random cycle (no block keeps its id), or packing used blocks at the
    low ids in logical order (running conversations' tables first, then cached blocks)."""
    pool, n = engine.pool, engine.cfg.num_blocks
    if not compact:
        return random_cycle(n, seed)
    order: list[int] = []
    seen = np.zeros(n, bool)
    for s in engine.scheduler.running:
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


def relocate(engine: "Engine", seed, compact) -> dict[int, int]:
    """Move every used and cached block; returns old id -> new id for those that moved."""
    seed = check_seed(seed, "relocation seed")
    compact = check_bool(compact, "compact")
    new_id = new_ids(engine, seed, compact)
    with engine.transaction():
        moved = np.flatnonzero(engine.pool.state != BlockState.FREE)
        targets = new_id[moved]
        try:  # what is overwritten, then every moving block, go to temporaries first: fails before writing anything
            overwritten = engine.kv.save_blocks(np.setdiff1d(targets, moved).tolist())
            engine.kv.move_blocks(moved.tolist(), targets.tolist())
        except (RuntimeError, MemoryError) as exc:
            raise EngineError(f"not enough memory to move {len(moved):,} blocks "
                              f"({len(moved) * engine.kv.bytes_per_block / 2**20:.0f} MiB of K/V): {exc}") from None
        def put_back() -> None:  # the K/V back where it was, byte for byte, if the transaction rolls back
            engine.kv.move_blocks(targets.tolist(), moved.tolist())
            engine.kv.restore_slots(overwritten)

        engine.on_rollback(put_back)
        engine.manager.relocate(new_id, engine.seqs.values())
        engine.changed()
    return {int(b): int(new_id[b]) for b in moved if new_id[b] != b}


def probe_attention(engine: "Engine") -> dict[int, np.ndarray]:
    """Attention output of each running conversation's last computed token, every layer: [layers, heads, dim]."""
    seqs = [s for s in engine.scheduler.running if s.num_computed_tokens > 0]
    if not seqs:
        return {}
    stacked = engine.runner.probe(seqs)  # [layers, seqs, heads, dim]
    return {s.seq_id: stacked[:, i] for i, s in enumerate(seqs)}


def dry_run(engine: "Engine", steps: int) -> dict[int, list[int]]:
    """Tokens each conversation would get in the next ``steps`` steps; afterwards the engine is as it was (the
    steps run inside a transaction that is always rolled back)."""
    if steps <= 0 or not engine.has_work():
        return {}
    lengths = {i: s.num_tokens for i, s in engine.seqs.items()}
    with engine.transaction(rollback=True):
        for _ in range(steps):
            if not engine.has_work():
                break
            engine.step_unprotected()
        return {i: s.token_ids[lengths[i]:] for i, s in engine.seqs.items() if s.num_tokens > lengths.get(i, 0)}


def relocate_and_verify(engine: "Engine", seed, compact, lookahead) -> RelocationReport:
    lookahead = check_int(lookahead, "lookahead", 0, 64)
    seed = check_seed(seed, "relocation seed")
    compact = check_bool(compact, "compact")
    before = probe_attention(engine)
    expected = dry_run(engine, lookahead)
    mapping = relocate(engine, seed, compact)
    after = probe_attention(engine)
    got = dry_run(engine, lookahead)
    diff = max((float(np.abs(before[k] - after[k]).max()) for k in before), default=0.0)
    return RelocationReport(mapping, len(mapping), diff, len(before), lookahead, expected == got,
                            sum(len(t) for t in expected.values()))
