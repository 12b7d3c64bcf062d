"""The serving engine: conversations in, tokens out, K/V kept in a paged block pool.

One :meth:`Engine.step` = schedule (admit, preempt, copy-on-write) -> run the model on a mixed batch of prefill
chunks and single-token decodes -> sample -> update the pool. It is synchronous and deterministic for a seed, so
tests drive it directly; :class:`engine.runner.EngineRunner` runs it on a thread for the GUI.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from .attention import DecodePlan, attend_batch, plan_decode, use_compiled_attention
from .block_pool import BlockPool, blocks_needed, random_cycle
from .config import EngineConfig
from .errors import EngineError
from .kv_cache import KVCache
from .loader import load_model
from .model import BatchMetadata
from .scheduler import Scheduler
from .sequence import Sequence
from .snapshot import (BlockInfo, BlockState, ConversationInfo, EngineMetrics, MemoryStats, PoolSnapshot, Status,
                       frozen_array)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class RelocationReport:
    """What :meth:`Engine.relocate_and_verify` moved, and the proof that attention did not change."""

    mapping: dict  # old physical id -> new physical id, for every used or cached block
    num_moved: int
    max_abs_diff: float  # max |attention output before - after| over running conversations and layers
    num_conversations_checked: int
    lookahead_steps: int = 0  # steps decoded twice, from the old layout and from the new one, then rolled back
    tokens_identical: bool = True  # those steps produced the same tokens for every conversation
    num_tokens_compared: int = 0


class Engine:
    """Owns the model, the physical KV cache, the block pool and the conversations."""

    def __init__(self, cfg: EngineConfig, progress: Callable[[str, float], None] | None = None):
        if not isinstance(cfg, EngineConfig):
            raise EngineError("Engine needs an EngineConfig")
        self.cfg = cfg
        if cfg.device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif cfg.device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' was asked for but torch sees no CUDA device")
        else:
            device = cfg.device
        self.device = torch.device(device)
        self.dtype = _DTYPES[cfg.dtype]
        if cfg.compile_attention:
            use_compiled_attention(True)
        loaded = load_model(cfg.model, self.dtype, self.device, cfg.seed, progress)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = loaded.eos_token_ids
        mc = loaded.config
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.kv = KVCache(mc.num_hidden_layers, cfg.num_blocks, cfg.block_size, mc.num_key_value_heads,
                          mc.head_dim, self.dtype, self.device)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.seqs: dict[int, Sequence] = {}
        self._next_id = 0
        self.step_id = 0
        self._eos = set(self.eos_token_ids)
        self._info_cache: dict[int, tuple[int, ConversationInfo]] = {}
        self._num_steps = self._num_generated = self._num_prefill = 0
        self._last_step_seconds = 0.0
        self._last_step_tokens = self._last_step_prefill = 0

    # ---- model facts ------------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.model_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.model_config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.model_config.head_dim

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def tokenize(self, text: str, continuation: bool = False) -> list[int]:
        """Token ids of ``text`` as a prompt takes them (a reply, ``continuation``, gets no BOS)."""
        return list(self.tokenizer.encode(text, add_special_tokens=not continuation))

    def detokenize(self, token_ids: Seq[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(int(token_id))

    # ---- input checks -----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt, prompt_token_ids, *, continuation: bool = False) -> list[int]:
        if prompt is not None and prompt_token_ids is not None:
            raise EngineError("give either prompt text or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            try:
                ids = [int(t) for t in prompt_token_ids]
            except (TypeError, ValueError):
                raise EngineError("prompt_token_ids must be a list of integers") from None
        elif prompt is not None:
            if not isinstance(prompt, str):
                raise EngineError(f"prompt must be text, got {type(prompt).__name__}")
            if not prompt:
                raise EngineError("the prompt is empty")
            ids = self.tokenize(prompt, continuation)
        else:
            raise EngineError("give a prompt (text) or prompt_token_ids")
        if not ids:
            raise EngineError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    @staticmethod
    def _check_generation(max_new_tokens, temperature) -> tuple[int, float]:
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise EngineError(f"max_new_tokens must be a whole number, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise EngineError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        try:
            temperature = float(temperature)
        except (TypeError, ValueError):
            raise EngineError(f"temperature must be a number, got {temperature!r}") from None
        if not math.isfinite(temperature) or temperature < 0:
            raise EngineError(f"temperature must be 0 (greedy) or positive, got {temperature}")
        return int(max_new_tokens), temperature

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one conversation may reach: the positions the model was built for (as
        vLLM's max_model_len)."""
        return self.model_config.max_position_embeddings

    def _check_fits(self, num_tokens: int, max_new_tokens: int) -> None:
        max_len = self.max_model_len
        if num_tokens + max_new_tokens > max_len:
            raise EngineError(
                f"this conversation would reach {num_tokens + max_new_tokens} tokens ({num_tokens} prompt + "
                f"{max_new_tokens} new) but the model handles at most {max_len} (max_position_embeddings); "
                f"shorten the prompt or lower max_new_tokens")
        need = blocks_needed(num_tokens, max_new_tokens, self.cfg.block_size)
        if need > self.cfg.num_blocks:
            raise EngineError(
                f"this conversation needs {need} blocks ({num_tokens} prompt tokens + {max_new_tokens} new tokens at "
                f"{self.cfg.block_size} per block) but the whole pool has {self.cfg.num_blocks}; shorten the prompt, "
                f"lower max_new_tokens or restart with a larger pool")

    def _seq(self, conversation_id) -> Sequence:
        seq = self.seqs.get(conversation_id) if isinstance(conversation_id, (int, np.integer)) else None
        if seq is None:
            raise EngineError(f"no conversation with id {conversation_id!r}")
        return seq

    def _new_seq(self, token_ids, max_new_tokens, temperature, seed, parent_id=None, ignore_eos=False) -> Sequence:
        seq_id = self._next_id
        self._next_id += 1
        seed = self.cfg.seed * 1_000_003 + seq_id if seed is None else int(seed)
        seq = Sequence(seq_id, token_ids, max_new_tokens, temperature, seed, self.step_id, parent_id, bool(ignore_eos))
        seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.seqs[seq_id] = seq
        return seq

    # ---- conversations ----------------------------------------------------------------------------------------
    def add_conversation(self, prompt: str | None = None, *, prompt_token_ids: Seq[int] | None = None,
                         max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
                         ignore_eos: bool = False) -> int:
        """Queue a new conversation; returns its id. It is admitted as soon as its prompt fits in the pool.
        ``ignore_eos`` keeps it decoding to ``max_new_tokens`` (for benchmarks that need a steady load)."""
        ids = self._prompt_ids(prompt, prompt_token_ids)
        max_new_tokens, temperature = self._check_generation(max_new_tokens, temperature)
        self._check_fits(len(ids), max_new_tokens)
        seq = self._new_seq(ids, max_new_tokens, temperature, seed, ignore_eos=ignore_eos)
        self.scheduler.add(seq)
        return seq.seq_id

    def fork_conversation(self, conversation_id: int, seed: int | None = None) -> int:
        """A child that shares every block of the parent; the two diverge by copy-on-write."""
        parent = self._seq(conversation_id)
        if parent.is_finished:
            raise EngineError(f"conversation {conversation_id} is {parent.status}; only a live conversation can be forked")
        child = self._new_seq(parent.token_ids, parent.max_new_tokens, parent.temperature, seed, parent.seq_id,
                              parent.ignore_eos)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.block_hashes = list(parent.block_hashes)
        if parent.status == Status.RUNNING:
            for block in parent.block_table:
                self.pool.acquire(block, child.seq_id)
            child.block_table = list(parent.block_table)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = Status.RUNNING
            self.scheduler.running.append(child)
        else:
            self.scheduler.add(child)
        return child.seq_id

    def end_conversation(self, conversation_id: int) -> None:
        """Stop a conversation now; its blocks are released at once."""
        seq = self._seq(conversation_id)
        if seq.status == Status.ENDED:
            raise EngineError(f"conversation {conversation_id} has already ended")
        self.scheduler.finish(seq, Status.ENDED)

    def continue_conversation(self, conversation_id: int, prompt: str | None = None, *,
                              prompt_token_ids: Seq[int] | None = None, max_new_tokens: int | None = None,
                              temperature: float | None = None) -> None:
        """Send a follow-up message to a finished conversation; its whole history becomes the new prompt."""
        seq = self._seq(conversation_id)
        if seq.status != Status.FINISHED:
            raise EngineError(f"conversation {conversation_id} is {seq.status}; only a finished conversation can get a reply")
        ids = self._prompt_ids(prompt, prompt_token_ids, continuation=True)
        max_new_tokens, temperature = self._check_generation(
            seq.max_new_tokens if max_new_tokens is None else max_new_tokens,
            seq.temperature if temperature is None else temperature)
        self._check_fits(seq.num_tokens + len(ids), max_new_tokens)
        seq.start_new_turn(ids, max_new_tokens, temperature, self.step_id)
        self.scheduler.add(seq)

    def conversation(self, conversation_id: int) -> ConversationInfo:
        return self._info(self._seq(conversation_id))

    def conversations(self) -> tuple[ConversationInfo, ...]:
        return tuple(self._info(s) for s in self.seqs.values())

    # ---- running ----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_until_idle(self, max_steps: int | None = None) -> None:
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1

    def generate(self, prompts: Seq[Seq[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy outputs for a batch of token-id prompts, decoded together."""
        ids = [self.add_conversation(prompt_token_ids=p, max_new_tokens=max_new_tokens) for p in prompts]
        while any(not self.seqs[i].is_finished for i in ids):
            self.step()
        return [list(self.seqs[i].output_token_ids) for i in ids]

    def step(self) -> None:
        """Schedule, run the model once over every scheduled conversation, sample, update the pool."""
        if not self.has_work():
            return
        start = time.perf_counter()
        self.step_id += 1
        self.pool.clock = self.step_id
        batch = self.scheduler.schedule()
        if batch.copies:
            self.kv.copy_blocks(batch.copies)
        num_prefill = 0
        num_sampled = 0
        if not batch.empty:
            seqs = batch.decodes + batch.prefills
            meta, input_ids, positions, sample_index = self._prepare(batch)
            with torch.inference_mode():
                hidden = self.model(input_ids, positions, meta, self.kv.layers, attend_batch)
                logits = self.model.compute_logits(hidden[sample_index])  # [seqs, vocab]
            tokens = self._sample(logits, seqs)
            num_prefill = sum(s.num_tokens - s.num_computed_tokens for s in batch.prefills)
            self._postprocess(seqs, tokens)
            num_sampled = len(seqs)
        used = self.pool.state == BlockState.USED
        self.pool.last_access[used] = self.step_id  # every used block was read by attention this step
        self._num_steps += 1
        self._num_generated += num_sampled
        self._num_prefill += num_prefill
        self._last_step_tokens = num_sampled
        self._last_step_prefill = num_prefill
        self._last_step_seconds = time.perf_counter() - start

    def _slot(self, seq: Sequence, position: int) -> int:
        bs = self.cfg.block_size
        return seq.block_table[position // bs] * bs + position % bs

    def _prepare(self, batch):
        bs = self.cfg.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for seq in batch.decodes:
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(self._slot(seq, p))
        prefills = []
        sample_index = list(range(len(batch.decodes)))
        for seq in batch.prefills:
            first, start = len(ids), seq.num_computed_tokens
            new = seq.token_ids[start:]
            ids.extend(new)
            pos.extend(range(start, seq.num_tokens))
            table = np.asarray(seq.block_table, dtype=np.int64)
            p = np.arange(start, seq.num_tokens)
            slots.extend((table[p // bs] * bs + p % bs).tolist())
            prefills.append((first, len(new), torch.as_tensor(table, device=self.device), start))
            sample_index.append(first + len(new) - 1)
        dev = self.device
        plan = None
        if batch.decodes:
            plan = self._plan(batch.decodes, [s.num_computed_tokens + 1 for s in batch.decodes])
        meta = BatchMetadata(torch.as_tensor(slots, dtype=torch.int64, device=dev), len(batch.decodes), plan, prefills)
        return (meta, torch.as_tensor(ids, dtype=torch.int64, device=dev),
                torch.as_tensor(pos, dtype=torch.int64, device=dev), torch.as_tensor(sample_index, device=dev))

    def _plan(self, seqs: list[Sequence], lens: list[int]) -> DecodePlan:
        """The decode plan for ``seqs`` with ``lens`` tokens of context each, from the block tables they hold."""
        width = max(len(s.block_table) for s in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        return plan_decode(torch.as_tensor(tables, device=self.device),
                           torch.as_tensor(lens, dtype=torch.int64, device=self.device), self.cfg.block_size)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            if seq.temperature > 0:
                probs = torch.softmax(logits[i] / seq.temperature, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
        return tokens

    def _postprocess(self, seqs: list[Sequence], tokens: list[int]) -> None:
        bs = self.cfg.block_size
        pool = self.pool
        for seq, token in zip(seqs, tokens):
            old = seq.num_computed_tokens
            new = seq.num_tokens  # every token now has K/V in the pool
            seq.num_computed_tokens = new
            for index in range(old // bs, -(-new // bs)):
                pool.num_filled[seq.block_table[index]] = min(bs, new - index * bs)
            if pool.enable_prefix_caching and new // bs > old // bs:
                hashes = seq.full_block_hashes(bs)
                for index in range(old // bs, new // bs):
                    pool.cache_full_block(seq.block_table[index], hashes[index],
                                          seq.token_ids[index * bs:(index + 1) * bs], index * bs)
            seq.append_token(token)
            if (token in self._eos and not seq.ignore_eos) or seq.num_output_tokens >= seq.max_new_tokens:
                self.scheduler.finish(seq, Status.FINISHED)

    # ---- views ------------------------------------------------------------------------------------------------
    def _info(self, seq: Sequence) -> ConversationInfo:
        cached = self._info_cache.get(seq.seq_id)
        if cached is not None and cached[0] == seq.version:
            return cached[1]
        out = seq.output_token_ids
        info = ConversationInfo(
            conversation_id=seq.seq_id, status=seq.status, prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt_tokens]),
            output_token_ids=tuple(out), output_text=self.tokenizer.decode(out, final=seq.is_finished),
            prompt_text=self.tokenizer.decode(seq.token_ids[: seq.num_prompt_tokens]),
            block_table=tuple(seq.block_table), num_computed_tokens=seq.num_computed_tokens,
            num_cached_tokens=seq.num_cached_tokens, max_new_tokens=seq.max_new_tokens, temperature=seq.temperature,
            parent_id=seq.parent_id, num_preemptions=seq.num_preemptions, arrival_step=seq.arrival_step)
        self._info_cache[seq.seq_id] = (seq.version, info)
        return info

    def metrics(self) -> EngineMetrics:
        s = self.scheduler
        return EngineMetrics(
            num_steps=self._num_steps, num_generated_tokens=self._num_generated, num_prefill_tokens=self._num_prefill,
            num_preemptions=s.num_preemptions, num_cow_copies=s.num_cow_copies, prefix_cache_queries=s.prefix_queries,
            prefix_cache_hits=s.prefix_hits, last_step_seconds=self._last_step_seconds,
            last_step_tokens=self._last_step_tokens, last_step_prefill_tokens=self._last_step_prefill)

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
            num_cached_blocks=pool.num_cached_blocks, num_free_blocks=self.cfg.num_blocks - num_used - pool.num_cached_blocks,
            num_filled_slots=filled, num_allocated_slots=num_used * bs, num_tail_empty_slots=num_used * bs - filled,
            num_logical_slots=logical, num_slots_saved_by_sharing=logical - filled,
            num_contiguous_slots=sum(s.num_prompt_tokens + s.max_new_tokens for s in running),
            block_table_bytes=4 * entries)

    def snapshot(self) -> PoolSnapshot:
        """An immutable copy of the pool and the conversations, cheap enough to take after every step."""
        pool = self.pool
        tables = MappingProxyType({s.seq_id: tuple(s.block_table) for s in self.scheduler.running})
        return PoolSnapshot(
            step_id=self.step_id, block_size=self.cfg.block_size, num_blocks=self.cfg.num_blocks,
            ref_count=frozen_array(pool.ref_count), num_filled=frozen_array(pool.num_filled),
            state=frozen_array(pool.state), owner=frozen_array(pool.owner), last_access=frozen_array(pool.last_access),
            block_tables=tables, conversations=self.conversations(), metrics=self.metrics(),
            memory=self.memory_stats(), model_name=self.model_name, device=str(self.device),
            max_model_len=self.max_model_len)

    def _owners(self, block: int) -> list[tuple[int, int]]:
        return [(s.seq_id, i) for s in self.scheduler.running for i, b in enumerate(s.block_table) if b == block]

    def inspect_block(self, block_id: int) -> BlockInfo:
        """Tokens, positions, owners, hash and K/V of one physical block."""
        if isinstance(block_id, bool) or not isinstance(block_id, (int, np.integer)) or not 0 <= block_id < self.cfg.num_blocks:
            raise EngineError(f"no block {block_id!r}: block ids run from 0 to {self.cfg.num_blocks - 1}")
        pool, bs, b = self.pool, self.cfg.block_size, int(block_id)
        state = BlockState(int(pool.state[b]))
        filled = int(pool.num_filled[b])
        owners = self._owners(b)
        if owners:
            seq, index = self.seqs[owners[0][0]], owners[0][1]
            positions = tuple(range(index * bs, index * bs + filled))
            tokens = tuple(seq.token_ids[p] for p in positions)
        elif pool.block_tokens[b] is not None:
            tokens = pool.block_tokens[b]
            positions = tuple(range(pool.block_start[b], pool.block_start[b] + len(tokens)))
        else:
            tokens, positions = (), ()
        h = pool.block_hash[b]
        if state == BlockState.FREE:
            note = "free: holds no reusable KV"
        elif h is not None:
            note = ("full block, hashed with its prefix; a new prompt with the same prefix reuses it"
                    + (" (cached: free, evicted least-recently-used first)" if state == BlockState.CACHED else ""))
        elif filled < bs:
            note = f"partially filled ({filled}/{bs}): only full blocks are hashed and shared through the prefix cache"
        elif not pool.enable_prefix_caching:
            note = "full, but prefix caching is off"
        else:
            note = "full, but the same prefix is already cached in another block"
        keys, values = self.kv.read_block(b, filled)
        keys.setflags(write=False)
        values.setflags(write=False)
        return BlockInfo(
            block_id=b, state=state, ref_count=int(pool.ref_count[b]), num_filled=filled, block_size=bs,
            token_ids=tuple(tokens), token_texts=tuple(self.token_text(t) for t in tokens), positions=positions,
            owners=tuple(owners), block_hash=h, hash_note=note, last_owner=int(pool.owner[b]), keys=keys, values=values)

    # ---- relocation -------------------------------------------------------------------------------------------
    def relocate_blocks(self, seed: int | None = None, compact: bool = False) -> dict[int, int]:
        """Move every used and cached block to another physical id (or, with ``compact``, pack them at the low ids
        in logical order), moving the K/V data and fixing block tables and the prefix-cache map."""
        pool, n = self.pool, self.cfg.num_blocks
        if compact:
            order: list[int] = []
            seen = np.zeros(n, bool)
            for s in self.scheduler.running:
                for b in s.block_table:
                    if not seen[b]:
                        seen[b] = True
                        order.append(b)
            order += [b for b in np.flatnonzero(pool.state == BlockState.CACHED) if not seen[b]]
            seen[order] = True
            order += np.flatnonzero(~seen).tolist()
            new_id = np.empty(n, np.int64)
            new_id[np.asarray(order, dtype=np.int64)] = np.arange(n)
        else:
            new_id = random_cycle(n, seed)
        moved = np.flatnonzero(pool.state != BlockState.FREE)
        mapping = {int(b): int(new_id[b]) for b in moved if new_id[b] != b}
        pool.permute(new_id)
        self.kv.permute(new_id)
        for s in self.seqs.values():
            if s.block_table:
                s.block_table = [int(new_id[b]) for b in s.block_table]
                s.version += 1
        return mapping

    def probe_attention(self) -> dict[int, np.ndarray]:
        """Attention output of each running conversation's last computed token, every layer: [layers, heads, dim].

        Reads K/V through the block tables and writes nothing, so it can be taken before and after a relocation."""
        seqs = [s for s in self.scheduler.running if s.num_computed_tokens > 0]
        if not seqs:
            return {}
        dev = self.device
        meta = BatchMetadata(None, len(seqs), self._plan(seqs, [s.num_computed_tokens for s in seqs]), [])
        ids = torch.as_tensor([s.token_ids[s.num_computed_tokens - 1] for s in seqs], device=dev)
        pos = torch.as_tensor([s.num_computed_tokens - 1 for s in seqs], device=dev)
        outs: list[torch.Tensor] = []
        with torch.inference_mode():
            self.model(ids, pos, meta, self.kv.layers, attend_batch, layer_hook=lambda i, out: outs.append(out.float()))
        stacked = torch.stack(outs).cpu().numpy()  # [layers, seqs, heads, dim]
        return {s.seq_id: stacked[:, i] for i, s in enumerate(seqs)}

    def relocate_and_verify(self, seed: int | None = None, compact: bool = False,
                            lookahead: int = 4) -> RelocationReport:
        """Relocate, and prove it: attention of every running conversation before and after the move, and the
        tokens of the next ``lookahead`` steps decoded from the old layout and from the new one (then rolled back,
        so the conversations carry on exactly once)."""
        before = self.probe_attention()
        expected = self._dry_run(lookahead)
        mapping = self.relocate_blocks(seed=seed, compact=compact)
        after = self.probe_attention()
        got = self._dry_run(lookahead)
        diff = max((float(np.abs(before[k] - after[k]).max()) for k in before), default=0.0)
        return RelocationReport(mapping, len(mapping), diff, len(before), lookahead, expected == got,
                                sum(len(t) for t in expected.values()))

    def _dry_run(self, steps: int) -> dict[int, list[int]]:
        """Tokens each conversation would get in the next ``steps`` steps; afterwards the engine is as it was."""
        if steps <= 0 or not self.has_work():
            return {}
        generators = [s.generator for s in self.seqs.values()]
        states = [g.get_state() for g in generators]
        memo = {id(g): g for g in generators}  # samplers are rewound below, not copied
        names = ("pool", "scheduler", "seqs", "_next_id", "step_id", "_num_steps", "_num_generated", "_num_prefill",
                 "_last_step_seconds", "_last_step_tokens", "_last_step_prefill")
        saved = copy.deepcopy({n: getattr(self, n) for n in names}, memo)
        kv = self.kv.data.clone()
        lengths = {i: s.num_tokens for i, s in self.seqs.items()}
        try:
            for _ in range(steps):
                self.step()
            return {i: s.token_ids[lengths[i]:] for i, s in self.seqs.items() if s.num_tokens > lengths[i]}
        finally:
            for name, value in saved.items():
                setattr(self, name, value)
            self.kv.data.copy_(kv)
            for g, state in zip(generators, states):
                g.set_state(state)
            self._info_cache.clear()
