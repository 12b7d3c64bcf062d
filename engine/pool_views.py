"""The engine's state as immutable views: snapshots, conversation infos, memory figures, block inspection.

Read-only: nothing here changes the pool. Views are cached by version (a conversation's info is rebuilt only when
that conversation changed; the snapshot only when anything did), so the runner can ask after every step.
"""
from __future__ import annotations

from collections import deque
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple


from kvstream.views import (NO_HASH, BlockInfo, BlockState, ConversationInfo, EngineMetrics, MemoryStats,
                            PoolSnapshot, frozen_array, promise_changed_blocks,
                            promise_output_prefixes)

from kvstream.rules import hash_note

from .errors import EngineError
from .sequence import Sequence
from .validation import is_int

_HAS_SOURCES = "prompt_token_sources" in ConversationInfo.__dataclass_fields__

if TYPE_CHECKING:
    from .engine import Engine


class _Built(NamedTuple):
    """A conversation's info as last built, and what it was built from."""

    version: int  # the sequence's version then
    info: ConversationInfo
    tokens: list  # the sequence's token list (the object: only ever appended to) and its length then
    length: int
    prefix: tuple | None  # the previous info's outputs, which this one's start with (None: not known)


class PoolViews:
    """Builds the views of one engine."""

    def __init__(self, engine: "Engine"):
        self.engine = engine
        self._info_cache: dict[int, _Built] = {}  # seq id -> its info as last built
        self._snapshot: PoolSnapshot | None = None
        self.finished: deque[int] = deque()  # ids of finished/ended conversations still in views, newest last
        self._tiers: dict[str, tuple[int, object]] = {}  # tier name -> (its version, its TierView then)

    def forget(self, seq_id: int) -> None:
        self._info_cache.pop(seq_id, None)

    def clear(self) -> None:
        self._info_cache.clear()
        self._snapshot = None

    # ---- conversations --------------------------------------------------------------------------------------
    def info(self, seq: Sequence) -> ConversationInfo:
        cached = self._info_cache.get(seq.seq_id)
        if cached is not None and cached.version == seq.version:
            return cached.info
        tok = self.engine.tokenizer
        ids, n_prompt = seq.token_ids, seq.num_prompt_tokens
        previous = cached.info if cached is not None else None
        prefix = None  # previous.output_token_ids when these outputs are known to start with them
        if previous is not None and len(previous.prompt_token_ids) == n_prompt:
            prompt, prompt_text = previous.prompt_token_ids, previous.prompt_text  # a decode step: prompt unchanged
            # The same token list, only ever appended to in place (a fork's child gets a new list; a rollback
            # clears these views): its tokens up to its old length are the ones the previous info was built from,
            # so the outputs are the previous ones plus the new tokens (the snapshot promises it: output_prefixes).
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
        return {"prompt_token_sources": dict(self.engine.manager.prompt_sources.get(seq.seq_id, {}))}

    def _group_tables(self, seq: Sequence) -> tuple[tuple[int, ...], ...]:
        """Every KV cache group's table of ``seq`` (-1 where a window released a block); () for one plain group."""
        manager = self.engine.manager
        if not hasattr(manager, "tables_of"):
            return ()
        return tuple(tuple(t) for t in manager.tables_of(seq))

    def conversations(self) -> tuple[ConversationInfo, ...]:
        """Live conversations and the most recent finished ones (the window), by id."""
        seqs = self.engine.seqs
        shown = sorted([i for i, s in seqs.items() if not s.is_finished] + list(self.finished))
        return tuple(self.info(seqs[i]) for i in shown)

    # ---- pool -----------------------------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        eng = self.engine
        s, m = eng.scheduler, eng.manager
        return EngineMetrics(
            num_steps=eng.num_steps, num_generated_tokens=eng.num_generated, num_prefill_tokens=eng.num_prefill,
            num_preemptions=s.num_preemptions, num_cow_copies=m.num_cow_copies, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, last_step_seconds=eng.last_step_seconds,
            last_step_tokens=eng.last_step_tokens, last_step_prefill_tokens=eng.last_step_prefill,
            num_evictions=m.num_evictions)

    def memory_stats(self) -> MemoryStats:
        eng = self.engine
        pool, bs = eng.pool, eng.cfg.block_size
        used = pool.state == BlockState.USED
        num_used = int(used.sum())
        filled = int(pool.num_filled[used].sum())
        running = eng.scheduler.running
        logical = sum(s.num_computed_tokens for s in running)
        entries = sum(len(s.block_table) for s in running)
        per_block = eng.kv.bytes_per_block
        return MemoryStats(
            bytes_per_block=per_block, bytes_per_token=per_block // bs, num_used_blocks=num_used,
            num_cached_blocks=pool.num_cached_blocks,
            num_free_blocks=eng.cfg.num_blocks - num_used - pool.num_cached_blocks,
            num_filled_slots=filled, num_allocated_slots=num_used * bs, num_tail_empty_slots=num_used * bs - filled,
            num_logical_slots=logical, num_slots_saved_by_sharing=logical - filled,
            num_contiguous_slots=sum(s.num_prompt_tokens + s.max_new_tokens for s in running),
            block_table_bytes=4 * entries)

    def snapshot(self) -> PoolSnapshot:
        """An immutable copy of the pool and the conversations; the same object while nothing changed."""
        eng = self.engine
        if self._snapshot is not None and self._snapshot.version == eng.version:
            return self._snapshot
        pool = eng.pool
        base, changed = self._snapshot, eng.manager.take_changed_blocks()  # what may differ from base's arrays
        conversations = self.conversations()
        tables = MappingProxyType({s.seq_id: self.info(s).block_table for s in eng.scheduler.running})  # shared
        self._snapshot = PoolSnapshot(
            step_id=eng.step_id, block_size=eng.cfg.block_size, num_blocks=eng.cfg.num_blocks,
            ref_count=frozen_array(pool.ref_count), num_filled=frozen_array(pool.num_filled),
            state=frozen_array(pool.state), owner=frozen_array(pool.owner), last_access=frozen_array(pool.last_access),
            block_tables=tables, conversations=conversations, metrics=self.metrics(),
            memory=self.memory_stats(), model_name=eng.model_name, device=str(eng.device),
            max_model_len=eng.max_model_len, block_hash=frozen_array(pool.block_hash), version=eng.version,
            source="engine", tiers=self._tier_views(), tokenizer=eng.model_name if eng.takes_text else "",
            **self._group_fields())
        if base is not None and changed is not None:
            promise_changed_blocks(self._snapshot, base, changed[0], last_access=changed[1])
        cache = self._info_cache  # each info's promise, made when it was built (it may predate this snapshot)
        promise_output_prefixes(self._snapshot, {c.conversation_id: built.prefix for c in conversations
                                                 if (built := cache.get(c.conversation_id)) is not None
                                                 and built.info is c and built.prefix is not None})
        return self._snapshot

    def _tier_views(self) -> MappingProxyType:
        """Each lower tier that is on as a TierView, rebuilt only when that tier changed (a tier may hold 262,144
        slots: copying its arrays every step would cost more than the step's own bookkeeping)."""
        tiers = self.engine.tiers
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
        eng = self.engine
        fields = {"kv_cache_groups": eng.kv_cache_groups}
        manager = eng.manager
        if hasattr(manager, "tables_of"):
            running = eng.scheduler.running
            infos = {s.seq_id: self.info(s).group_block_tables for s in running}
            fields["group_block_tables"] = tuple(
                MappingProxyType({cid: tables[g] for cid, tables in infos.items()})
                for g in range(len(eng.kv_cache_groups)))
            fields["block_group"] = frozen_array(manager.block_group)
        return fields

    # ---- one block ------------------------------------------------------------------------------------------
    def inspect_block(self, block_id) -> BlockInfo:
        eng = self.engine
        n = eng.cfg.num_blocks
        if not is_int(block_id) or not 0 <= block_id < n:
            raise EngineError(f"no block {block_id!r}: block ids run from 0 to {n - 1}")
        pool, bs, b = eng.pool, eng.cfg.block_size, int(block_id)
        state = BlockState(int(pool.state[b]))
        filled = int(pool.num_filled[b])
        manager = eng.manager
        group = int(manager.block_group[b]) if hasattr(manager, "block_group") else 0
        tables = {s.seq_id: s.group_table(group) for s in eng.scheduler.running}  # the block's group's tables
        owners = manager.owners(b, tables)
        h = int(pool.block_hash[b])
        if owners:
            seq, index = eng.seqs[owners[0][0]], owners[0][1]
            positions = tuple(range(index * bs, index * bs + filled))
            tokens = tuple(seq.token_ids[p] for p in positions)
        elif h != NO_HASH and h in pool.hashed:
            record = pool.hashed[h]
            tokens = record.token_ids
            positions = tuple(range(record.start, record.start + len(tokens)))
        else:
            tokens, positions = (), ()
        note = hash_note(state, h != NO_HASH, filled, bs, pool.enable_prefix_caching)
        keys, values = eng.kv.read_block(b, filled)
        if len(eng.kv_cache_groups) > 1:  # the block's group's layers (its planes), in that group's layer order
            planes = len(eng.kv_cache_groups[group].layers)
            keys, values = keys[:planes].copy(), values[:planes].copy()
        keys.setflags(write=False)
        values.setflags(write=False)
        return BlockInfo(
            block_id=b, state=state, ref_count=int(pool.ref_count[b]), num_filled=filled, block_size=bs,
            token_ids=tuple(tokens), token_texts=tuple(eng.token_text(t) for t in tokens), positions=positions,
            owners=tuple(owners), block_hash=h if h != NO_HASH else None, hash_note=note,
            last_owner=int(pool.owner[b]), keys=keys, values=values)
