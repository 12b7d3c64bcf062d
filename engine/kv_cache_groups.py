"""KV cache groups: the one manager of the pool for models whose layers differ (full attention and sliding window).

As vLLM v1's hybrid allocator pages them: one group per kind of layer, every group drawing its blocks from the one
:class:`BlockPool`. A block id belongs to one group at a time and names one slot of memory per layer of that group
(:class:`engine.kv_cache.KVCache`'s layer planes), so each conversation has one block table per group, and the
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
from kvstream.rules import cdiv
from kvstream.views import NO_HASH, BlockState, KVCacheGroupInfo

from .block_pool import BlockPool, HashedBlock, hash_block_tokens
from .kv_cache_manager import KVCacheManager
from .sequence import Sequence

ABSENT = -1  # a table entry whose block a sliding window released
_GROUP_SALT = 0x9E3779B97F4A7C15  # mixed into the prefix hash of groups 1.. (cache keys differ per group)
_MASK64 = (1 << 64) - 1


def group_key(block_hash: int, group: int) -> int:
    """The prefix-cache key of a block of ``group`` holding the prefix ``block_hash`` (group 0: the hash itself).
    Reversible (:func:`raw_hash`), so events and KV events carry the plain hash and the group, as vLLM sends them."""
    return block_hash if group == 0 else (block_hash ^ (_GROUP_SALT * group & _MASK64)) or 1


def raw_hash(key: int, group: int) -> int:
    return key if group == 0 else key ^ (_GROUP_SALT * group & _MASK64)


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
        found = []  # per group: block holding each of the first `length` prefixes, or None
        for g in range(self.num_groups):
            found.append([self.pool.lookup(group_key(h, g)) for h in hashes[:length]])
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
                need += sum(1 for b in table if b != ABSENT and ref[b] == 0)
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
                evicted.setdefault(old, []).append((block, raw_hash(key, old)))
        for old, pairs in evicted.items():
            self.num_evictions += len(pairs)
            self.emit(EventKind.EVICTED, seq.seq_id, block_ids=tuple(b for b, _ in pairs),
                      block_hashes=tuple(h for _, h in pairs), group=old)
        return blocks

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> list[tuple[int, int, int]]:
        self._ensure_tables(seq)
        tables = hits.tables if isinstance(hits, GroupHits) else [list(hits)] + [[] for _ in range(self.num_groups - 1)]
        for g, table in enumerate(tables):
            held = [b for b in table if b != ABSENT]
            for block in held:
                self.pool.add_ref(block, seq.seq_id)
                self.holders.setdefault(block, set()).add(seq.seq_id)
            if held:
                self.emit(EventKind.SHARED, seq.seq_id, block_ids=tuple(held), reason="prefix_hit", group=g)
            seq.set_group_table(g, list(table))
        seq.num_computed_tokens = len(hits) * self.block_size
        return self.allocate_slots(seq, num_new_tokens)

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
    """The KV cache groups of a model (engine.model.ModelConfig.kv_cache_groups), as the views name them."""
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
