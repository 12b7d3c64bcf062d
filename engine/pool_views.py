"""The engine's state as immutable views: snapshots, conversation infos, memory figures, block inspection.

Read-only: nothing here changes the pool. Views are cached by version (a conversation's info is rebuilt only when
that conversation changed; the snapshot only when anything did), so the runner can ask after every step.
"""
from __future__ import annotations

from collections import deque
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple

from kvstream.views import (NO_CHANGE_RECORD, NO_HASH, BlockInfo, BlockState, ChangeRecord, ConversationInfo,
                            EngineMetrics, MemoryStats, PoolSnapshot, block_masks, frozen_array, hash_reason)

from .errors import EngineError
from .sequence import Sequence
from .validation import is_int

_HAS_SOURCES = "prompt_token_sources" in ConversationInfo.__dataclass_fields__


class _Built(NamedTuple):
    """A conversation's info as last built, and what it was built from."""

    version: int  # the sequence's version then
    info: ConversationInfo
    tokens: list  # the sequence's token list (the object: only ever appended to) and its length then
    length: int
    prefix: tuple | None  # the previous info's outputs, which this one's start with (None: not known)


class StepCounts(NamedTuple):
    """The engine's clock and counters as they are now (read for every snapshot and metrics)."""

    step_id: int
    version: int  # bumped by every change: a snapshot is rebuilt only when it moved
    num_steps: int
    num_generated: int
    num_prefill: int
    last_step_seconds: float
    last_step_tokens: int
    last_step_prefill: int


