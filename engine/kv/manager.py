"""The one writer of the block pool: allocation, sharing, copy-on-write, hashing, release, relocation.

Why one writer: every later feature (history, recordings, watching from another process, KV events for routers)
needs to know every change to the pool, and a rolled-back step must be able to undo them all. So the scheduler
asks, the engine and the lesson call, and only this class changes :class:`BlockPool`; each change it makes is also
a :class:`kvstream.events.BlockEvent`, in order, drained with :meth:`take_events`.

It works per conversation (a :class:`engine.sequence.Sequence`), in the manner of vLLM v1's ``KVCacheManager`` and
nano-vllm's ``BlockManager``: ``prefix_hits`` / ``admit`` (reuse cached full blocks of a prompt), ``can_allocate_slots``
/ ``allocate_slots`` (room for the next tokens, copying a shared tail first), ``commit`` (slots filled, full blocks
hashed), ``fork``, ``free`` / ``preempt``, ``relocate`` and ``reset_prefix_cache``. Bookkeeping only: the K/V
copies it asks for are returned to the caller, which owns the tensors.

One manager over N KV cache groups (:mod:`engine.kv.groups`): a conversation has one block table per group (group
0's is ``seq.block_table``, the others ``seq.extra_tables``), every group draws from the one pool, and each group's
kind is a small policy object (full attention keeps every block; a sliding window releases what falls out of it).
A plain model is the case of one full-attention group, through the same code: vLLM v1's coordinator over its
single-type managers, folded into one class because the kinds differ in three answers, not in their bookkeeping.
"""
from __future__ import annotations

from functools import partial
from typing import Iterable

import numpy as np

from kvstream.events import WINDOW_REASON, BlockEvent, EventKind
from kvstream.prompt_check import Held, Removal, classify_prompt
from kvstream.rules import cdiv, fit_error, group_key, raw_hash
from kvstream.views import NO_HASH, BlockState, KVCacheGroupInfo

from .groups import ABSENT, FULL_ATTENTION, policy_for
from .outcomes import OutcomeBook
from .pool import BlockPool, HashedBlock, hash_block_tokens
from ..sequence import Sequence
from .tiers import TierHit, TierLoad, TierStore

MAX_PENDING_EVENTS = 200_000  # events nobody took; older ones are dropped and counted (a headless script that never
#                               calls take_events() must not grow without bound)


class GroupHits(list):
    """Prefix hits of every group: as a list, group 0's hit entries (its length is the number of hit blocks, all
    the scheduler needs); ``tables`` holds each group's (-1 before a sliding window; a :class:`TierHit` where a lower
    tier holds the block)."""

    tables: list[list]


def hit_limit(seq: Sequence, block_size: int) -> int:
    """Most leading full blocks of ``seq`` that can be prefix hits: all of them for a prefill-only request, else all
    but the one holding its last token, which is computed again for the logits of its first output (as vLLM does)."""
    if seq.prefill_only:
        return seq.num_tokens // block_size
    return (seq.num_tokens - 1) // block_size


