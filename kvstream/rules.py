"""Rules of paged KV memory that the engine and the explorer must agree on, written once.

The engine refuses a request with :func:`fit_error`'s message and the explorer's dialogs show the same message at
the field before anything is sent; block owners and event rates are computed the same way everywhere.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Mapping, Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative a and positive b."""
    return -(-a // b)


_GROUP_SALT = 0x9E3779B97F4A7C15  # mixed into the prefix hash of KV cache groups 1.. (cache keys differ per group)
_MASK64 = (1 << 64) - 1


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block of KV cache ``group`` holding the prefix ``block_hash`` (group 0: the hash
    itself). A grouped engine's pool and tiers are keyed by it (a snapshot's ``block_hash`` and a tier's are keys),
    while events carry the plain hash and the group, as vLLM sends them; :func:`raw_hash` undoes it."""
    return block_hash if group == 0 else (block_hash ^ (_GROUP_SALT * group & _MASK64)) or 1


def raw_hash(key: int, group: int) -> int:
    return key if group == 0 else key ^ (_GROUP_SALT * group & _MASK64)


def blocks_needed(num_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """Blocks a conversation of ``num_tokens`` prompt tokens holds once it has generated ``max_new_tokens``: K/V is
    stored for every token but the last one sampled."""
    return cdiv(num_tokens + max_new_tokens - 1, block_size)


def fit_error(num_tokens: int, max_new_tokens: int, *, block_size: int, num_blocks: int,
              max_model_len: int = 0) -> str | None:
    """Why a conversation of ``num_tokens`` prompt tokens and ``max_new_tokens`` new ones can never run, or None.

    ``max_model_len`` is the model's context limit (0: unknown, not checked)."""
    total = num_tokens + max_new_tokens
    if max_model_len and total > max_model_len:
        return (f"this conversation would reach {total} tokens ({num_tokens} prompt + {max_new_tokens} new) but the "
                f"model handles at most {max_model_len} (max_position_embeddings); shorten the prompt or lower "
                f"max_new_tokens")
    need = blocks_needed(num_tokens, max_new_tokens, block_size)
    if need > num_blocks:
        return (f"this conversation needs {need} blocks ({num_tokens} prompt tokens + {max_new_tokens} new tokens at "
                f"{block_size} per block) but the whole pool has {num_blocks}; shorten the prompt, lower "
                f"max_new_tokens or restart with a larger pool")
    return None


def owner_index(block_tables: Mapping[int, Sequence[int]]) -> dict[int, tuple[tuple[int, int], ...]]:
    """block id -> its (conversation id, logical index) entries, by conversation id: every table read once."""
    index: dict[int, list[tuple[int, int]]] = {}
    for cid in sorted(block_tables):
        for logical, block in enumerate(block_tables[cid]):
            index.setdefault(int(block), []).append((cid, logical))
    return {block: tuple(entries) for block, entries in index.items()}


class Rate:
    """Events per second over a sliding window (frames drawn, engine steps, tokens): one helper for all of them.

    ``tick(n)`` counts n events now; ``per_second()`` is the rate over the last ``window`` seconds."""

    def __init__(self, window: float = 1.0, clock=time.perf_counter):
        self.window = window  # seconds the rate is averaged over
        self._clock = clock  # monotonic seconds
        self._marks: deque[tuple[float, int]] = deque()  # (time, running total of events) at each tick
        self._total = 0  # events counted so far

    def tick(self, n: int = 1, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        self._total += n
        self._marks.append((now, self._total))
        while len(self._marks) > 2 and now - self._marks[1][0] > self.window:
            self._marks.popleft()

    def per_second(self, now: float | None = None) -> float:
        """Events per second between the oldest mark in the window and ``now`` (0 with fewer than two marks)."""
        now = self._clock() if now is None else now
        marks = [m for m in self._marks if now - m[0] <= self.window]
        if len(marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = marks[0], marks[-1]
        return (n1 - n0) / max(now - t0, t1 - t0, 1e-6)

    def clear(self) -> None:
        self._marks.clear()
        self._total = 0
