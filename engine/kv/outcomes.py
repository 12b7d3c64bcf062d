"""Why each prompt block hit or missed: the facts an admission knows, kept as one outcome per block.

The most common complaint about prefix caching is a hit rate near zero with no way to see why. At admission the
manager knows every fact needed to say: which blocks were hits and where from, which content the pool holds past the
first miss, which content was evicted (when, by which policy, for whom, after how long unused) and which was never
there. This book keeps the evictions (bounded: the oldest are forgotten first, and content forgotten that way reads
as "cold"), and classifies a prompt's blocks when it is admitted (kvstream.views.BlockOutcome says the causes).
Changes are journalled while a transaction is open, so a rolled-back step leaves the book as it was.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from kvstream.events import EventKind
from kvstream.views import BlockOutcome

MAX_EVICTIONS = 1 << 18  # evicted contents remembered (about 30 MiB at most); older ones are forgotten first
_ABSENT = object()


class OutcomeBook:
    """Evictions remembered by content hash, and the classification of an admission's prompt blocks."""

    def __init__(self, limit: int = MAX_EVICTIONS):
        self.limit = limit
        self.evictions: OrderedDict[int, tuple] = OrderedDict()  # raw hash -> (step, for, by, idle steps)
        self._journal: list[tuple[int, object]] | None = None

    # ---- what left the pools ----------------------------------------------------------------------------------
    def note(self, event, policy: str, idle: Callable[[int], int | None]) -> None:
        """Remember the contents an EVICTED, DROPPED or CLEARED event names as gone (``idle(hash)``: steps unused)."""
        if event.kind == EventKind.EVICTED:
            by = policy
        elif event.kind == EventKind.DROPPED:
            by = f"{event.tier} tier"
        else:
            return
        for h in event.block_hashes:
            self._put(h, (event.step_id, event.conversation_id, by, idle(h)))

    def remember(self, key: int, step: int, by: str, idle: int | None, for_cid: int = -1) -> None:
        """Content ``key`` (a raw hash) left the pools at ``step``, ``by`` what (a reset, say)."""
        self._put(key, (step, for_cid, by, idle))

    def _put(self, key: int, value: tuple) -> None:
        old = self.evictions.pop(key, _ABSENT)
        if self._journal is not None:
            self._journal.append((key, old))
        self.evictions[key] = value
        while len(self.evictions) > self.limit:
            gone, was = self.evictions.popitem(last=False)
            if self._journal is not None:
                self._journal.append((gone, was))

    # ---- transactions -----------------------------------------------------------------------------------------
    def begin(self) -> None:
        self._journal = []

    def end(self) -> None:
        self._journal = None

    def rollback(self) -> None:
        for key, old in reversed(self._journal or []):
            self.evictions.pop(key, None)
            if old is not _ABSENT:
                self.evictions[key] = old
        # order among the restored entries may differ from before: it only decides which is forgotten first
        self._journal = []

    # ---- an admission -----------------------------------------------------------------------------------------
    def classify(self, hashes: Sequence[int], num_tokens: int, block_size: int, hits: Sequence, limit: int,
                 held: Callable[[int], bool], held_full: Callable[[int], bool] | None = None) -> tuple:
        """One BlockOutcome per block of a prompt of ``num_tokens`` tokens (``hashes``: its full blocks' raw
        hashes) admitted with ``hits`` (device block ids, or tier hits with a ``tier``); ``limit``: most blocks
        that could hit (the last token's block is recomputed for a generating request); ``held(hash)``: the pools
        hold that content now; ``held_full(index)``: for KV cache groups, the full-attention layers hold block
        ``index`` (a shorter hit was a sliding window's doing)."""
        out = []
        for i, hit in enumerate(hits):
            out.append(BlockOutcome(i, getattr(hit, "tier", "device")))
        full = num_tokens // block_size
        unbroken = True  # every block before this one is held: only then is the last token the reason
        for i in range(len(hits), full):
            h = hashes[i]
            if held(h):
                if i >= limit and unbroken:
                    cause = "last_token"
                elif held_full is not None and held_full(i):
                    cause = "window"
                else:
                    cause = "after_break"
                out.append(BlockOutcome(i, cause))
                continue
            unbroken = False  # what follows is recomputed because of this miss ("after_break")
            record = self.evictions.get(h)
            if record is None:
                out.append(BlockOutcome(i, "cold"))
            else:
                step, for_cid, by, idle = record
                out.append(BlockOutcome(i, "evicted", step, for_cid, by, idle))
        if num_tokens % block_size:
            out.append(BlockOutcome(full, "partial"))
        return tuple(out)