class KVCacheManager:
    """Per-conversation operations on a :class:`BlockPool` over the model's KV cache ``groups`` (default: one
    full-attention group), each change recorded as block events."""

    def __init__(self, pool: BlockPool, groups: tuple[KVCacheGroupInfo, ...] = (FULL_ATTENTION,)):
        self.pool = pool
        self.block_size = pool.block_size
        self.groups = tuple(groups)
        self.num_groups = len(self.groups)
        self.policies = tuple(policy_for(g, pool.block_size) for g in self.groups)  # each group's kind's rule
        self.windows = [g.sliding_window for g in self.groups]
        # full-attention groups first when looking for prefix hits: their first miss bounds every group's hit
        self._hit_order = sorted(range(self.num_groups), key=lambda g: self.policies[g].releases)
        self._releasing = [g for g, p in enumerate(self.policies) if p.releases]  # groups whose blocks go early
        # one full-attention group: group 0's tables say everything (no holes, no other group), so the views leave
        # the per-group fields out, as for any plain pool
        self.plain = self.num_groups == 1 and not self._releasing
        self.block_group = np.zeros(pool.num_blocks, np.int8)  # group of each block taken (kept when freed)
        self.events: list[BlockEvent] = []  # not yet taken, oldest first
        self.num_dropped_events = 0  # events dropped because nobody took them (MAX_PENDING_EVENTS)
        self._published = 0  # events[:_published] were already handed to events_since_publish()
        self.holders: dict[int, set[int]] = {}  # used block -> ids of the conversations whose tables name it
        self.num_cow_copies = 0
        self.num_evictions = 0
        self.num_window_releases = 0  # blocks released because they fell out of a window
        self.tiers: TierStore | None = None  # host / disk tiers (attach_tiers); None: evicted blocks are lost
        self.read_device_blocks = None  # block ids -> their raw K/V bytes, uint8 [n, bytes] (KVCache.read_blocks_bytes)
        self.pending_loads: list[TierLoad] = []  # blocks loaded from a lower tier, for the caller to write (take_loads)
        self._last_offload: tuple[list[int], np.ndarray] | None = None  # what _take_blocks' evictions read (_load)
        self.prompt_sources: dict[int, dict[str, int]] = {}  # seq id -> its last admission's prompt tokens by source
        self._sources_undo: list[tuple[int, dict | None]] | None = None  # (seq id, old value) in a transaction
        self._protected: frozenset[int] = frozenset()  # blocks the admission in progress must not evict
        self.outcomes = OutcomeBook()  # what left the pools, to say why a prompt block missed
        self.prompt_outcomes: dict[int, tuple] = {}  # seq id -> its last admission's BlockOutcome per block
        self.outcome_totals: dict[str, int] = {}  # outcome -> prompt blocks over every admission (the --json totals)

    # ---- events ---------------------------------------------------------------------------------------------
    def emit(self, kind: EventKind, conversation_id: int = -1, **fields) -> None:
        """Record one event at the pool's current step (and, for content leaving the pools, remember it)."""
        event = BlockEvent(step_id=self.pool.clock, kind=kind, conversation_id=conversation_id, **fields)
        self.events.append(event)
        if kind == EventKind.EVICTED or kind == EventKind.DROPPED:
            self.outcomes.note(event, self.pool.policy.name, self.pool.evicted_idle.get)

    def _trim_events(self) -> None:
        """Drop the oldest untaken events past MAX_PENDING_EVENTS (between transactions only)."""
        if len(self.events) > MAX_PENDING_EVENTS:
            drop = len(self.events) - MAX_PENDING_EVENTS // 2
            del self.events[:drop]
            self.num_dropped_events += drop
            self._published = max(0, self._published - drop)

    def take_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        self._published = 0
        return events

    def events_since_publish(self) -> list[BlockEvent]:
        """Events recorded since the last call (for the KV-event publisher, which sees each committed event once)."""
        out = self.events[self._published:]
        self._published = len(self.events)
        return out

    # ---- steps ----------------------------------------------------------------------------------------------
    def start_step(self, step_id: int) -> None:
        """A new engine step begins: events and access stamps from now on carry ``step_id`` (rolled back with the
        pool's checkpoint)."""
        self.pool.clock = step_id

    def touch_used(self, step_id: int) -> None:
        """Every used block was read by attention in step ``step_id`` (LRU order of what becomes cached)."""
        self.pool.touch_used(step_id)

    def take_changed_blocks(self):
        """The pool's record of the blocks written since the last call (BlockPool.take_changes: two bool masks,
        or None when any block may have changed); the views take it with each snapshot, to promise the pool-stream
        encoder what to compare."""
        return self.pool.take_changes()

    # ---- tables ---------------------------------------------------------------------------------------------
    def tables_of(self, seq: Sequence) -> tuple[list[int], ...]:
        """Every group's table of ``seq`` (group order; empty ones for a conversation never admitted). Asked for
        each conversation a few times a step, so one group answers first."""
        if self.num_groups == 1:
            return (seq.block_table,)
        if len(seq.extra_tables) == self.num_groups - 1:
            return (seq.block_table, *seq.extra_tables)
        return (seq.block_table,) + tuple([] for _ in range(self.num_groups - 1))

    def _own_tables(self, seq: Sequence) -> tuple[list[int], ...]:
        """:meth:`tables_of`, giving a conversation that has none its own empty tables of groups 1.. first."""
        if self.num_groups == 1:
            return (seq.block_table,)
        if len(seq.extra_tables) != self.num_groups - 1:
            seq.extra_tables = [[] for _ in range(self.num_groups - 1)]
        return (seq.block_table, *seq.extra_tables)

    # ---- queries --------------------------------------------------------------------------------------------
    def fit_error(self, num_tokens: int, max_new_tokens: int, chunk: int, max_model_len: int) -> str | None:
        """Why a conversation of ``num_tokens`` prompt and ``max_new_tokens`` new tokens can never run (computing at
        most ``chunk`` tokens a step), or None: past the model's context, or more blocks at once than the whole pool
        has. A plain pool counts its one table; with groups, every group's blocks count and a sliding group holds
        only its window's (so a conversation may outgrow a pool that its full-attention layers alone would fill)."""
        bs, num_blocks = self.block_size, self.pool.num_blocks
        problem = fit_error(num_tokens, max_new_tokens, block_size=bs, num_blocks=num_blocks if self.plain else 1 << 62,
                            max_model_len=max_model_len)
        if problem or self.plain:
            return problem
        need = self.peak_blocks(num_tokens + max_new_tokens, chunk)
        if need <= num_blocks:
            return None
        return (f"this conversation needs up to {need} blocks across its {self.num_groups} KV cache groups "
                f"({num_tokens} prompt tokens + {max_new_tokens} new tokens at {bs} per block) but the whole pool "
                f"has {num_blocks}; shorten the prompt, lower max_new_tokens or restart with a larger pool")

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one conversation of ``num_tokens`` tokens ever holds at once, computing at most ``chunk``
        tokens a step, summed over the groups (each group's kind says its own)."""
        return sum(policy.peak_blocks(num_tokens, chunk) for policy in self.policies)

    def num_blocks_for(self, seq: Sequence, num_new_tokens: int, hits: GroupHits | None = None) -> int:
        """Free blocks that ``admit(seq, hits, num_new_tokens)`` (with hits) or ``allocate_slots(seq,
        num_new_tokens)`` would take, in every group: new blocks, a private copy of a shared tail, and hits that
        leave the free queue or come from a lower tier."""
        bs, ref = self.block_size, self.pool.ref_count
        need = 0
        if hits is not None:
            end = cdiv(len(hits) * bs + num_new_tokens, bs)
            for table in hits.tables:
                need += max(0, end - len(table))
                need += sum(1 for b in table if isinstance(b, TierHit) or (b != ABSENT and ref[b] == 0))
            return need
        computed = seq.num_computed_tokens
        end, index = cdiv(computed + num_new_tokens, bs), computed // bs
        for table in self.tables_of(seq):  # (a window never releases the block the next token goes into)
            need += max(0, end - len(table))
            if index < len(table) and ref[table[index]] > 1:
                need += 1  # copy-on-write of the shared block the first new token goes into
        return need

    def can_allocate(self, n: int) -> bool:
        return self.pool.can_allocate(n)

    def owners(self, block: int, tables: dict[int, list[int]]) -> list[tuple[int, int]]:
        """(conversation id, logical index) of each reference to ``block``, given the holders' tables of the
        block's group (``block_group[block]``)."""
        return [(cid, tables[cid].index(block)) for cid in sorted(self.holders.get(block, ()))]

    # ---- admission: prefix hits, sharing, loads from lower tiers, new blocks (evictions offload) -----------------
    def _cached(self, key: int):
        """The device block holding cache ``key``, else a lower tier's :class:`TierHit` (loaded at admit), else
        None."""
        block = self.pool.lookup(key)
        if block is None and self.tiers is not None:
            return self.tiers.lookup(key)
        return block

    def prefix_hits(self, seq: Sequence) -> GroupHits:
        """The longest prefix every group can serve from the cache (vLLM's hybrid coordinator: full-attention
        groups bound it by their longest run of hits; each sliding group then takes the longest length whose
        window blocks it holds; repeated until they agree). The last token is computed (:func:`hit_limit`), so a
        generating prompt that is all cached still gets one token to run."""
        hits = GroupHits()
        hits.tables = [[] for _ in range(self.num_groups)]
        if not self.pool.enable_prefix_caching:
            return hits
        bs = self.block_size
        hashes = seq.full_block_hashes(bs)
        length = hit_limit(seq, bs)
        found: list = [None] * self.num_groups  # per group: what holds each leading prefix (find's answer)
        for g in self._hit_order:
            policy = self.policies[g]
            found[g] = policy.find(self._cached, (group_key(h, g) for h in hashes[:length]))
            length = policy.hit_length(found[g], length)
        changed = self.num_groups > 1
        while changed and length:
            changed = False
            for g, policy in enumerate(self.policies):
                best = policy.hit_length(found[g], length)
                if best < length:
                    length, changed = best, True
        for g, policy in enumerate(self.policies):
            first = policy.first_needed(length * bs)
            hits.tables[g] = [ABSENT] * first + found[g][first:length]
        hits.extend(hits.tables[0])
        return hits

    def admit(self, seq: Sequence, hits: GroupHits, num_new_tokens: int) -> list[tuple[int, int, int]]:
        """Start (or restart) ``seq``: share its cached prefix blocks in every group, then make room for its first
        ``num_new_tokens`` uncached tokens. The caller checked ``num_blocks_for(seq, num_new_tokens, hits)``.
        Hits in a lower tier (:class:`TierHit`) get fresh blocks of their group, filled from the tier
        (:meth:`take_loads`). Content of the prompt past its first miss that the pool holds is not evicted while
        the admission takes its blocks (:meth:`_protect`)."""
        self._note_outcomes(seq, hits)
        self._protect(seq, hits, num_new_tokens)
        try:
            copies = self._admit(seq, hits, num_new_tokens)
        finally:
            self._protected = frozenset()
        totals = self.outcome_totals  # counted once the admission stands (a tier's bad block re-notes it)
        for o in self.prompt_outcomes[seq.seq_id]:
            totals[o.outcome] = totals.get(o.outcome, 0) + 1
        return copies

    def _admit(self, seq: Sequence, hits: GroupHits, num_new_tokens: int) -> list[tuple[int, int, int]]:
        self._own_tables(seq)
        loads, data = [], None
        if self.tiers is not None:
            read, loads, data = self._read_tier_hits(seq, hits, num_new_tokens)
            if len(read) != len(hits):  # a tier block failed its checksum: the hits are shorter
                self._note_outcomes(seq, read)
            hits = read
        for g, table in enumerate(hits.tables):
            held = [b for b in table if b != ABSENT and not isinstance(b, TierHit)]
            for block in held:
                self.pool.add_ref(block, seq.seq_id)
                self.holders.setdefault(block, set()).add(seq.seq_id)
            if held:
                self.emit(EventKind.SHARED, seq.seq_id, block_ids=tuple(held), reason="prefix_hit", group=g)
            seq.set_group_table(g, list(table))
        if loads:
            self._load(seq, loads, data)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._note_sources(seq, hits.tables, len(hits))
        return self.allocate_slots(seq, num_new_tokens)

    def _take_blocks(self, seq: Sequence, n: int, group: int) -> list[int]:
        """``n`` blocks for ``group`` of ``seq``, with one EVICTED event per group the cached ones among them held;
        each evicted block goes to the top lower tier (when there are tiers) before anything overwrites it."""
        blocks, evicted = [], {}
        for _ in range(n):
            block, key = self.pool.take(seq.seq_id, self._protected)
            self.holders[block] = {seq.seq_id}
            if key != NO_HASH:
                evicted.setdefault(int(self.block_group[block]), []).append((block, key))
            self.block_group[block] = group
            blocks.append(block)
        self._last_offload = None
        if not evicted:
            return blocks
        kept_blocks: list[int] = []
        kept_bytes: list[np.ndarray] = []
        for old, pairs in evicted.items():
            self.num_evictions += len(pairs)
            self.emit(EventKind.EVICTED, seq.seq_id, block_ids=tuple(b for b, _ in pairs),
                      block_hashes=tuple(raw_hash(k, old) for _, k in pairs), group=old)
            if self.tiers is not None:  # kept under their cache keys, each with the group it held
                offloaded = self._offload(seq.seq_id, [b for b, _ in pairs], [k for _, k in pairs], old)
                if offloaded is not None:
                    kept_blocks += offloaded[0]
                    kept_bytes.append(offloaded[1])
        if kept_blocks:  # what these evictions read, for a load into the same blocks (_load)
            self._last_offload = (kept_blocks, kept_bytes[0] if len(kept_bytes) == 1 else np.concatenate(kept_bytes))
        return blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int, int]]:
        """Make every table of ``seq`` cover its next ``num_new_tokens`` tokens. Returns the copy-on-write copies
        ``(src, dst, num_slots)`` the caller must make before writing K/V. The caller checked ``num_blocks_for``."""
        bs, pool = self.block_size, self.pool
        copies = []
        index = seq.num_computed_tokens // bs
        end = cdiv(seq.num_computed_tokens + num_new_tokens, bs)
        for g, table in enumerate(self._own_tables(seq)):
            if index < len(table) and pool.ref_count[table[index]] > 1:
                src = table[index]  # never write into a block others read
                dst = self._take_blocks(seq, 1, g)[0]
                filled = seq.num_computed_tokens - index * bs
                pool.set_filled(dst, filled)
                self._drop(src, seq.seq_id)
                table = table[:index] + [dst] + table[index + 1:]  # a new list: tables only grow in place
                seq.set_group_table(g, table)
                copies.append((src, dst, filled))
                self.num_cow_copies += 1
                self.emit(EventKind.COPIED_ON_WRITE, seq.seq_id, block_ids=(src,), new_block_ids=(dst,), group=g)
            if end > len(table):
                blocks = self._take_blocks(seq, end - len(table), g)
                self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks), group=g)
                table.extend(blocks)
        return copies

    # ---- computed tokens ------------------------------------------------------------------------------------
    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Tokens up to ``num_computed_tokens`` now have K/V: update fill levels, register every block that became
        full under its group's cache key (one STORED event per run of consecutive registered blocks), then release
        what the windows no longer reach. The blocks from the old count on are all held: a window only ever releases
        blocks before the one its next token goes into."""
        bs, pool = self.block_size, self.pool
        old = seq.num_computed_tokens
        seq.num_computed_tokens = num_computed_tokens
        start, end, full = old // bs, cdiv(num_computed_tokens, bs), num_computed_tokens // bs
        hashes = seq.full_block_hashes(bs) if full > start and pool.enable_prefix_caching else None
        for g, table in enumerate(self.tables_of(seq)):
            for index in range(start, end):
                pool.set_filled(table[index], min(bs, num_computed_tokens - index * bs))
            if hashes is None:
                continue
            run: list[int] = []
            for index in range(start, full):
                parent = hashes[index - 1] if index else None
                info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs, parent, g)
                if pool.register_hash(table[index], group_key(hashes[index], g), info):
                    run.append(index)
                    continue
                self._emit_stored(seq, run, hashes, table, g)
                run = []
            self._emit_stored(seq, run, hashes, table, g)
        if self._releasing:
            self.release_out_of_window(seq)

    def _emit_stored(self, seq: Sequence, indices: list[int], hashes: list[int], table: list[int],
                     group: int) -> None:
        if not indices:
            return
        bs = self.block_size
        self.emit(EventKind.STORED, seq.seq_id, block_ids=tuple(table[i] for i in indices),
                  block_hashes=tuple(hashes[i] for i in indices),
                  parent_hash=hashes[indices[0] - 1] if indices[0] else None,
                  token_ids=tuple(seq.token_ids[indices[0] * bs:(indices[-1] + 1) * bs]), group=group)

    def release_out_of_window(self, seq: Sequence) -> None:
        """Release every block of a sliding group wholly before the window of ``seq``'s next query; their places
        become -1 (a new list: tables are only appended to in place)."""
        for g in self._releasing:
            table = seq.group_table(g)
            first = min(self.policies[g].first_needed(seq.num_computed_tokens), len(table))
            start = first  # absent entries are always a prefix of the table: scan back only over the new ones
            while start > 0 and table[start - 1] != ABSENT:
                start -= 1
            if start == first:
                continue
            gone = table[start:first]
            seq.set_group_table(g, table[:start] + [ABSENT] * len(gone) + table[first:])
            self.num_window_releases += len(gone)
            # one typed event naming the group and every block the window let go of (the timeline's mark, the log's
            # line), then what became of each block, as for any release
            self.emit(EventKind.WINDOW_RELEASED, seq.seq_id, block_ids=tuple(gone), reason=WINDOW_REASON, group=g)
            self._release(seq, gone, g, reason=WINDOW_REASON)

    # ---- sharing --------------------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts with every block of ``parent`` in every group (ref counts up); they diverge by
        copy-on-write."""
        self._own_tables(child)
        for g, table in enumerate(self.tables_of(parent)):
            held = [b for b in table if b != ABSENT]
            for block in held:
                self.pool.add_ref(block, child.seq_id)
                self.holders.setdefault(block, set()).add(child.seq_id)
            child.set_group_table(g, list(table))
            if held:
                self.emit(EventKind.SHARED, child.seq_id, block_ids=tuple(held), other_id=parent.seq_id,
                          reason="fork", group=g)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.seq_id in self.prompt_sources:  # it shares the parent's prompt K/V, wherever that came from
            self._set_sources(child.seq_id, dict(self.prompt_sources[parent.seq_id]))

    # ---- release --------------------------------------------------------------------------------------------
    def _drop(self, block: int, seq_id: int) -> BlockState:
        """Drop ``seq_id``'s reference to ``block`` (no event); keeps ``owner`` a current holder."""
        holders = self.holders.get(block)
        if holders is not None:
            holders.discard(seq_id)
        state = self.pool.drop_ref(block)
        if state == BlockState.USED:
            if self.pool.owner[block] == seq_id and holders:
                self.pool.set_owner(block, min(holders))
        else:
            self.holders.pop(block, None)
        return state

    def _release(self, seq: Sequence, blocks: Iterable[int], group: int, **fields) -> None:
        """Drop ``seq``'s reference to each of ``blocks`` (of ``group``) in order, then one event per outcome:
        RELEASED (others still hold it), CACHED (full and hashed: kept for prefix hits), FREED."""
        released, cached, freed = [], [], []
        for block in blocks:
            state = self._drop(block, seq.seq_id)
            (released if state == BlockState.USED else cached if state == BlockState.CACHED else freed).append(block)
        for kind, out in ((EventKind.RELEASED, released), (EventKind.CACHED, cached), (EventKind.FREED, freed)):
            if out:
                self.emit(kind, seq.seq_id, block_ids=tuple(out), group=group, **fields)

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, group by group, tail first (so its tail blocks are evicted first)."""
        for g, table in enumerate(self.tables_of(seq)):
            self._release(seq, (b for b in reversed(table) if b != ABSENT), g)
        seq.block_table = []
        if seq.extra_tables:
            seq.extra_tables = [[] for _ in seq.extra_tables]
        seq.num_computed_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: ``seq`` loses its blocks (full ones stay cached for its return). One PREEMPTED
        event names every group's blocks (one preemption), then each group's release events."""
        held = tuple(b for table in self.tables_of(seq) for b in table if b != ABSENT)
        self.emit(EventKind.PREEMPTED, seq.seq_id, block_ids=held)
        self.free(seq)

    # ---- pool-wide ------------------------------------------------------------------------------------------
    def relocate(self, new_id: np.ndarray, seqs: Iterable[Sequence]) -> list[int]:
        """Rename every block (old b -> ``new_id[b]``) in the pool and in every table. Returns the non-free old ids
        (the ones whose K/V must move)."""
        moved = np.flatnonzero(self.pool.state != BlockState.FREE)
        self.pool.permute(new_id)
        groups = np.empty_like(self.block_group)
        groups[new_id] = self.block_group
        self.block_group = groups
        for seq in seqs:
            changed = False
            for g, table in enumerate(self.tables_of(seq)):
                if table:
                    seq.set_group_table(g, [b if b == ABSENT else int(new_id[b]) for b in table])
                    changed = True
            if changed:
                seq.version += 1
        self.holders = {int(new_id[b]): holders for b, holders in self.holders.items()}
        self.emit(EventKind.RELOCATED, block_ids=tuple(moved.tolist()), new_block_ids=tuple(new_id[moved].tolist()))
        return moved.tolist()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash; cached blocks become free. Returns how many cached blocks were dropped."""
        for key, record in self.pool.hashed.items():  # their content leaves the pool: a later miss says so
            self.outcomes.remember(raw_hash(key, record.group), self.pool.clock, "reset",
                                   self.pool.clock - int(self.pool.last_access[self.pool.hash_to_block[key]]))
        cached = self.pool.clear_hashes()
        if self.tiers is not None:
            self.tiers.clear(self.pool.clock, self.emit)
        self.emit(EventKind.CLEARED, block_ids=tuple(cached))
        return len(cached)

    # ---- transactions ---------------------------------------------------------------------------------------
    def begin(self) -> tuple:
        """A checkpoint for :meth:`rollback` (the caller saves the K/V it is about to overwrite itself)."""
        self._tiers_begin()
        groups = self.block_group.copy() if self.num_groups > 1 else None  # one group: always 0
        return (self.pool.checkpoint(), len(self.events), self.num_cow_copies, self.num_evictions, groups,
                self.num_window_releases, dict(self.outcome_totals))

    def end(self) -> None:
        """The transaction is over (committed or rolled back)."""
        self._tiers_end()
        self._trim_events()

    def rollback(self, checkpoint: tuple, seqs: Iterable[Sequence]) -> None:
        """Undo everything since :meth:`begin` (the caller restores the sequences first and passes them all)."""
        (pool_cp, num_events, self.num_cow_copies, self.num_evictions, groups, self.num_window_releases,
         self.outcome_totals) = checkpoint
        if groups is not None:
            self.block_group = groups
        self._tiers_rollback()
        self.pool.restore(pool_cp)
        del self.events[num_events:]
        self._published = min(self._published, len(self.events))
        self.holders = {}
        for seq in seqs:
            for table in self.tables_of(seq):
                for block in table:
                    if block != ABSENT:
                        self.holders.setdefault(block, set()).add(seq.seq_id)
        self.end()

    # ---- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """The pool's invariants against every group's tables (-1 entries aside), plus the manager's own: holders
        match the tables, a used block's owner is one of its holders, a block is named only by tables of its group,
        a cached block's key is its group's, and no sliding group holds a block wholly before the window of its
        conversation's next query (nor lacks one inside it)."""
        held: dict[int, set[int]] = {}
        all_tables = []
        for seq in seqs:
            for g, table in enumerate(self.tables_of(seq)):
                live = [b for b in table if b != ABSENT]
                if not live:
                    continue
                all_tables.append(live)
                for block in live:
                    held.setdefault(block, set()).add(seq.seq_id)
                    assert int(self.block_group[block]) == g, \
                        f"block {block} of group {int(self.block_group[block])} is in a group {g} table"
                first = self.policies[g].first_needed(seq.num_computed_tokens)
                assert all(b == ABSENT for b in table[:first]), \
                    f"conversation {seq.seq_id} holds group {g} blocks wholly out of its window: {table[:first]}"
                assert all(b != ABSENT for b in table[first:]), \
                    f"conversation {seq.seq_id}'s group {g} table lacks a block its window reads: {table}"
        self.pool.check_invariants(all_tables)
        assert held == self.holders, "holders disagree with the block tables"
        for block, holders in self.holders.items():
            assert int(self.pool.owner[block]) in holders, f"block {block}'s owner holds no reference to it"
        for block in np.flatnonzero(self.pool.block_hash != NO_HASH).tolist():
            g = int(self.block_group[block])
            key = int(self.pool.block_hash[block])
            record = self.pool.hashed.get(key)
            assert record is not None, f"block {block}'s hash names nothing"
            assert key == group_key(hash_block_tokens(record.parent_hash, record.token_ids), g), \
                f"block {block}'s cache key is not its group's ({g})"
        if self.tiers is not None:
            self.tiers.check_invariants()

    # ---- lower tiers (host memory, disk): engine.kv.tiers ----------------------------------------------------------
    def attach_tiers(self, tiers: TierStore, read_device_blocks) -> None:
        """Keep evicted blocks in ``tiers``; ``read_device_blocks(blocks, out)`` reads those device blocks' raw K/V
        bytes into ``out`` (uint8 [n, bytes]; called while they are being taken, before anything overwrites them).
        Each group's blocks go there under their group's cache key: a block id is one slot in every layer plane, so
        a block of any group has the same bytes per block."""
        self.tiers, self.read_device_blocks = tiers, read_device_blocks

    def take_loads(self) -> list[TierLoad]:
        """Every group of blocks admitted from a lower tier since the last call: the caller writes them into the
        device pool before the step's model run (they hold prefix K/V the step reads)."""
        loads, self.pending_loads = self.pending_loads, []
        return loads

    def _offload(self, seq_id: int, blocks: list[int], hashes: list[int],
                 group: int = 0) -> tuple[list[int], np.ndarray] | None:
        """Evicted device blocks (of KV cache ``group``; ``hashes``: their cache keys) go to the top tier (their
        bytes are read now: nothing has overwritten them yet). The blocks that need a copy are read in one gather;
        returns (those blocks, their bytes), or None when none needed one."""
        moves = [(b, h, r) for b, h in zip(blocks, hashes) if (r := self.pool.dropped_record(h)) is not None]
        copied = [b for b, h, _ in moves if not self.tiers.holds_on_top(h)]
        data = self.read_device_blocks(copied, self.tiers.staging(len(copied))) if copied else None
        row = {b: i for i, b in enumerate(copied)}

        def read(block: int) -> np.ndarray:
            i = row.get(block)
            if i is not None:
                return data[i]
            # its hash was on the top tier when the gather was planned, but making room for an earlier block of
            # this eviction pushed it down: read this block on its own (nothing has overwritten it yet)
            return self.read_device_blocks([block], np.empty((1, self.tiers.bytes_per_block), np.uint8))[0]

        for block, h, record in moves:
            self.tiers.offload(h, record, partial(read, block), block, self.pool.clock, self.emit, seq_id, group)
        return (copied, data) if copied else None

    def _read_tier_hits(self, seq: Sequence, hits: GroupHits, num_new_tokens: int):
        """(hits, [(group, index, TierHit)] group by group, their bytes as one uint8 [n, bytes] array), read now
        (a later eviction in this admission may move them on). A block that fails its checksum is dropped and the
        hits are looked up again without it (every group must agree on the prefix, so they are not just cut); if
        the shorter hits need more blocks than the pool has free, none are used."""
        while True:
            found = [(g, index, hit) for g, table in enumerate(hits.tables) for index, hit in enumerate(table)
                     if isinstance(hit, TierHit)]
            if not found:
                return hits, [], None
            data = self.tiers.staging(len(found))
            for row, (_, _, hit) in enumerate(found):
                if not self.tiers.read_into(hit, data[row]):
                    self.tiers.drop_corrupt(hit, self.pool.clock, self.emit, seq.seq_id)
                    break
            else:
                return hits, found, data
            hits = self.prefix_hits(seq)  # the dropped slot is gone
            if not self.pool.can_allocate(self.num_blocks_for(seq, num_new_tokens, hits)):
                hits = GroupHits()
                hits.tables = [[] for _ in range(self.num_groups)]

    def _load(self, seq: Sequence, loads: list[tuple[int, int, TierHit]], data: np.ndarray) -> None:
        """Fresh device blocks of each hit's group, filled from the tiers (LOADED), full and hashed under their
        group's key again (STORED, as if computed); one :class:`TierLoad` per group. Every hit's slot is pinned
        until all are taken, so making room for one group's blocks never pushes another's hit away."""
        bs, pool = self.block_size, self.pool
        hashes = seq.full_block_hashes(bs)
        self.tiers.pin(hit for _, _, hit in loads)
        start = 0
        while start < len(loads):
            g = loads[start][0]
            end = start
            while end < len(loads) and loads[end][0] == g:
                end += 1
            mine = loads[start:end]
            blocks = self._take_blocks(seq, len(mine), g)
            kept = self._last_offload  # what the evicted ones among them held, read for the offload just now
            self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks), group=g)
            table = list(seq.group_table(g))
            for (_, index, hit), block in zip(mine, blocks):
                table[index] = block
                self.tiers.loaded(hit, block, pool.clock, self.emit, seq.seq_id)
                pool.set_filled(block, bs)
                info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs,
                                   hashes[index - 1] if index else None, g)
                registered = pool.register_hash(block, group_key(hashes[index], g), info)
                assert registered, "a tier hit's key was already on the device (it would have been a device hit)"
            seq.set_group_table(g, table)
            self.pending_loads.append(TierLoad(blocks, data[start:end], *(kept or ((), None))))
            run: list[int] = []
            for _, index, _ in mine:
                if run and index != run[-1] + 1:
                    self._emit_stored(seq, run, hashes, table, g)
                    run = []
                run.append(index)
            self._emit_stored(seq, run, hashes, table, g)
            start = end
        self.tiers.unpin()

    # ---- what an admission finds past its hits, and why each block fared as it did ---------------------------
    def after_break(self, seq: Sequence, num_hits: int, group: int = 0) -> list[int]:
        """Device blocks holding content of ``seq``'s prompt past its ``num_hits`` hits (full blocks), in KV cache
        ``group``'s keys: the prompt recomputes them, so they are not hits, but its admission keeps them if it fits
        beside them (they would be stored again at once), and they count against what it can take."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = seq.full_block_hashes(self.block_size)
        end = min(len(hashes), seq.num_prompt_tokens // self.block_size)
        found = (self.pool.lookup(group_key(h, group)) for h in hashes[num_hits:end])
        return [b for b in found if b is not None]

    def _protect(self, seq: Sequence, hits: GroupHits, num_new_tokens: int) -> None:
        """Until the admission ends, taking blocks does not evict ``seq``'s content past its first miss, if the
        admission still fits beside it (an admission never waits for them); the eviction policy hears that they
        were looked up."""
        after = [b for g in range(self.num_groups) for b in self.after_break(seq, len(hits), g)]
        if not after:
            return
        self.pool.looked_up(after)
        kept = sum(1 for b in after if self.pool.ref_count[b] == 0)
        if self.pool.can_allocate(self.num_blocks_for(seq, num_new_tokens, hits) + kept):
            self._protected = frozenset(after)

    def _held(self, key: int) -> bool:
        """The device pool or a lower tier holds this cache key now."""
        return self._cached(key) is not None

    def check_prompt(self, seq: Sequence, step: int):
        """Which blocks of ``seq``'s prompt (a sequence not admitted, never registered) the pools hold now, where,
        and why the others would miss, counted as its admission would count them (kvstream.prompt_check). Looks
        things up only: nothing changes, no policy hears of it."""
        bs = self.block_size
        hashes = seq.full_block_hashes(bs)
        caching = self.pool.enable_prefix_caching
        held = []
        for h in hashes:
            where = self._cached(h) if caching else None  # group 0's key is the hash itself
            if where is None:
                held.append(None)
            elif isinstance(where, TierHit):
                held.append(Held(where.tier, None, h))
            else:
                held.append(Held("device", int(where), h))

        def removal(i: int):
            record = self.outcomes.evictions.get(hashes[i])
            if record is None:
                return None
            at, for_cid, by, idle = record
            return Removal(at, None, by, for_cid, idle)

        note = "" if caching else "Prefix caching is off: nothing is ever a hit."
        return classify_prompt(seq.num_tokens, bs, held, removal, hits=len(self.prefix_hits(seq)),
                               recompute_last=not seq.prefill_only, source="engine", step=step, note=note)

    def _note_outcomes(self, seq: Sequence, hits: GroupHits) -> None:
        """How each prompt block fares at this admission (OutcomeBook.classify), kept for the views. With a
        sliding group beside a full-attention one, a block the full-attention layers hold, before any they lack,
        missed because a window released it."""
        held_full = None
        if self._releasing and len(self._releasing) < self.num_groups:
            full = next(g for g, p in enumerate(self.policies) if not p.releases)
            hashes = seq.full_block_hashes(self.block_size)
            first_gap = next((i for i, h in enumerate(hashes) if not self._held(group_key(h, full))), len(hashes))
            held_full = first_gap.__gt__
        outcomes = self.outcomes.classify(seq.full_block_hashes(self.block_size), seq.num_tokens, self.block_size,
                                          hits, hit_limit(seq, self.block_size), self._held, held_full)
        if self._sources_undo is not None:
            self._sources_undo.append((-1 - seq.seq_id, self.prompt_outcomes.get(seq.seq_id)))
        self.prompt_outcomes[seq.seq_id] = outcomes

    def _note_sources(self, seq: Sequence, tables: list[list], num_hits: int) -> None:
        """Where each hit block's K/V came from: the lowest place any group loaded it from (a block one group
        shared on the device and another loaded from disk counts as disk: its tokens waited for the disk)."""
        rank = {"device": 0, "host": 1, "disk": 2}
        counts = dict.fromkeys(("device", "host", "disk"), 0)
        bs = self.block_size
        for index in range(num_hits):
            where = "device"
            for table in tables:
                entry = table[index] if index < len(table) else ABSENT
                if isinstance(entry, TierHit) and rank[entry.tier] > rank[where]:
                    where = entry.tier
            counts[where] += bs
        self._set_sources(seq.seq_id, {**counts, "computed": seq.num_tokens - num_hits * bs})

    def _set_sources(self, seq_id: int, sources: dict[str, int]) -> None:
        if self._sources_undo is not None:
            self._sources_undo.append((seq_id, self.prompt_sources.get(seq_id)))
        self.prompt_sources[seq_id] = sources

    def _tiers_begin(self) -> None:
        self._sources_undo = []
        self.outcomes.begin()
        self.pending_loads = []
        if self.tiers is not None:
            self.tiers.begin()

    def _tiers_end(self) -> None:
        self._sources_undo = None
        self.outcomes.end()
        if self.tiers is not None:
            self.tiers.end()

    def _tiers_rollback(self) -> None:
        for seq_id, old in reversed(self._sources_undo or []):
            book = self.prompt_sources if seq_id >= 0 else self.prompt_outcomes  # outcomes are keyed -1 - id
            seq_id = seq_id if seq_id >= 0 else -1 - seq_id
            if old is None:
                book.pop(seq_id, None)
            else:
                book[seq_id] = old
        self._sources_undo = []
        self.outcomes.rollback()
        self.pending_loads = []
        if self.tiers is not None:
            self.tiers.rollback()
