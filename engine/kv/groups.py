"""KV cache groups: the one manager of the pool for models whose layers differ (full attention and sliding window).

As vLLM v1's hybrid allocator pages them: one group per kind of layer, every group drawing its blocks from the one
:class:`BlockPool`. A block id belongs to one group at a time and names one slot of memory per layer of that group
(:class:`engine.kv.cache.KVCache`'s layer planes), so each conversation has one block table per group, and the
groups share the pool's free queues, its prefix cache and its budget.

What a sliding-window group adds: a query at position p reads only the keys at positions > p - window, so a block
whose last position is before the next query's window is never read again. It is released at the step that makes it
so (:meth:`GroupedKVCacheManager.commit`; reason ``WINDOW_REASON``), a hashed one staying CACHED for prefix hits, and
its place in the table becomes -1 (vLLM's null block). Paging alone never releases KV: this does, because the model
will not read it.

Prefix caching per group: a block's cache key is its prefix hash mixed with its group (:func:`group_key`; group 0's
key is the hash itself, so a one-group pool is keyed as before). A hit must hold in every group: full-attention
groups need every block of the prefix, a sliding-window group only the blocks inside the window of the hit's first
computed token (the ones before stay -1).

Why a subclass: a model of one full-attention group keeps :class:`KVCacheManager` exactly as it was (same code,
same speed); everything about groups and windows lives here.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from kvstream.events import WINDOW_REASON, EventKind
from kvstream.rules import cdiv, group_key, raw_hash  # noqa: F401 (re-exported)
from kvstream.views import NO_HASH, BlockState, KVCacheGroupInfo

from .pool import BlockPool, HashedBlock, hash_block_tokens
from .manager import KVCacheManager
from ..sequence import Sequence
from .tiers import TierHit, TierLoad

ABSENT = -1  # a table entry whose block a sliding window released


class GroupHits(list):
    """Prefix hits of every group: as a list, group 0's hit entries (its length is the number of hit blocks, all
    the scheduler needs); ``tables`` holds each group's (-1 before a sliding window)."""

    tables: list[list[int]]


