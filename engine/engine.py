"""The serving engine: conversations in, tokens out, K/V kept in a paged block pool.

One :meth:`Engine.step` = schedule (admit, preempt, copy-on-write, under a token budget) -> run the model on a
mixed batch of decodes and prefill chunks -> postprocess (commit filled slots, sample, finish). It is synchronous,
deterministic for a seed, and atomic: every public operation runs in a transaction, and if it raises, the engine
(bookkeeping, K/V, samplers, events) is exactly as it was. :class:`engine.runner.EngineRunner` runs it on a thread.

Its parts, one concept each: :class:`KVCacheManager` (the only writer of the pool, every change a block event),
:class:`Scheduler` (who computes what), :class:`ModelRunner` (tensors, forward, sampling), :class:`PoolViews`
(snapshots and inspection), :mod:`engine.kv.relocation` (moving blocks, and proving attention did not change).
"""
from __future__ import annotations

import functools
import gc
import inspect
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from functools import partial
from typing import Callable, Sequence as Seq

import numpy as np
import torch

from kvstream.events import BlockEvent, EventKind
from kvstream.views import (BlockInfo, ChangeRecord, ConversationInfo, EngineMetrics, FinishReason, MemoryStats,
                            PoolSnapshot, Status)

from . import attention
from .kv import relocation
from .kv.policies import Future, make_policy
from .kv.pool import BlockPool
from .config import EngineConfig
from .errors import EngineError
from .kv import fp8
from .kv.cache import KVCache
from .kv.manager import KVCacheManager
from .kv.groups import kv_cache_group_infos, kv_cache_layout
from .model.loader import check_pool_fits_memory, load_model, read_model_config
from .model.runner import ModelRunner
from .pool_views import PoolViews, StepCounts
from .kv.relocation import RelocationReport
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .validation import (MAX_SEED, check_bool, check_int, check_max_new_tokens, check_seed, check_temperature,
                         check_text, check_token_ids, is_int)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SEED_MODULUS = 2**63  # per-conversation seeds derived from the engine seed stay below it (engine.model.sampling mixes 64 bits)

__all__ = ["Engine", "RelocationReport"]


def _prepare_heap() -> None:
    """Before each engine is made: the first time in a process, freeze the heap; every later time, collect the
    cycles of engines dropped since.

    The freeze, once, before the first engine exists: every object alive then (the imported libraries' hundreds of
    thousands: modules, functions, classes) moves out of the cyclic garbage collector's sight, as vLLM's engine core
    does at its start (``gc.freeze``). Without it, a full collection every so often walked them all while a step
    waited (figures: docs/engine.md, "Figures behind the engine's choices"). Frozen objects are still freed when
    their last reference goes; only cycles among them would stay, so it runs before the engine exists (an engine is
    full of cycles, and one frozen would never be collected), and only once: later engines are made while an earlier
    one may still be alive (the window's restart). A caller's own cycles alive at that moment would never be
    collected either: ``PAGED_KV_FREEZE_HEAP=0`` turns it off. (A recording opened in the window freezes the heap
    again and gives everything back when closed, explorer/feeds/stream_feed.py; after that the heap stays
    unfrozen.)

    The collection, before every later engine: an engine dropped earlier (the window's restart, a benchmark's next
    round) may still hold its weights and KV cache, because its cycles (closures over itself, rollback partials) go
    only when the collector reaches its oldest generation, which counts objects, not bytes: a benchmark making one
    engine after another held every earlier one until the OOM killer stopped it (docs/performance.md, "Resident
    memory of a long run"). A full collection takes tens of milliseconds; making an engine takes seconds. It runs on
    the thread that makes the engine (the window's loader thread), so a dropped engine's finalizers (its tiers'
    close) run there. It frees what it can: not an engine a recording's heap freeze holds, and nothing when another
    thread is collecting at that moment."""
    global _engines_made
    with _heap_lock:  # engines made on two threads at once: one freeze, before either exists
        first = _engines_made == 0
        _engines_made += 1
        if first:
            if os.environ.get("PAGED_KV_FREEZE_HEAP", "1") != "0":
                gc.collect()
                gc.freeze()
            return
    gc.collect()


_engines_made = 0  # engines made in this process so far
_heap_lock = threading.Lock()


