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
"""
from __future__ import annotations

from functools import partial
from typing import Iterable

import numpy as np

from kvstream.events import BlockEvent, EventKind
from kvstream.rules import cdiv
from kvstream.views import NO_HASH, BlockState

from .pool import BlockPool, HashedBlock
from ..sequence import Sequence
from .tiers import TierHit, TierLoad, TierStore

MAX_PENDING_EVENTS = 200_000  # events nobody took; older ones are dropped and counted (a headless script that never
#                               calls take_events() must not grow without bound)


class KVCacheManager:
    """Per-conversation operations on a :class:`BlockPool`, each recorded as block events."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.events: list[BlockEvent] = []  # not yet taken, oldest first
        self.num_dropped_events = 0  # events dropped because nobody took them (MAX_PENDING_EVENTS)
        self._published = 0  # events[:_published] were already handed to events_since_publish()
        self.holders: dict[int, set[int]] = {}  # used block -> ids of the conversations whose tables name it
        self.num_cow_copies = 0
        self.num_evictions = 0
        self.tiers: TierStore | None = None  # host / disk tiers (attach_tiers); None: evicted blocks are lost
        self.read_device_blocks = None  # block ids -> their raw K/V bytes, uint8 [n, bytes] (KVCache.read_blocks_bytes)
        self.pending_loads: list[TierLoad] = []  # blocks admitted from a lower tier, for the caller to write (take_loads)
        self._last_offload: tuple[list[int], np.ndarray] | None = None  # what _take_blocks' evictions read (_load)
        self.prompt_sources: dict[int, dict[str, int]] = {}  # seq id -> its last admission's prompt tokens by source
        self._sources_undo: list[tuple[int, dict | None]] | None = None  # (seq id, old value) in a transaction

    # ---- events ---------------------------------------------------------------------------------------------
    def emit(self, kind: EventKind, conversation_id: int = -1, **fields) -> None:
        """Record one event at the pool's current step."""
        self.events.append(BlockEvent(step_id=self.pool.clock, kind=kind, conversation_id=conversation_id, **fields))

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

    # ---- queries --------------------------------------------------------------------------------------------
    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Blocks that already hold this prompt's leading full blocks. The last token is always computed, so a
        prompt that is all cached still gets one token to run."""
        if not self.pool.enable_prefix_caching:
            return []
        hashes = seq.full_block_hashes(self.block_size)
        limit = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:limit]:
            block = self.pool.lookup(h)
            if block is None:
                block = self.tiers.lookup(h) if self.tiers is not None else None  # a TierHit: loaded at admit
                if block is None:
                    break
            hits.append(block)
        return hits

    def num_blocks_for(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> int:
        """Free blocks that ``admit(seq, hits, num_new_tokens)`` (with hits) or ``allocate_slots(seq,
        num_new_tokens)`` would take: new blocks, a private copy of a shared tail, and cached hits that leave the
        free queue."""
        bs = self.block_size
        if hits is not None:
            computed, table_len = len(hits) * bs, len(hits)
            revived = sum(1 for b in hits if isinstance(b, TierHit) or self.pool.ref_count[b] == 0)
            return max(0, cdiv(computed + num_new_tokens, bs) - table_len) + revived
        computed, table = seq.num_computed_tokens, seq.block_table
        need = max(0, cdiv(computed + num_new_tokens, bs) - len(table))
        index = computed // bs
        if index < len(table) and self.pool.ref_count[table[index]] > 1:
            need += 1  # copy-on-write of the shared block the first new token goes into
        return need

    def can_allocate(self, n: int) -> bool:
        return self.pool.can_allocate(n)

    def owners(self, block: int, tables: dict[int, list[int]]) -> list[tuple[int, int]]:
        """(conversation id, logical index) of each reference to ``block``, given the holders' tables."""
        return [(cid, tables[cid].index(block)) for cid in sorted(self.holders.get(block, ()))]

    # ---- allocation -----------------------------------------------------------------------------------------
    def _take(self, seq_id: int) -> tuple[int, int]:
        block, evicted = self.pool.take(seq_id)
        self.holders[block] = {seq_id}
        return block, evicted

    def _take_blocks(self, seq: Sequence, n: int) -> list[int]:
        """``n`` blocks for ``seq``, with one EVICTED event for the cached ones among them."""
        blocks, evicted_blocks, evicted_hashes = [], [], []
        for _ in range(n):
            block, evicted = self._take(seq.seq_id)
            blocks.append(block)
            if evicted != NO_HASH:
                evicted_blocks.append(block)
                evicted_hashes.append(evicted)
        self._last_offload = None
        if evicted_blocks:
            self.num_evictions += len(evicted_blocks)
            self.emit(EventKind.EVICTED, seq.seq_id, block_ids=tuple(evicted_blocks),
                      block_hashes=tuple(evicted_hashes))
            if self.tiers is not None:
                self._last_offload = self._offload(seq.seq_id, evicted_blocks, evicted_hashes)
        return blocks

    def _allocate(self, seq: Sequence, n: int) -> list[int]:
        if n <= 0:
            return []
        blocks = self._take_blocks(seq, n)
        self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks))
        return blocks

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> list[tuple[int, int, int]]:
        """Start (or restart) ``seq``: share its cached prefix blocks, then make room for its first
        ``num_new_tokens`` uncached tokens. The caller checked ``num_blocks_for(seq, num_new_tokens, hits)``.
        Hits in a lower tier (:class:`TierHit`) get fresh blocks, filled from the tier (:meth:`take_loads`)."""
        loads, data, bad = self._read_tier_hits(seq, hits) if self.tiers is not None else ([], None, None)
        if bad is not None:  # a tier block failed its checksum: the hits end before it
            hits = hits[:bad]
        device = [b for b in hits if not isinstance(b, TierHit)]
        for block in device:
            self.pool.add_ref(block, seq.seq_id)
            self.holders.setdefault(block, set()).add(seq.seq_id)
        if device:
            self.emit(EventKind.SHARED, seq.seq_id, block_ids=tuple(device), reason="prefix_hit")
        seq.block_table = list(hits)
        if loads:
            self._load(seq, loads, data)
        seq.num_computed_tokens = len(hits) * self.block_size
        self._note_sources(seq, hits)
        return self.allocate_slots(seq, num_new_tokens)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int, int]]:
        """Make ``seq``'s table cover its next ``num_new_tokens`` tokens. Returns the copy-on-write copies
        ``(src, dst, num_slots)`` the caller must make before writing K/V. The caller checked ``num_blocks_for``."""
        bs, pool, table = self.block_size, self.pool, seq.block_table
        copies = []
        index = seq.num_computed_tokens // bs
        if index < len(table) and pool.ref_count[table[index]] > 1:  # never write into a block others read
            src = table[index]
            dst = self._take_blocks(seq, 1)[0]
            filled = seq.num_computed_tokens - index * bs
            pool.set_filled(dst, filled)
            self._drop(src, seq.seq_id)
            table = seq.block_table = table[:index] + [dst] + table[index + 1:]  # a new list: tables only grow in place
            copies.append((src, dst, filled))
            self.num_cow_copies += 1
            self.emit(EventKind.COPIED_ON_WRITE, seq.seq_id, block_ids=(src,), new_block_ids=(dst,))
        missing = cdiv(seq.num_computed_tokens + num_new_tokens, bs) - len(table)
        table.extend(self._allocate(seq, missing))
        return copies

    def commit(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Tokens up to ``num_computed_tokens`` now have K/V: update fill levels and register every block that
        became full under its prefix hash (one STORED event per run of consecutive registered blocks)."""
        bs, pool, table = self.block_size, self.pool, seq.block_table
        old = seq.num_computed_tokens
        seq.num_computed_tokens = num_computed_tokens
        for index in range(old // bs, cdiv(num_computed_tokens, bs)):
            pool.set_filled(table[index], min(bs, num_computed_tokens - index * bs))
        if not pool.enable_prefix_caching or num_computed_tokens // bs <= old // bs:
            return
        hashes = seq.full_block_hashes(bs)
        run: list[int] = []
        for index in range(old // bs, num_computed_tokens // bs):
            parent = hashes[index - 1] if index else None
            info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs, parent)
            if pool.register_hash(table[index], hashes[index], info):
                run.append(index)
                continue
            self._emit_stored(seq, run, hashes)
            run = []
        self._emit_stored(seq, run, hashes)

    def _emit_stored(self, seq: Sequence, indices: list[int], hashes: list[int]) -> None:
        if not indices:
            return
        bs = self.block_size
        self.emit(EventKind.STORED, seq.seq_id, block_ids=tuple(seq.block_table[i] for i in indices),
                  block_hashes=tuple(hashes[i] for i in indices),
                  parent_hash=hashes[indices[0] - 1] if indices[0] else None,
                  token_ids=tuple(seq.token_ids[indices[0] * bs:(indices[-1] + 1) * bs]))

    # ---- sharing --------------------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` starts with every block of ``parent`` (ref counts up); they diverge by copy-on-write."""
        for block in parent.block_table:
            self.pool.add_ref(block, child.seq_id)
            self.holders.setdefault(block, set()).add(child.seq_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        if parent.seq_id in self.prompt_sources:  # it shares the parent's prompt K/V, wherever that came from
            self._set_sources(child.seq_id, dict(self.prompt_sources[parent.seq_id]))
        if parent.block_table:
            self.emit(EventKind.SHARED, child.seq_id, block_ids=tuple(parent.block_table), other_id=parent.seq_id,
                      reason="fork")

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

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``, tail first (so its tail blocks are evicted first)."""
        released, cached, freed = [], [], []
        for block in reversed(seq.block_table):
            state = self._drop(block, seq.seq_id)
            (released if state == BlockState.USED else cached if state == BlockState.CACHED else freed).append(block)
        for kind, blocks in ((EventKind.RELEASED, released), (EventKind.CACHED, cached), (EventKind.FREED, freed)):
            if blocks:
                self.emit(kind, seq.seq_id, block_ids=tuple(blocks))
        seq.block_table = []
        seq.num_computed_tokens = 0

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: ``seq`` loses its blocks (full ones stay cached for its return)."""
        self.emit(EventKind.PREEMPTED, seq.seq_id, block_ids=tuple(seq.block_table))
        self.free(seq)

    # ---- pool-wide ------------------------------------------------------------------------------------------
    def relocate(self, new_id: np.ndarray, seqs: Iterable[Sequence]) -> list[int]:
        """Rename every block (old b -> ``new_id[b]``) in the pool and in every table. Returns the non-free old ids
        (the ones whose K/V must move)."""
        moved = np.flatnonzero(self.pool.state != BlockState.FREE)
        self.pool.permute(new_id)
        for seq in seqs:
            if seq.block_table:
                seq.block_table = [int(new_id[b]) for b in seq.block_table]
                seq.version += 1
        self.holders = {int(new_id[b]): holders for b, holders in self.holders.items()}
        self.emit(EventKind.RELOCATED, block_ids=tuple(moved.tolist()),
                  new_block_ids=tuple(new_id[moved].tolist()))
        return moved.tolist()

    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash; cached blocks become free. Returns how many cached blocks were dropped."""
        cached = self.pool.clear_hashes()
        if self.tiers is not None:
            self.tiers.clear(self.pool.clock, self.emit)
        self.emit(EventKind.CLEARED, block_ids=tuple(cached))
        return len(cached)

    # ---- transactions ---------------------------------------------------------------------------------------
    def begin(self) -> tuple:
        """A checkpoint for :meth:`rollback` (the caller saves the K/V it is about to overwrite itself)."""
        self._tiers_begin()
        return self.pool.checkpoint(), len(self.events), self.num_cow_copies, self.num_evictions

    def end(self) -> None:
        """The transaction is over (committed or rolled back)."""
        self._tiers_end()
        self._trim_events()

    def rollback(self, checkpoint: tuple, seqs: Iterable[Sequence]) -> None:
        """Undo everything since :meth:`begin` (the caller restores the sequences first and passes them all)."""
        pool_cp, num_events, self.num_cow_copies, self.num_evictions = checkpoint
        self._tiers_rollback()
        self.pool.restore(pool_cp)
        del self.events[num_events:]
        self._published = min(self._published, len(self.events))
        self.holders = {}
        for seq in seqs:
            for block in seq.block_table:
                self.holders.setdefault(block, set()).add(seq.seq_id)
        self.end()

    # ---- invariants -----------------------------------------------------------------------------------------
    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """The pool's invariants against the tables of ``seqs`` (all conversations), plus the manager's own:
        holders match the tables, and a used block's owner is one of its holders."""
        tables = {s.seq_id: s.block_table for s in seqs if s.block_table}
        self.pool.check_invariants(tables.values())
        expected: dict[int, set[int]] = {}
        for cid, table in tables.items():
            for block in table:
                expected.setdefault(block, set()).add(cid)
        assert expected == self.holders, "holders disagree with the block tables"
        for block, holders in self.holders.items():
            assert int(self.pool.owner[block]) in holders, f"block {block}'s owner holds no reference to it"
        if self.tiers is not None:
            self.tiers.check_invariants()

    # ---- lower tiers (host memory, disk): engine.kv.tiers ----------------------------------------------------------
    def attach_tiers(self, tiers: TierStore, read_device_blocks) -> None:
        """Keep evicted blocks in ``tiers``; ``read_device_blocks(blocks, out)`` reads those device blocks' raw K/V
        bytes into ``out`` (uint8 [n, bytes]; called while they are being taken, before anything overwrites them)."""
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

    def _read_tier_hits(self, seq: Sequence, hits: list) -> tuple[list[tuple[int, TierHit]], np.ndarray | None,
                                                                  int | None]:
        """((index, hit) of each tier hit, their bytes as one uint8 [n, bytes] array, None), read now (a later
        eviction in this admission may move them on). When the hit at index ``i`` fails its checksum it is
        dropped and the hits stop there: (the ones before it, their bytes, ``i``)."""
        found = [(index, hit) for index, hit in enumerate(hits) if isinstance(hit, TierHit)]
        if not found:
            return [], None, None
        data = self.tiers.staging(len(found))
        for row, (index, hit) in enumerate(found):
            if not self.tiers.read_into(hit, data[row]):
                self.tiers.drop_corrupt(hit, self.pool.clock, self.emit, seq.seq_id)
                return found[:row], data[:row], index
        return found, data, None

    def _load(self, seq: Sequence, loads: list[tuple[int, TierHit]], data: np.ndarray) -> None:
        """Fresh device blocks for the tier hits: taken (evictions may offload others; the hits' slots are pinned
        meanwhile), loaded (LOADED), full and hashed again (STORED, as if computed)."""
        bs, pool, table = self.block_size, self.pool, seq.block_table
        self.tiers.pin(hit for _, hit in loads)
        blocks = self._take_blocks(seq, len(loads))
        kept = self._last_offload  # what the evicted ones among them held, read for the offload just now
        self.emit(EventKind.ALLOCATED, seq.seq_id, block_ids=tuple(blocks))
        hashes = seq.full_block_hashes(bs)
        for (index, hit), block in zip(loads, blocks):
            table[index] = block
            self.tiers.loaded(hit, block, pool.clock, self.emit, seq.seq_id)
            pool.set_filled(block, bs)
            info = HashedBlock(tuple(seq.token_ids[index * bs:(index + 1) * bs]), index * bs,
                               hashes[index - 1] if index else None)
            registered = pool.register_hash(block, hit.block_hash, info)
            assert registered, "a tier hit's hash was already on the device (it would have been a device hit)"
        self.pending_loads.append(TierLoad(blocks, data, *(kept or ((), None))))
        self.tiers.unpin()
        run: list[int] = []
        for index, _ in loads:
            if run and index != run[-1] + 1:
                self._emit_stored(seq, run, hashes)
                run = []
            run.append(index)
        self._emit_stored(seq, run, hashes)

    def _note_sources(self, seq: Sequence, hits: list) -> None:
        tiers = [h.tier for h in hits if isinstance(h, TierHit)]
        bs = self.block_size
        self._set_sources(seq.seq_id, {"device": (len(hits) - len(tiers)) * bs, "host": tiers.count("host") * bs,
                                       "disk": tiers.count("disk") * bs, "computed": seq.num_tokens - len(hits) * bs})

    def _set_sources(self, seq_id: int, sources: dict[str, int]) -> None:
        if self._sources_undo is not None:
            self._sources_undo.append((seq_id, self.prompt_sources.get(seq_id)))
        self.prompt_sources[seq_id] = sources

    def _tiers_begin(self) -> None:
        self._sources_undo = []
        self.pending_loads = []
        if self.tiers is not None:
            self.tiers.begin()

    def _tiers_end(self) -> None:
        self._sources_undo = None
        if self.tiers is not None:
            self.tiers.end()

    def _tiers_rollback(self) -> None:
        for seq_id, old in reversed(self._sources_undo or []):
            if old is None:
                self.prompt_sources.pop(seq_id, None)
            else:
                self.prompt_sources[seq_id] = old
        self._sources_undo = []
        self.pending_loads = []
        if self.tiers is not None:
            self.tiers.rollback()