class PoolViews:
    """Builds the views of one engine from the parts it reads: the pool and its manager, the K/V cache, the
    scheduler's running list, the conversations, the tokenizer, and the finished-conversation window, which whoever
    finishes conversations owns and this only reads (newest last). ``counts`` gives the clock and counters now.

    ``seqs`` and ``finished`` are read at every call, so their owner must change them in place (a rollback
    included); the lower tiers are read through the manager (``manager.tiers``: None once they are closed)."""

    def __init__(self, *, cfg, pool, manager, scheduler, kv, seqs: Mapping[int, Sequence], tokenizer,
                 kv_cache_groups, finished: deque, counts: Callable[[], StepCounts], model_name: str, device,
                 max_model_len: int):
        self.cfg, self.pool, self.manager, self.scheduler, self.kv = cfg, pool, manager, scheduler, kv
        self.seqs, self.tokenizer, self.kv_cache_groups = seqs, tokenizer, kv_cache_groups
        self.finished = finished  # read only here
        self.counts = counts
        self.model_name, self.device, self.max_model_len = model_name, device, max_model_len
        self._info_cache: dict[int, _Built] = {}  # seq id -> its info as last built
        self._snapshot: PoolSnapshot | None = None
        self._changes: ChangeRecord = NO_CHANGE_RECORD  # what changed between the snapshot before and _snapshot
        self._tiers: dict[str, tuple[int, object]] = {}  # tier name -> (its version, its TierView then)

    def forget(self, seq_id: int) -> None:
        self._info_cache.pop(seq_id, None)

    def clear(self) -> None:
        self._info_cache.clear()
        self._snapshot = None
        self._changes = NO_CHANGE_RECORD

    # ---- conversations --------------------------------------------------------------------------------------
    def info(self, seq: Sequence) -> ConversationInfo:
        cached = self._info_cache.get(seq.seq_id)
        if cached is not None and cached.version == seq.version:
            return cached.info
        tok = self.tokenizer
        ids, n_prompt = seq.token_ids, seq.num_prompt_tokens
        previous = cached.info if cached is not None else None
        prefix = None  # previous.output_token_ids when these outputs are known to start with them
        if previous is not None and len(previous.prompt_token_ids) == n_prompt:
            prompt, prompt_text = previous.prompt_token_ids, previous.prompt_text  # a decode step: prompt unchanged
            # The same token list, only ever appended to in place (a fork's child gets a new list; a rollback
            # clears these views): its tokens up to its old length are the ones the previous info was built from,
            # so the outputs are the previous ones plus the new tokens (the change record says so: output_prefixes).
            if cached.tokens is ids and cached.length <= len(ids):
                prefix = previous.output_token_ids
        else:
            prompt = tuple(ids[:n_prompt])
            prompt_text = tok.decode(prompt)
        out = tuple(ids[n_prompt:]) if prefix is None else prefix + tuple(ids[cached.length:])
        table = tuple(seq.block_table)
        if previous is not None and previous.block_table == table:
            table = previous.block_table  # the same tuple while the table is unchanged (15 of 16 decode steps)
        info = ConversationInfo(
            conversation_id=seq.seq_id, status=seq.status, prompt_token_ids=prompt,
            output_token_ids=out, output_text=tok.decode(out, final=seq.is_finished), prompt_text=prompt_text,
            block_table=table, num_computed_tokens=seq.num_computed_tokens,
            num_cached_tokens=seq.num_cached_tokens, max_new_tokens=seq.max_new_tokens, temperature=seq.temperature,
            parent_id=seq.parent_id, num_preemptions=seq.num_preemptions, arrival_step=seq.arrival_step,
            finish_reason=seq.finish_reason, turns=tuple(seq.turns), group_block_tables=self._group_tables(seq),
            **self._sources(seq))
        self._info_cache[seq.seq_id] = _Built(seq.version, info, ids, len(ids), prefix)
        return info

    def _sources(self, seq: Sequence) -> dict:
        """ConversationInfo.prompt_token_sources, where the views carry it (the field comes with the pool stream's
        support for it)."""
        if not _HAS_SOURCES:
            return {}
        return {"prompt_token_sources": dict(self.manager.prompt_sources.get(seq.seq_id, {})),
                "prompt_block_outcomes": self.manager.prompt_outcomes.get(seq.seq_id, ())}

    def _group_tables(self, seq: Sequence) -> tuple[tuple[int, ...], ...]:
        """Every KV cache group's table of ``seq`` (-1 where a window released a block); () for one plain group."""
        manager = self.manager
        if manager.plain:
            return ()
        return tuple(tuple(t) for t in manager.tables_of(seq))

    def conversations(self) -> tuple[ConversationInfo, ...]:
        """Live conversations and the most recent finished ones (the window), by id."""
        seqs = self.seqs
        shown = sorted([i for i, s in seqs.items() if not s.is_finished] + list(self.finished))
        return tuple(self.info(seqs[i]) for i in shown)

    # ---- pool -----------------------------------------------------------------------------------------------
    def metrics(self, counts: StepCounts | None = None) -> EngineMetrics:
        c = self.counts() if counts is None else counts
        s, m = self.scheduler, self.manager
        return EngineMetrics(
            num_steps=c.num_steps, num_generated_tokens=c.num_generated, num_prefill_tokens=c.num_prefill,
            num_preemptions=s.num_preemptions, num_cow_copies=m.num_cow_copies, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, last_step_seconds=c.last_step_seconds,
            last_step_tokens=c.last_step_tokens, last_step_prefill_tokens=c.last_step_prefill,
            num_evictions=m.num_evictions, **{f"prompt_blocks_{k}": v for k, v in m.outcome_totals.items()})

    def memory_stats(self) -> MemoryStats:
        pool, bs = self.pool, self.cfg.block_size
        used = pool.state == BlockState.USED
        num_used = int(used.sum())
        filled = int(pool.num_filled[used].sum())
        running = self.scheduler.running
        logical = sum(s.num_computed_tokens for s in running)
        entries = sum(len(s.block_table) for s in running)
        per_block = self.kv.bytes_per_block
        return MemoryStats(
            bytes_per_block=per_block, bytes_per_token=per_block // bs, num_used_blocks=num_used,
            num_cached_blocks=pool.num_cached_blocks,
            num_free_blocks=self.cfg.num_blocks - num_used - pool.num_cached_blocks,
            num_filled_slots=filled, num_allocated_slots=num_used * bs, num_tail_empty_slots=num_used * bs - filled,
            num_logical_slots=logical, num_slots_saved_by_sharing=logical - filled,
            num_contiguous_slots=sum(s.num_prompt_tokens + s.max_new_tokens for s in running),
            block_table_bytes=4 * entries)

    def snapshot(self) -> PoolSnapshot:
        """An immutable copy of the pool and the conversations; the same object while nothing changed."""
        counts = self.counts()
        if self._snapshot is not None and self._snapshot.version == counts.version:
            return self._snapshot
        pool, cfg = self.pool, self.cfg
        base, changed = self._snapshot, self.manager.take_changed_blocks()  # what may differ from base's arrays
        conversations = self.conversations()
        tables = MappingProxyType({s.seq_id: self.info(s).block_table for s in self.scheduler.running})  # shared
        self._snapshot = PoolSnapshot(
            step_id=counts.step_id, block_size=cfg.block_size, num_blocks=cfg.num_blocks,
            ref_count=frozen_array(pool.ref_count), num_filled=frozen_array(pool.num_filled),
            state=frozen_array(pool.state), owner=frozen_array(pool.owner), last_access=frozen_array(pool.last_access),
            block_tables=tables, conversations=conversations, metrics=self.metrics(counts),
            memory=self.memory_stats(), model_name=self.model_name, device=str(self.device),
            max_model_len=self.max_model_len, block_hash=frozen_array(pool.block_hash), version=counts.version,
            source="engine", tiers=self._tier_views(),
            tokenizer=self.model_name if getattr(self.tokenizer, "takes_text", True) else "",
            kv_cache_dtype=self.kv.kv_dtype_name, **self._group_fields())
        masks = None
        if base is not None and changed is not None:
            masks = block_masks(self._snapshot, base, changed[0], last_access=changed[1])
        cache = self._info_cache  # each info's prefix, noted when it was built (it may predate this snapshot)
        prefixes = {c.conversation_id: built.prefix for c in conversations
                    if (built := cache.get(c.conversation_id)) is not None and built.info is c
                    and built.prefix is not None}
        self._changes = NO_CHANGE_RECORD if masks is None and not prefixes else \
            ChangeRecord(base if masks is not None else None, masks, MappingProxyType(prefixes))
        return self._snapshot

    def changes(self, snapshot: PoolSnapshot) -> ChangeRecord:
        """What changed between the snapshot built before ``snapshot`` and it (the pool-stream encoder's fast path):
        the blocks the pool wrote and the outputs that only grew. Known only for the snapshot built last
        (:data:`NO_CHANGE_RECORD` for any other: compare everything)."""
        return self._changes if snapshot is self._snapshot else NO_CHANGE_RECORD

    def _tier_views(self) -> MappingProxyType:
        """Each lower tier that is on as a TierView, rebuilt only when that tier changed (a tier may hold 262,144
        slots: copying its arrays every step would cost more than the step's own bookkeeping)."""
        tiers = getattr(self.manager, "tiers", None)  # None: no lower tiers, or closed
        if tiers is None:
            return MappingProxyType({})
        out = {}
        for tier in tiers.order:
            cached = self._tiers.get(tier.name)
            if cached is None or cached[0] != tier.version:
                cached = self._tiers[tier.name] = (tier.version, tier.view())
            out[tier.name] = cached[1]
        return MappingProxyType(out)

    def _group_fields(self) -> dict:
        """The snapshot's KV cache group fields: the groups always; per-group tables and each block's group only
        for a pool of several groups (or a window), where group 0's tables alone do not say everything."""
        fields = {"kv_cache_groups": self.kv_cache_groups}
        manager = self.manager
        if not manager.plain:
            running = self.scheduler.running
            infos = {s.seq_id: self.info(s).group_block_tables for s in running}
            fields["group_block_tables"] = tuple(
                MappingProxyType({cid: tables[g] for cid, tables in infos.items()})
                for g in range(len(self.kv_cache_groups)))
            fields["block_group"] = frozen_array(manager.block_group)
        return fields

    # ---- one block ------------------------------------------------------------------------------------------
    def inspect_block(self, block_id) -> BlockInfo:
        n = self.cfg.num_blocks
        if not is_int(block_id) or not 0 <= block_id < n:
            raise EngineError(f"no block {block_id!r}: block ids run from 0 to {n - 1}")
        pool, bs, b = self.pool, self.cfg.block_size, int(block_id)
        state = BlockState(int(pool.state[b]))
        filled = int(pool.num_filled[b])
        manager = self.manager
        group = int(manager.block_group[b])
        tables = {s.seq_id: s.group_table(group) for s in self.scheduler.running}  # the block's group's tables
        owners = manager.owners(b, tables)
        h = int(pool.block_hash[b])
        if owners:
            seq, index = self.seqs[owners[0][0]], owners[0][1]
            positions = tuple(range(index * bs, index * bs + filled))
            tokens = tuple(seq.token_ids[p] for p in positions)
        elif h != NO_HASH and h in pool.hashed:
            record = pool.hashed[h]
            tokens = record.token_ids
            positions = tuple(range(record.start, record.start + len(tokens)))
        else:
            tokens, positions = (), ()
        reason = hash_reason(state, h != NO_HASH, filled, bs, pool.enable_prefix_caching)
        layers = self.kv_cache_groups[group].layers  # the model layer each of the block's planes holds
        keys, values = self.kv.read_block(b, filled, layers)
        codes = self.kv.read_block_codes(b, filled)  # an fp8 pool's bytes as stored, else None
        if len(self.kv_cache_groups) > 1:  # the block's group's layers (its planes), in that group's layer order
            planes = len(layers)
            keys, values = keys[:planes].copy(), values[:planes].copy()
            codes = None if codes is None else (codes[0][:planes].copy(), codes[1][:planes].copy())
        for array in (keys, values, *(codes or ())):
            array.setflags(write=False)
        scales = self.kv.scales
        kv_scales = tuple((scales.k[i], scales.v[i]) for i in layers[: keys.shape[0]]) if codes is not None else ()
        return BlockInfo(
            block_id=b, state=state, ref_count=int(pool.ref_count[b]), num_filled=filled, block_size=bs,
            token_ids=tuple(tokens), token_texts=tuple(self.tokenizer.token_text(int(t)) for t in tokens),
            positions=positions,
            owners=tuple(owners), block_hash=h if h != NO_HASH else None, hash_reason=reason,
            last_owner=int(pool.owner[b]), keys=keys, values=values, kv_cache_dtype=self.kv.kv_dtype_name,
            stored_keys=None if codes is None else codes[0], stored_values=None if codes is None else codes[1],
            kv_scales=kv_scales)