class GroupedKVCacheManager(KVCacheManager):
    """:class:`KVCacheManager` for several KV cache groups, or one sliding-window group."""

    def __init__(self, pool: BlockPool, groups: tuple[KVCacheGroupInfo, ...]):
        super().__init__(pool)
        self.groups = tuple(groups)
        self.num_groups = len(self.groups)
        self.windows = [g.sliding_window for g in self.groups]
        self.block_group = np.zeros(pool.num_blocks, np.int8)  # group of each block taken (kept when freed)
        self.num_window_releases = 0  # blocks released because they fell out of a window

    # ---- tables ---------------------------------------------------------------------------------------------
    def _ensure_tables(self, seq: Sequence) -> None:
        if len(seq.extra_tables) != self.num_groups - 1:
            seq.extra_tables = [[] for _ in range(self.num_groups - 1)]

    def tables_of(self, seq: Sequence) -> list[list[int]]:
        """Every group's table of ``seq`` (group order)."""
        return [seq.block_table] + list(seq.extra_tables) if seq.extra_tables else \
            [seq.block_table] + [[] for _ in range(self.num_groups - 1)]

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first logical block the query at position ``num_computed`` reads in ``group`` (vLLM's
        get_num_skipped_tokens: num_computed - window + 1 positions are skipped)."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    # ---- queries --------------------------------------------------------------------------------------------
    def prefix_hits(self, seq: Sequence) -> GroupHits:
        """The longest prefix every group can serve from the cache (vLLM's hybrid coordinator: full-attention
        groups bound it by their longest run of hits; each sliding group then takes the longest length whose
        window blocks it holds; repeated until they agree)."""
        hits = GroupHits()
        hits.tables = [[] for _ in range(self.num_groups)]
        if not self.pool.enable_prefix_caching:
            return hits
        bs = self.block_size
        hashes = seq.full_block_hashes(bs)
        length = (seq.num_tokens - 1) // bs
        found = []  # per group: block (or TierHit) holding each of the first `length` prefixes, or None
        lookup, tiers = self.pool.lookup, self.tiers
        for g in range(self.num_groups):
            keys = [group_key(h, g) for h in hashes[:length]]
            blocks = [lookup(k) for k in keys]
            if tiers is not None:  # a block the device evicted may wait in a lower tier: loaded at admit
                blocks = [tiers.lookup(k) if b is None else b for b, k in zip(blocks, keys)]
            found.append(blocks)
        changed = True
        while changed and length:
            changed = False
            for g in range(self.num_groups):
                best = self._group_hit_length(g, found[g], length)
                if best < length:
                    length, changed = best, True
        for g in range(self.num_groups):
            first = self._first_needed(g, length * bs)
            hits.tables[g] = [ABSENT] * first + [found[g][i] for i in range(first, length)]
        hits.extend(hits.tables[0])
        return hits

    def _group_hit_length(self, group: int, found: list, length: int) -> int:
        """Longest hit of at most ``length`` blocks that ``group`` can serve."""
        if self.windows[group] is None:
            for i in range(length):
                if found[i] is None:
                    return i
            return length
        for cand in range(length, 0, -1):  # the longest whose window's blocks are all cached
            first = self._first_needed(group, cand * self.block_size)
            if all(found[i] is not None for i in range(first, cand)):
                return cand
        return 0

    def num_blocks_for(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> int:
        bs, ref = self.block_size, self.pool.ref_count
        need = 0
        if hits is not None:
            computed = len(hits) * bs
            tables = hits.tables if isinstance(hits, GroupHits) else [list(hits)] * self.num_groups
            for table in tables:
                need += max(0, cdiv(computed + num_new_tokens, bs) - len(table))
                need += sum(1 for b in table if isinstance(b, TierHit) or (b != ABSENT and ref[b] == 0))
            return need
        computed = seq.num_computed_tokens
        index = computed // bs
        for table in self.tables_of(seq):
            need += max(0, cdiv(computed + num_new_tokens, bs) - len(table))
            if index < len(table) and table[index] != ABSENT and ref[table[index]] > 1:
                need += 1
        return need

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most blocks one conversation of ``num_tokens`` tokens ever holds at once, computing at most ``chunk``
        tokens a step: every block in a full-attention group; in a sliding group the window's blocks plus a
        chunk's (a chunk's blocks are all held until the step that computed them ends)."""
        bs = self.block_size
        need = 0
        for window in self.windows:
            blocks = cdiv(num_tokens, bs)
            if window is not None:
                blocks = min(blocks, cdiv(window - 1 + min(chunk, num_tokens), bs) + 1)
            need += blocks
        return need

    def owners(self, block: int, tables: dict[int, list[int]]) -> list[tuple[int, int]]:
        """``tables``: conversation id -> the table of the block's own group (the caller picks it) or all tables."""
        out = []
        for cid in sorted(self.holders.get(block, ())):
            table = tables[cid]
            if table and isinstance(table[0], list):
                table = table[int(self.block_group[block])]
            out.append((cid, table.index(block)))
        return out

    # ---- allocation -----------------------------------------------------------------------------------------
    def _take_group_blocks(self, seq: Sequence, n: int, group: int) -> list[int]:
        """``n`` blocks for ``group`` of ``seq``, with EVICTED events (per group the evicted blocks held)."""
        blocks, evicted = [], {}
        for _ in range(n):
            block, key = self._take(seq.seq_id)
            old = int(self.block_group[block])
            self.block_group[block] = group
            blocks.append(block)
            if key != NO_HASH:
                evicted.setdefault(old, []).append((block, key))
        self._last_offload = None
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
        if kept_blocks:  # what these evictions read, for a load into the same blocks (_load_tier_hits)
            self._last_offload = (kept_blocks, kept_bytes[0] if len(kept_bytes) == 1 else np.concatenate(kept_bytes))
        return blocks

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> list[tuple[int, int, int]]:
        """As :meth:`KVCacheManager.admit`, for every group: device hits shared, lower-tier hits
        (:class:`TierHit`) loaded into fresh blocks of their group."""
        self._ensure_tables(seq)
        loads, data = [], None
        if self.tiers is not None:
            hits, loads, data = self._read_tier_hits_of_groups(seq, hits, num_new_tokens)
        tables = hits.tables if isinstance(hits, GroupHits) else [list(hits)] + [[] for _ in range(self.num_groups - 1)]
        for g, table in enumerate(tables):
            held = [b for b in table if b != ABSENT and not isinstance(b, TierHit)]
            for block in held:
                self.pool.add_ref(block, seq.seq_id)
                self.holders.setdefault(block, set()).add(seq.seq_id)
            if held:
                self.emit(EventKind.SHARED, seq.seq_id, block_ids=tuple(held), reason="prefix_hit", group=g)
            seq.set_group_table(g, list(table))
        if loads:
            self._load_tier_hits(seq, loads, data)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._note_group_sources(seq, tables, len(hits))
        return self.allocate_slots(seq, num_new_tokens)

    # ---- lower tiers ----------------------------------------------------------------------------------------
    def _read_tier_hits_of_groups(self, seq: Sequence, hits: list, num_new_tokens: int):
        """(hits, [(group, index, TierHit)] group by group, their bytes as one uint8 [n, bytes] array), read now
        (a later eviction in this admission may move them on). A block that fails its checksum is dropped and the
        hits are looked up again without it (every group must agree on the prefix, so they are not just cut); if
        the shorter hits need more blocks than the pool has free, none are used."""
        while True:
            tables = hits.tables if isinstance(hits, GroupHits) else [list(hits)]
            found = [(g, index, hit) for g, table in enumerate(tables) for index, hit in enumerate(table)
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

    def _load_tier_hits(self, seq: Sequence, loads: list[tuple[int, int, TierHit]], data: np.ndarray) -> None:
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
            blocks = self._take_group_blocks(seq, len(mine), g)
            kept = self._last_offload  # what the evicted ones among them held, read for the offload just now
            self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks), group=g)
            table = list(seq.group_table(g))
            for (_, index, hit), block in zip(mine, blocks):
                table[index] = block
                self.tiers.loaded(hit, block, pool.clock, self.emit, seq.seq_id)
                pool.set_filled(block, bs)
                info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs,
                                   hashes[index - 1] if index else None)
                registered = pool.register_hash(block, group_key(hashes[index], g), info)
                assert registered, "a tier hit's key was already on the device (it would have been a device hit)"
            seq.set_group_table(g, table)
            self.pending_loads.append(TierLoad(blocks, data[start:end], *(kept or ((), None))))
            run: list[int] = []
            for _, index, _ in mine:
                if run and index != run[-1] + 1:
                    self._emit_group_stored(seq, run, hashes, table, g)
                    run = []
                run.append(index)
            self._emit_group_stored(seq, run, hashes, table, g)
            start = end
        self.tiers.unpin()

    def _note_group_sources(self, seq: Sequence, tables: list[list], num_hits: int) -> None:
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

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int, int]]:
        self._ensure_tables(seq)
        bs, pool = self.block_size, self.pool
        copies = []
        index = seq.num_computed_tokens // bs
        for g in range(self.num_groups):
            table = seq.group_table(g)
            if index < len(table) and table[index] != ABSENT and pool.ref_count[table[index]] > 1:
                src = table[index]
                dst = self._take_group_blocks(seq, 1, g)[0]
                filled = seq.num_computed_tokens - index * bs
                pool.set_filled(dst, filled)
                self._drop(src, seq.seq_id)
                table = table[:index] + [dst] + table[index + 1:]
                seq.set_group_table(g, table)
                copies.append((src, dst, filled))
                self.num_cow_copies += 1
                self.emit(EventKind.COPIED_ON_WRITE, seq.seq_id, block_ids=(src,), new_block_ids=(dst,), group=g)
            missing = cdiv(seq.num_computed_tokens + num_new_tokens, bs) - len(table)
            if missing > 0:
                blocks = self._take_group_blocks(seq, missing, g)
                self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks), group=g)
                table.extend(blocks)
        return copies

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Fill levels and hashes per group, then release what the windows no longer reach."""
        bs, pool = self.block_size, self.pool
        old = seq.num_computed_tokens
        seq.num_computed_tokens = num_computed_tokens
        tables = [seq.group_table(g) for g in range(self.num_groups)]
        for table in tables:
            for index in range(old // bs, cdiv(num_computed_tokens, bs)):
                if table[index] != ABSENT:
                    pool.set_filled(table[index], min(bs, num_computed_tokens - index * bs))
        if pool.enable_prefix_caching and num_computed_tokens // bs > old // bs:
            hashes = seq.full_block_hashes(bs)
            for g, table in enumerate(tables):
                run: list[int] = []
                for index in range(old // bs, num_computed_tokens // bs):
                    parent = hashes[index - 1] if index else None
                    info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs, parent)
                    if table[index] != ABSENT and pool.register_hash(table[index], group_key(hashes[index], g), info):
                        run.append(index)
                        continue
                    self._emit_group_stored(seq, run, hashes, table, g)
                    run = []
                self._emit_group_stored(seq, run, hashes, table, g)
        self.release_out_of_window(seq)

    def _emit_group_stored(self, seq: Sequence, indices: list[int], hashes: list[int], table: list[int],
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
        for g in range(self.num_groups):
            if self.windows[g] is None:
                continue
            table = seq.group_table(g)
            first = min(self._first_needed(g, seq.num_computed_tokens), len(table))
            start = first  # absent entries are always a prefix of the table: scan back only over the new ones
            while start > 0 and table[start - 1] != ABSENT:
                start -= 1
            gone = range(start, first)
            if not gone:
                continue
            new = list(table)
            released, cached, freed = [], [], []
            for i in gone:
                state = self._drop(new[i], seq.seq_id)
                (released if state == BlockState.USED else cached if state == BlockState.CACHED
                 else freed).append(new[i])
                new[i] = ABSENT
            seq.set_group_table(g, new)
            self.num_window_releases += len(gone)
            # one typed event naming the group and every block the window let go of (the timeline's mark, the log's
            # line), then what became of each block, as for any release
            self.emit(EventKind.WINDOW_RELEASED, seq.seq_id, block_ids=tuple(table[i] for i in gone),
                      reason=WINDOW_REASON, group=g)
            for kind, blocks in ((EventKind.RELEASED, released), (EventKind.CACHED, cached),
                                 (EventKind.FREED, freed)):
                if blocks:
                    self.emit(kind, seq.seq_id, block_ids=tuple(blocks), reason=WINDOW_REASON, group=g)

    # ---- sharing --------------------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        self._ensure_tables(parent)
        self._ensure_tables(child)
        for g in range(self.num_groups):
            table = parent.group_table(g)
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
    def free(self, seq: Sequence) -> None:
        for g in range(self.num_groups):
            table = seq.group_table(g) if g == 0 or seq.extra_tables else []
            released, cached, freed = [], [], []
            for block in reversed(table):
                if block == ABSENT:
                    continue
                state = self._drop(block, seq.seq_id)
                (released if state == BlockState.USED else cached if state == BlockState.CACHED
                 else freed).append(block)
            for kind, blocks in ((EventKind.RELEASED, released), (EventKind.CACHED, cached),
                                 (EventKind.FREED, freed)):
                if blocks:
                    self.emit(kind, seq.seq_id, block_ids=tuple(blocks), group=g)
            if g == 0 or seq.extra_tables:
                seq.set_group_table(g, [])
        seq.num_computed_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        """One PREEMPTED event naming every group's blocks (one preemption), then each group's release events."""
        held = tuple(b for table in self.tables_of(seq) for b in table if b != ABSENT)
        self.emit(EventKind.PREEMPTED, seq.seq_id, block_ids=held)
        self.free(seq)

    # ---- pool-wide ------------------------------------------------------------------------------------------
    def relocate(self, new_id: np.ndarray, seqs: Iterable[Sequence]) -> list[int]:
        moved = np.flatnonzero(self.pool.state != BlockState.FREE)
        self.pool.permute(new_id)
        groups = np.empty_like(self.block_group)
        groups[new_id] = self.block_group
        self.block_group = groups
        for seq in seqs:
            changed = False
            for g in range(self.num_groups if seq.extra_tables else 1):
                table = seq.group_table(g)
                if table:
                    seq.set_group_table(g, [b if b == ABSENT else int(new_id[b]) for b in table])
                    changed = True
            if changed:
                seq.version += 1
        self.holders = {int(new_id[b]): holders for b, holders in self.holders.items()}
        self.emit(EventKind.RELOCATED, block_ids=tuple(moved.tolist()), new_block_ids=tuple(new_id[moved].tolist()))
        return moved.tolist()

    # ---- transactions ---------------------------------------------------------------------------------------
    def begin(self) -> tuple:
        return super().begin() + (self.block_group.copy(), self.num_window_releases)

    def rollback(self, checkpoint: tuple, seqs: Iterable[Sequence]) -> None:
        *base, self.block_group, self.num_window_releases = checkpoint
        seqs = list(seqs)
        super().rollback(tuple(base), seqs)
        self.holders = {}
        for seq in seqs:
            for table in self.tables_of(seq):
                for block in table:
                    if block != ABSENT:
                        self.holders.setdefault(block, set()).add(seq.seq_id)

    # ---- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """The pool's invariants against every group's tables (-1 entries aside), holders, and the groups' own: a
        block is named only by tables of its group, a cached block's key is its group's, and no sliding group
        holds a block wholly before the window of its conversation's next query."""
        seqs = list(seqs)
        held: dict[int, list[int]] = {}
        expected: dict[int, set[int]] = {}
        all_tables = []
        for seq in seqs:
            for g, table in enumerate(self.tables_of(seq)):
                live = [b for b in table if b != ABSENT]
                if not live:
                    continue
                all_tables.append(live)
                for block in live:
                    expected.setdefault(block, set()).add(seq.seq_id)
                    assert int(self.block_group[block]) == g, \
                        f"block {block} of group {int(self.block_group[block])} is in a group {g} table"
                    held.setdefault(block, []).append(g)
                first = self._first_needed(g, seq.num_computed_tokens)
                assert all(b == ABSENT for b in table[:first]), \
                    f"conversation {seq.seq_id} holds group {g} blocks wholly out of its window: {table[:first]}"
                assert all(b != ABSENT for b in table[first:]), \
                    f"conversation {seq.seq_id}'s group {g} table lacks a block its window reads: {table}"
        self.pool.check_invariants(all_tables)
        assert expected == self.holders, "holders disagree with the block tables"
        for block, holders in self.holders.items():
            assert int(self.pool.owner[block]) in holders, f"block {block}'s owner holds no reference to it"
        for block in np.flatnonzero(self.pool.block_hash != NO_HASH).tolist():
            g = int(self.block_group[block])
            record = self.pool.hashed.get(int(self.pool.block_hash[block]))
            assert record is not None, f"block {block}'s hash names nothing"
            key = int(self.pool.block_hash[block])
            assert key == group_key(hash_block_tokens(record.parent_hash, record.token_ids), g), \
                f"block {block}'s cache key is not its group's ({g})"


def kv_cache_group_infos(config) -> tuple[KVCacheGroupInfo, ...]:
    """The KV cache groups of a model (engine.model.causal_lm.ModelConfig.kv_cache_groups), as the views name them."""
    return tuple(KVCacheGroupInfo(kind, window, layers) for kind, window, layers in config.kv_cache_groups())


def kv_cache_layout(groups: tuple[KVCacheGroupInfo, ...], num_layers: int) -> tuple[int, list[int] | None]:
    """(layer planes of the KV tensor, each model layer's plane): as vLLM's hybrid allocator lays groups out, a
    block id is one slot of memory in each of ``max layers per group`` planes; layer j of a group (j-th in its
    group) lives in plane j. One group: every layer its own plane, in order (None)."""
    if len(groups) == 1:
        return num_layers, None
    slots = [0] * num_layers
    for group in groups:
        for j, layer in enumerate(group.layers):
            slots[layer] = j
    return max(len(g.layers) for g in groups), slots