class Engine:
    """Owns the model, the physical KV cache, the block pool and the conversations."""

    def __new__(cls, *args, **kwargs):
        _prepare_heap()
        return super().__new__(cls)

    def __init__(self, cfg: EngineConfig, progress: Callable[[str, float], None] | None = None,
                 future: Future | None = None):
        """``future``: what a trace replay knows of the requests to come, for an eviction policy that needs it
        ("belady"); no other caller has one."""
        if not isinstance(cfg, EngineConfig):
            raise EngineError("Engine needs an EngineConfig")
        try:
            policy = make_policy(cfg.eviction_policy, future)
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self.cfg = cfg
        if cfg.device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif cfg.device == "cuda" and not torch.cuda.is_available():
            raise EngineError("device 'cuda' was asked for but torch sees no CUDA device")
        else:
            device = cfg.device
        self.device = torch.device(device)
        self.dtype = _DTYPES[cfg.dtype]
        mc = read_model_config(cfg.model)
        self.kv_dtype = fp8.storage_dtype(cfg.kv_cache_dtype, self.dtype)  # what the pool stores K/V in
        check_pool_fits_memory(mc, cfg.num_blocks, cfg.block_size, self.kv_dtype, self.device)
        loaded = load_model(cfg.model, self.dtype, self.device, cfg.seed, progress)
        self.model = loaded.model
        self.model_config = mc = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = loaded.eos_token_ids
        self.model_files = loaded.files
        self._eos = set(self.eos_token_ids)
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, policy)
        self.kv_cache_groups = kv_cache_group_infos(mc)
        planes, layer_slots = kv_cache_layout(self.kv_cache_groups, mc.num_hidden_layers)
        try:
            self.kv = KVCache(planes, cfg.num_blocks, cfg.block_size, mc.num_key_value_heads,
                              mc.head_dim, self.kv_dtype, self.device, layer_slots,
                              self.model.kv_scales() if self.model is not None else None)
        except (RuntimeError, MemoryError) as exc:
            raise EngineError(f"cannot allocate the KV cache of {cfg.num_blocks} blocks: {exc}") from None
        self.manager = KVCacheManager(self.pool, self.kv_cache_groups)
        self.tiers = self._make_tiers(cfg, future)
        self.scheduler = Scheduler(self.manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill)
        self.runner = ModelRunner(self.model, self.kv, self.device, cfg.block_size,
                                  attention.choose(cfg.compile_attention))
        self.runner.windows = [g.sliding_window for g in self.kv_cache_groups]
        self.seqs: dict[int, Sequence] = {}  # changed in place only (the views read this dict)
        self.finished: deque[int] = deque()  # ids of finished/ended conversations still shown, newest last (_finish)
        self.views = PoolViews(cfg=cfg, pool=self.pool, manager=self.manager, scheduler=self.scheduler, kv=self.kv,
                               seqs=self.seqs, tokenizer=self.tokenizer, kv_cache_groups=self.kv_cache_groups,
                               finished=self.finished, counts=self._counts, model_name=self.model_name,
                               device=self.device, max_model_len=self.max_model_len)
        self._next_id = 0
        self.step_id = 0
        self.version = 0  # bumped by every change; snapshots carry it
        self.num_steps = self.num_generated = self.num_prefill = 0
        self.last_step_seconds = 0.0
        self.last_step_tokens = self.last_step_prefill = 0
        self._txn: dict | None = None  # the open transaction's checkpoint and what it saved
        self._caller = threading.Lock()  # held by the one thread inside a transaction (see transaction())
        self._caller_thread: int | None = None  # that thread's id
        self._dirty = False  # something changed inside the open transaction
        self._kv_events = None
        if cfg.kv_events_endpoint:
            from .kv.kv_events import KVEventsOut  # only when asked for: binds a socket
            self._kv_events = KVEventsOut(cfg, self.kv_cache_groups)
        self.background_errors: list[str] = []  # failures outside any operation (publishing); the runner reports

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

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + output) one conversation may reach: the positions the model was built for (as
        vLLM's max_model_len)."""
        return self.model_config.max_position_embeddings

    # tokenize, detokenize, token_text and takes_text read only the (immutable) tokenizer: any thread may call them.
    @property
    def takes_text(self) -> bool:
        """Whether prompts may be text (False for a checkpoint without a tokenizer: token ids only)."""
        return getattr(self.tokenizer, "takes_text", True)

    def tokenize(self, text: str, continuation: bool = False) -> list[int]:
        """Token ids of ``text`` as a prompt takes them (a reply, ``continuation``, gets no BOS)."""
        text = check_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=not check_bool(continuation, "continuation")))

    def detokenize(self, token_ids: Seq[int]) -> str:
        return self.tokenizer.decode(check_token_ids(token_ids, self.vocab_size, allow_empty=True))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(int(token_id))

    @property
    def chat_template(self):
        """The model's chat template (engine/model/chat.py), or None for a model that reads plain text (the built-in one)."""
        return getattr(self.tokenizer, "chat_template", None)

    def chat_prompt_ids(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat: ``messages`` is a list of {"role": "system"|"user"|"assistant", "content": text},
        rendered with the model's own chat template (ending with the assistant's header, where the model answers)
        and tokenized; pass them as ``add_conversation(prompt_token_ids=...)``. Turns that start alike (one system
        prompt) give ids that start alike, so their full blocks are shared by prefix caching."""
        if self.chat_template is None:
            raise EngineError("this model has no chat template: give its prompts as plain text")
        text = self.chat_template.render(messages, check_bool(add_generation_prompt, "add_generation_prompt"))
        return check_token_ids(self.tokenizer.encode(text, add_special_tokens=False), self.vocab_size)

    # ---- transactions -----------------------------------------------------------------------------------------
    @contextmanager
    def transaction(self, rollback: bool = False):
        """Everything inside happens whole or not at all: on an exception (or always, with ``rollback``) the pool,
        the K/V a step overwrote, the conversations, the samplers, the counters and the events are put back.
        Nested calls join the outer transaction.

        One caller at a time: a second thread that calls in while a transaction is open gets an EngineError, and
        nothing changes (an Engine is not thread-safe; an EngineRunner gives it one thread, docs/engine.md)."""
        with self._sole_caller(), self._transaction(rollback):
            yield

    @contextmanager
    def _sole_caller(self):
        """Hold the engine for this thread (again, when it holds it already); EngineError if another holds it."""
        me = threading.get_ident()
        if self._caller_thread == me:
            yield
            return
        self._hold(me)
        try:
            yield
        finally:
            self._let_go()

    def _hold(self, me: int) -> None:
        if not self._caller.acquire(blocking=False):
            raise EngineError("this engine is in use by another thread: an Engine takes one caller at a time "
                              "(drive it from one thread, e.g. through an EngineRunner)")
        self._caller_thread = me

    def _let_go(self) -> None:
        self._caller_thread = None
        self._caller.release()

    @contextmanager
    def _transaction(self, rollback: bool):
        if self._txn is not None:
            yield
            return
        txn = self._txn = self._checkpoint()
        try:
            yield
        except BaseException:
            self._restore(txn)
            raise
        else:
            if rollback:
                self._restore(txn)
            elif self._dirty:
                self.version += 1
                self.background_errors.extend(txn["notes"])
                self._publish_kv_events()
        finally:
            self._txn = None
            self._dirty = False
            self.manager.end()

    def changed(self) -> None:
        """Mark that the open transaction changed something (a new version when it commits)."""
        self._dirty = True

    def _counts(self) -> StepCounts:
        """The clock and counters now, as the views read them."""
        return StepCounts(self.step_id, self.version, self.num_steps, self.num_generated, self.num_prefill,
                          self.last_step_seconds, self.last_step_tokens, self.last_step_prefill)

    def _checkpoint(self) -> dict:
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        return {
            "manager": self.manager.begin(), "scheduler": self.scheduler.checkpoint(),
            "seqs": {s.seq_id: s.checkpoint() for s in live},
            "counters": (self._next_id, self.step_id, self.version, self.num_steps, self.num_generated,
                         self.num_prefill, self.last_step_seconds, self.last_step_tokens, self.last_step_prefill),
            "finished": list(self.finished), "kv": [], "stored": dict(self.seqs),
            "notes": [],  # messages for the runner, said only if the transaction commits (see note())
        }

    def _touch(self, seq: Sequence) -> None:
        """Remember ``seq`` as it is, if the open transaction has not already (for conversations not live)."""
        if self._txn is not None and seq.seq_id not in self._txn["seqs"]:
            self._txn["seqs"][seq.seq_id] = seq.checkpoint()

    def _save_kv(self, copies: list[tuple[int, int, int]], prepared) -> None:
        """Save the K/V of every slot this step is about to write (copy-on-write targets, the new tokens' slots),
        so a rollback puts the cache back exactly."""
        bs = self.cfg.block_size
        parts = [torch.arange(dst * bs, dst * bs + n, device=self.device) for _, dst, n in copies if n]
        if prepared is not None:
            parts.extend(self.runner.all_slots(prepared.meta))
        if parts:
            self.on_rollback(partial(self.kv.restore_slots, self.kv.save_slots(torch.cat(parts))))

    def on_rollback(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if the open transaction is rolled back (undos run newest first, before the bookkeeping is
        restored): how K/V changes, which live outside the checkpoint, are taken back."""
        self._txn["kv"].append(undo)

    def _restore(self, txn: dict) -> None:
        for undo in reversed(txn["kv"]):  # newest first: the oldest copy of a slot is what stays
            undo()
        self.seqs.clear()  # in place: the views hold this dict
        self.seqs.update(txn["stored"])
        for seq_id, checkpoint in txn["seqs"].items():  # one created inside the transaction is dropped whole
            if seq_id in self.seqs:  # (add_samples touches its first sample when the others fork it)
                self.seqs[seq_id].restore(checkpoint)
        self.scheduler.restore(txn["scheduler"])
        self.manager.rollback(txn["manager"], self.seqs.values())
        (self._next_id, self.step_id, self.version, self.num_steps, self.num_generated, self.num_prefill,
         self.last_step_seconds, self.last_step_tokens, self.last_step_prefill) = txn["counters"]
        self.finished.clear()
        self.finished.extend(txn["finished"])
        self.views.clear()

    # ---- input checks -----------------------------------------------------------------------------------------
    def _prompt_ids(self, prompt, prompt_token_ids, *, continuation: bool = False) -> list[int]:
        if prompt is not None and prompt_token_ids is not None:
            raise EngineError("give either prompt text or prompt_token_ids, not both")
        if prompt_token_ids is not None:
            return check_token_ids(prompt_token_ids, self.vocab_size)
        if prompt is None:
            raise EngineError("give a prompt (text) or prompt_token_ids")
        ids = self.tokenize(prompt, continuation)
        if not ids:
            raise EngineError("the prompt is empty")
        return check_token_ids(ids, self.vocab_size)

    def _check_fits(self, num_tokens: int, max_new_tokens: int) -> None:
        """Refuse at add what can never run (the manager counts the blocks: every KV cache group's)."""
        cfg = self.cfg
        chunk = cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else num_tokens + max_new_tokens
        problem = self.manager.fit_error(num_tokens, max_new_tokens, chunk, self.max_model_len)
        if problem:
            raise EngineError(problem)

    def _seq(self, conversation_id) -> Sequence:
        seq = self.seqs.get(int(conversation_id)) if is_int(conversation_id) else None
        if seq is None:
            raise EngineError(f"no conversation with id {conversation_id!r}")
        return seq

    def _new_seq(self, token_ids, max_new_tokens, temperature, seed, parent_id=None, ignore_eos=False) -> Sequence:
        seq_id = self._next_id
        self._next_id += 1
        seed = (self.cfg.seed * 1_000_003 + seq_id) % _SEED_MODULUS if seed is None else seed
        seq = Sequence(seq_id, token_ids, max_new_tokens, temperature, seed, self.step_id, parent_id, ignore_eos)
        self.seqs[seq_id] = seq
        return seq

    def _request(self, prompt, prompt_token_ids, max_new_tokens, temperature, seed, ignore_eos):
        ids = self._prompt_ids(prompt, prompt_token_ids)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        temperature = check_temperature(temperature)
        seed = check_seed(seed)
        ignore_eos = check_bool(ignore_eos, "ignore_eos")
        self._check_fits(len(ids), max_new_tokens)
        return ids, max_new_tokens, temperature, seed, ignore_eos

    # ---- conversations ----------------------------------------------------------------------------------------
    def add_conversation(self, prompt: str | None = None, *, prompt_token_ids: Seq[int] | None = None,
                         max_new_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
                         ignore_eos: bool = False) -> int:
        """Queue a new conversation; returns its id. It is admitted as soon as its prompt fits in the pool.
        ``ignore_eos`` keeps it decoding to ``max_new_tokens`` (for benchmarks that need a steady load)."""
        request = self._request(prompt, prompt_token_ids, max_new_tokens, temperature, seed, ignore_eos)
        with self.transaction():
            return self._add(*request).seq_id

    def add_prefill(self, prompt_token_ids: Seq[int]) -> int:
        """Queue a prompt whose K/V is computed and cached but which generates nothing (a trace's request in an
        instant replay, or warming the prefix cache); returns its id. With nothing to sample, a prompt the pool
        holds whole is all hits: none of its tokens is recomputed (a generating request always recomputes its last
        token, for the logits of its first output). It finishes as soon as its prompt is in the pool."""
        ids = self._prompt_ids(None, prompt_token_ids)
        self._check_fits(len(ids), 0)
        with self.transaction():
            seq = self._add(ids, 0, 0.0, None, False, prefill_only=True)
            return seq.seq_id

    def _add(self, ids, max_new_tokens, temperature, seed, ignore_eos, reason: str = "",
             prefill_only: bool = False) -> Sequence:
        seq = self._new_seq(ids, max_new_tokens, temperature, seed, ignore_eos=ignore_eos)
        seq.prefill_only = prefill_only
        self.scheduler.add(seq)
        self.manager.emit(EventKind.CONVERSATION_ADDED, seq.seq_id, reason=reason)
        self.changed()
        return seq

    def add_samples(self, prompt: str | None = None, *, prompt_token_ids: Seq[int] | None = None, n: int = 2,
                    max_new_tokens: int = 64, temperature: float = 0.8, seed: int | None = None,
                    ignore_eos: bool = False) -> tuple[int, ...]:
        """``n`` samples of one prompt, added together (as vLLM's ``SamplingParams(n=...)``): the first is a new
        conversation, the others fork it at once, so all share its blocks until they diverge. Atomic: either all
        ``n`` are queued or none. Returns their ids."""
        n = check_int(n, "n", 1, 256)
        request = self._request(prompt, prompt_token_ids, max_new_tokens, temperature, seed, ignore_eos)
        base = request[3]
        with self.transaction():
            first = self._add(*request)
            ids = [first.seq_id]
            for i in range(1, n):
                sample_seed = None if base is None else (base + i) % (MAX_SEED + 1)
                ids.append(self._fork(first, sample_seed, reason="sample").seq_id)
            return tuple(ids)

    def fork_conversation(self, conversation_id: int, seed: int | None = None) -> int:
        """A child that shares every block of the parent; the two diverge by copy-on-write. The child joins the
        running set at once if ``max_num_seqs`` allows, else it waits (and gets the parent's full blocks back as
        prefix-cache hits when admitted)."""
        parent = self._seq(conversation_id)
        seed = check_seed(seed)
        if parent.is_finished:
            raise EngineError(f"conversation {conversation_id} is {parent.status}; only a live conversation can be forked")
        with self.transaction():
            return self._fork(parent, seed).seq_id

    def _fork(self, parent: Sequence, seed: int | None, reason: str = "fork") -> Sequence:
        child = self._new_seq(parent.token_ids, parent.max_new_tokens, parent.temperature, seed, parent.seq_id,
                              parent.ignore_eos)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.block_hashes = list(parent.block_hashes)
        child.turns = list(parent.turns)
        self.manager.emit(EventKind.CONVERSATION_ADDED, child.seq_id, other_id=parent.seq_id, reason=reason)
        if parent.status != Status.RUNNING or parent.num_uncomputed_tokens > 1:
            self._touch(parent)
            parent.pending_forks.append(child)  # forked when the parent's prompt is computed (see _postprocess)
        elif self.scheduler.has_room():
            self.manager.fork(parent, child)
            self.scheduler.run_now(child)
        else:
            self.scheduler.add(child)  # past max_num_seqs: waits, and reuses the parent's full blocks when admitted
        self.changed()
        return child

    def _fork_now(self, parent: Sequence, child: Sequence, logits: torch.Tensor) -> None:
        """A pending fork at the end of its parent's prefill: share every block, and sample the child's own first
        token from the same logits (with its own random stream)."""
        self._touch(child)
        child.token_ids = list(parent.token_ids)  # it forks now: everything the parent has (it may have grown)
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.block_hashes = list(parent.block_hashes)
        child.turns = list(parent.turns)
        if not self.scheduler.has_room():
            self.scheduler.add(child)
            return
        self.manager.fork(parent, child)
        self.scheduler.run_now(child)
        self._append(child, 0 if logits is None else self.runner.sample(logits[None], [child])[0])

    def end_conversation(self, conversation_id: int) -> None:
        """Stop a conversation now; its blocks are released at once."""
        seq = self._seq(conversation_id)
        if seq.status == Status.ENDED:
            raise EngineError(f"conversation {conversation_id} has already ended")
        with self.transaction():
            self._touch(seq)
            self._finish(seq, Status.ENDED, FinishReason.ENDED)

    def _finish(self, seq: Sequence, status: Status, reason: FinishReason) -> None:
        for child in seq.pending_forks:  # ended before its prompt was computed: the forks go on their own
            if not child.is_finished:
                self.scheduler.add(child)
        seq.pending_forks = []
        self.scheduler.finish(seq, status, reason)
        kind = EventKind.CONVERSATION_ENDED if status == Status.ENDED else EventKind.CONVERSATION_FINISHED
        self.manager.emit(kind, seq.seq_id, reason=reason.value)
        finished = self.finished
        if seq.seq_id in finished:
            finished.remove(seq.seq_id)
        finished.append(seq.seq_id)
        while len(finished) > self.cfg.finished_window:
            old = finished.popleft()
            self.views.forget(old)
            if self.seqs[old].is_finished:  # forgotten for good: replies to it are no longer possible
                del self.seqs[old]
        self.changed()

    def continue_conversation(self, conversation_id: int, prompt: str | None = None, *,
                              prompt_token_ids: Seq[int] | None = None, max_new_tokens: int | None = None,
                              temperature: float | None = None) -> None:
        """Send a follow-up message to a finished conversation; its whole history becomes the new prompt. For a model
        with a chat template, text ``prompt`` is a user turn: the assistant's turn is closed and the user turn and the
        assistant header are appended in the template's format (``prompt_token_ids`` are used verbatim)."""
        seq = self._seq(conversation_id)
        if seq.status != Status.FINISHED:
            raise EngineError(f"conversation {conversation_id} is {seq.status}; only a finished conversation can get a reply")
        if prompt is not None and prompt_token_ids is None and self.chat_template is not None and prompt:
            # a chat model: the reply is a user turn, and the assistant's header follows it
            ended = bool(seq.token_ids) and seq.token_ids[-1] in self._eos
            prompt = self.chat_template.reply_text(prompt, ended_with_eos=ended)
        ids = self._prompt_ids(prompt, prompt_token_ids, continuation=True)
        max_new_tokens = check_max_new_tokens(seq.max_new_tokens if max_new_tokens is None else max_new_tokens)
        temperature = check_temperature(seq.temperature if temperature is None else temperature)
        self._check_fits(seq.num_tokens + len(ids), max_new_tokens)
        with self.transaction():
            self._touch(seq)
            seq.start_new_turn(ids, max_new_tokens, temperature, self.step_id)
            if seq.seq_id in self.finished:
                self.finished.remove(seq.seq_id)
            self.scheduler.add(seq)
            self.manager.emit(EventKind.CONVERSATION_CONTINUED, seq.seq_id)
            self.changed()

    def conversation(self, conversation_id: int) -> ConversationInfo:
        return self.views.info(self._seq(conversation_id))

    def conversations(self) -> tuple[ConversationInfo, ...]:
        return self.views.conversations()

    # ---- running ----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing is left to do (or ``max_steps`` steps); returns the steps taken."""
        if max_steps is not None:
            max_steps = check_int(max_steps, "max_steps", 0)
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            self.step()
            steps += 1
        return steps

    def generate(self, prompts: Seq[Seq[int]], max_new_tokens: int = 8, ignore_eos: bool = False) -> list[list[int]]:
        """Greedy outputs for a batch of token-id prompts, decoded together. Atomic: a bad prompt anywhere, or a
        failure while decoding, leaves the engine as it was. ``ignore_eos``: every output is ``max_new_tokens``
        long, an end-of-sequence token taken like any other (vLLM's ignore_eos; benchmarks compare that way)."""
        if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
            raise EngineError("generate takes a list of token-id prompts")
        requests = [self._request(None, p, max_new_tokens, 0.0, None, ignore_eos) for p in prompts]
        with self.transaction():
            seqs = [self._add(*r) for r in requests]
            while any(not s.is_finished for s in seqs):
                self.step_unprotected()
            return [list(s.output_token_ids) for s in seqs]

    def step(self) -> None:
        """Schedule, run the model once over every scheduled conversation, sample, update the pool. Atomic."""
        if not self.has_work():
            return
        with self.transaction():
            self.step_unprotected()

    def step_unprotected(self) -> None:
        """One step inside the caller's transaction."""
        start = time.perf_counter()
        self.step_id += 1
        self.manager.start_step(self.step_id)
        batch = self.scheduler.schedule()
        self._write_loads(self.manager.take_loads())
        # a prefill-only prompt the pool holds whole computes nothing: a batch of only such runs no forward
        computes = not batch.empty and any(batch.num_tokens)
        prepared = self.runner.prepare(batch) if computes and self.model is not None else None
        self._save_kv(batch.copies, prepared)
        if batch.copies:
            self.kv.copy_blocks(batch.copies)
        num_sampled = num_prefill = 0
        if prepared is not None:
            logits = self.runner.forward(prepared)
            broken, greedy = self.runner.check(logits)
            if broken:  # sampled from zeros instead (never kept): the rows are ended in _postprocess
                logits = logits.masked_fill(~torch.isfinite(logits).all(-1, keepdim=True), 0.0)
            tokens = self.runner.sample(logits, prepared.sampled, greedy)
            self._postprocess(batch, prepared.sampled, tokens, logits, broken)
            num_sampled, num_prefill = len(tokens), prepared.num_prefill_tokens
        elif not batch.empty:  # --model none (the pool moves as for a model; every sampled token is 0), or nothing
            #                    to compute
            sampled = [s for s, n in zip(batch.seqs, batch.num_tokens)
                       if n and s.num_computed_tokens + n == s.num_tokens and not s.prefill_only]
            self._postprocess(batch, sampled, [0] * len(sampled), None)
            num_sampled = len(sampled)
            num_prefill = sum(n for n in batch.num_tokens if n > 1)
        self.manager.touch_used(self.step_id)
        self.num_steps += 1
        self.num_generated += num_sampled
        self.num_prefill += num_prefill
        self.last_step_tokens, self.last_step_prefill = num_sampled, num_prefill
        self.last_step_seconds = time.perf_counter() - start
        self.changed()

    def _postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                     logits: torch.Tensor, broken: frozenset = frozenset()) -> None:
        for seq, n in zip(batch.seqs, batch.num_tokens):
            self.manager.commit(seq, seq.num_computed_tokens + n)
            seq.version += 1
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            if row in broken:  # no token can be drawn from NaN or infinite logits: this conversation stops here
                self._txn["notes"].append(
                    f"conversation {seq.seq_id} stopped at step {self.step_id}: the model's logits for it were NaN "
                    "or infinite (the weights or its K/V overflowed); the other conversations go on")
                self._finish(seq, Status.FINISHED, FinishReason.NON_FINITE)
                continue
            forks, seq.pending_forks = seq.pending_forks, []
            for child in forks:
                if not child.is_finished:  # a pending fork the user ended meanwhile stays ended
                    self._fork_now(seq, child, None if logits is None else logits[row])
            self._append(seq, token)
        for seq in batch.seqs:  # a prefill-only request is done once its prompt's K/V is in the pool
            if seq.prefill_only and not seq.is_finished and seq.num_computed_tokens == seq.num_tokens:
                self._finish(seq, Status.FINISHED, FinishReason.LENGTH)

    def _append(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        if token in self._eos and not seq.ignore_eos:
            self._finish(seq, Status.FINISHED, FinishReason.EOS)
        elif seq.num_output_tokens >= seq.max_new_tokens:
            self._finish(seq, Status.FINISHED, FinishReason.LENGTH)
        elif seq.num_tokens >= self.max_model_len:
            self._finish(seq, Status.FINISHED, FinishReason.CONTEXT)

    # ---- pool-wide operations ---------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> int:
        """Forget every prefix hash: cached blocks become free (``AllBlocksCleared`` on the KV-event stream). As
        vLLM's ``reset_prefix_cache``, only while no conversation holds blocks. Returns the blocks dropped."""
        if self.scheduler.running:
            raise EngineError(f"the prefix cache can be reset only when no conversation holds blocks; "
                              f"{len(self.scheduler.running)} are running (pause and end them, or wait)")
        with self.transaction():
            dropped = self.manager.reset_prefix_cache()
            self.changed()
            return dropped

    def relocate_blocks(self, seed: int | None = None, compact: bool = False) -> dict[int, int]:
        """Move every used and cached block to another physical id (or, with ``compact``, pack them at the low ids
        in logical order), moving their K/V and fixing block tables and the prefix-cache map. Returns old id ->
        new id for every block that moved."""
        seed = check_seed(seed, "relocation seed")
        compact = check_bool(compact, "compact")
        with self.transaction():
            mapping = relocation.relocate(self.manager, self.kv, self.seqs.values(), self.scheduler.running, seed,
                                          compact, self.on_rollback)
            self.changed()
        return mapping

    def relocate_and_verify(self, seed: int | None = None, compact: bool = False,
                            lookahead: int = 4) -> RelocationReport:
        """Relocate, and prove it: attention of every running conversation before and after the move, and the
        tokens of the next ``lookahead`` steps decoded from the old layout and from the new one (then rolled back,
        so the conversations carry on exactly once)."""
        lookahead = check_int(lookahead, "lookahead", 0, 64)
        seed = check_seed(seed, "relocation seed")
        compact = check_bool(compact, "compact")
        before, expected = self.probe_attention(), self._dry_run(lookahead)
        mapping = self.relocate_blocks(seed, compact)
        return relocation.report(before, self.probe_attention(), expected, self._dry_run(lookahead), mapping,
                                 lookahead)

    def _dry_run(self, steps: int) -> dict[int, list[int]]:
        """Tokens each conversation would get in the next ``steps`` steps; afterwards the engine is as it was (the
        steps run inside a transaction that is always rolled back)."""
        if steps <= 0 or not self.has_work():
            return {}
        lengths = {i: s.num_tokens for i, s in self.seqs.items()}
        with self.transaction(rollback=True):
            for _ in range(steps):
                if not self.has_work():
                    break
                self.step_unprotected()
            return {i: s.token_ids[lengths[i]:] for i, s in self.seqs.items() if s.num_tokens > lengths.get(i, 0)}

    def probe_attention(self) -> dict[int, np.ndarray]:
        """Attention output of each running conversation's last computed token, every layer: [layers, heads, dim]
        ({} without a model: --model none computes no attention)."""
        if self.model is None:
            return {}
        return relocation.probe_attention(self.runner, self.scheduler.running)

    # ---- views ------------------------------------------------------------------------------------------------
    def snapshot(self) -> PoolSnapshot:
        """An immutable copy of the pool and the conversations (the same object while nothing changed)."""
        return self.views.snapshot()

    def change_record(self, snapshot: PoolSnapshot) -> ChangeRecord:
        """What changed between the snapshot built before ``snapshot`` and it (the pool-stream encoder's fast path;
        the runner hands it to observers beside the snapshot); nothing known for any but the latest snapshot."""
        return self.views.changes(snapshot)

    def metrics(self) -> EngineMetrics:
        return self.views.metrics()

    def memory_stats(self) -> MemoryStats:
        return self.views.memory_stats()

    def inspect_block(self, block_id: int) -> BlockInfo:
        """Tokens, positions, owners, hash and K/V of one physical block."""
        return self.views.inspect_block(block_id)

    def take_events(self) -> list[BlockEvent]:
        """Block events since the last call, oldest first (each has .step_id .kind .block_ids)."""
        return self.manager.take_events()

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping disagrees with the conversations' tables."""
        self.manager.check_invariants(self.seqs.values())
        running = set(id(s) for s in self.scheduler.running)
        for seq in self.seqs.values():
            assert bool(seq.block_table) <= (id(seq) in running), f"conversation {seq.seq_id} holds blocks but is not running"

    # ---- KV events out ----------------------------------------------------------------------------------------
    def _publish_kv_events(self) -> None:
        """vLLM-format KV events of the committed changes (never raises: a failure is kept for the runner)."""
        if self._kv_events is None:
            return
        try:
            self._kv_events.publish(self.manager.events_since_publish())
        except Exception as exc:  # the operation already happened; publishing must not undo or fail it
            self.background_errors.append(f"publishing KV events failed: {type(exc).__name__}: {exc}")

    def take_background_errors(self) -> list[str]:
        errors, self.background_errors = self.background_errors, []
        return errors

    def close(self) -> None:
        """Release sockets (KV-event publishing); the engine stays usable otherwise. The disk tier's file is synced
        and closed (the tiers are off from then on)."""
        if self._kv_events is not None:
            self._kv_events.close()
            self._kv_events = None
        self._close_tiers()

    # ---- lower tiers (engine.kv.tiers) ---------------------------------------------------------------------------
    def _make_tiers(self, cfg: EngineConfig, future=None):
        """The host and disk tiers the config asks for (None when both are off), wired into the manager."""
        if not (cfg.host_tier_blocks or cfg.disk_tier_blocks):
            return None
        # A grouped pool (engine.kv.groups) offloads and loads each group's blocks under its group's cache key:
        # a block id is one slot in every layer plane, so a block of any group has the same bytes per block.
        from .model.loader import available_memory
        from .kv.tiers import TierStore
        per_block = self.kv.bytes_per_block
        need = cfg.host_tier_blocks * per_block
        have = available_memory(torch.device("cpu"))
        if have is not None and need > 0.9 * have:
            raise EngineError(f"a host tier of {cfg.host_tier_blocks:,} blocks needs {need / 2**30:.1f} GiB "
                              f"({per_block / 2**10:.0f} KiB per block) but only {have / 2**30:.1f} GiB of memory is "
                              f"available; use at most {int(0.9 * have // per_block):,} blocks")
        # blocks one admission may load: a prefix's blocks in every KV cache group
        staging = min(cfg.num_blocks, -(-self.max_model_len // cfg.block_size) * len(self.kv_cache_groups))
        tiers = TierStore(cfg.host_tier_blocks, cfg.disk_tier_blocks, cfg.disk_tier_path, per_block, staging,
                          partial(make_policy, cfg.eviction_policy, future), protected=self.model_files)
        self.manager.attach_tiers(tiers, self.kv.read_blocks_bytes)
        import weakref
        self._tiers_finalizer = weakref.finalize(self, tiers.close)  # the file descriptor goes with the engine
        return tiers

    def _write_loads(self, loads: list) -> None:
        """Blocks admitted from a lower tier (engine.kv.tiers.TierLoad): their bytes into the device pool, one scatter
        per admission. What they held is saved for a rollback first; for blocks the admission evicted, that is
        the copy their offload already read (nothing wrote them since), so only the others are read again."""
        for load in loads:
            if len(load.kept_blocks):
                self.on_rollback(partial(self.kv.restore_slots, self.kv.saved_from_bytes(load.kept_blocks, load.kept)))
            kept = set(load.kept_blocks)
            rest = [b for b in load.blocks if b not in kept]
            if rest:
                self.on_rollback(partial(self.kv.restore_slots, self.kv.save_blocks(rest)))
            self.kv.write_blocks_bytes(load.blocks, load.data)

    def prompt_token_sources(self, conversation_id: int) -> dict[str, int]:
        """Its last admission's prompt tokens by where their K/V came from: {"device", "host", "disk", "computed"}
        ({} before its first admission)."""
        return dict(self.manager.prompt_sources.get(self._seq(conversation_id).seq_id, {}))

    def is_finished(self, conversation_id: int) -> bool:
        """Whether it finished or was ended (cheaper than building its whole ConversationInfo)."""
        return self._seq(conversation_id).is_finished

    def check_prompt(self, prompt: str | None = None, *, prompt_token_ids: Seq[int] | None = None):
        """Would this prompt hit? Which of its blocks the pool (and its tiers) hold now, where, and why the others
        would miss (never stored; stored, then evicted at step T by a policy, for a conversation; shorter than a
        block), counted as its admission would count them: a :class:`kvstream.prompt_check.PromptCheck`, whose
        ``cached_tokens`` is the ``num_cached_tokens`` the prompt would get if added now. Changes nothing."""
        ids = self._prompt_ids(prompt, prompt_token_ids)
        return self.manager.check_prompt(Sequence(-1, ids, 1, 0.0, 0, self.step_id), self.step_id)

    def prompt_block_outcomes(self, conversation_id: int) -> tuple:
        """How each block of its prompt fared at its last admission (kvstream.views.BlockOutcome: a hit and where
        from, or a miss and why); () before its first admission."""
        return tuple(self.manager.prompt_outcomes.get(self._seq(conversation_id).seq_id, ()))

    def _close_tiers(self) -> None:
        if self.tiers is not None:
            self.manager.tiers = None
            self.tiers = None
            self._tiers_finalizer()  # closes them once and lets go of them (the host tier's memory goes now)

    @property
    def kv_events_endpoints(self) -> tuple[str, str | None] | None:
        """(endpoint, replay endpoint) as bound, when this engine publishes KV events."""
        return None if self._kv_events is None else (self._kv_events.endpoint, self._kv_events.replay_endpoint)


# One caller rule, for every public method: a second thread gets EngineError while one is inside the engine (a
# query reads what a step is changing, take_events would steal the runner's events, close() would pull the tiers out
# from under a step). Only these read nothing that changes (the tokenizer is immutable), so any thread may call them;
# transaction() holds the engine itself.
ANY_THREAD = frozenset({"tokenize", "detokenize", "token_text", "chat_prompt_ids", "transaction"})


def _one_caller(method):
    @functools.wraps(method)
    def held(self, *args, **kwargs):
        me = threading.get_ident()
        if self._caller_thread == me:  # already inside (a nested call)
            return method(self, *args, **kwargs)
        self._hold(me)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._let_go()
    return held


for _name, _member in list(vars(Engine).items()):
    if not _name.startswith("_") and _name not in ANY_THREAD and inspect.isfunction(_member):
        setattr(Engine, _name, _one_caller(_member))
