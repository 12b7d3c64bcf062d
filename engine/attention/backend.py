"""The one object an engine attends through: :class:`Attention`, a named order of decode backends.

An engine chooses its object once, from its config (:func:`choose`), and hands it to its model runner; the model
asks that object whether a decode batch goes to the native kernel (:meth:`Attention.decodes_natively`, which lets it
run every layer in one native call), instead of comparing functions. Each backend lives in a module of its own:
``native`` (the C kernel, CPU default), ``compiled`` (the torch.compile'd fused kernel, and the default path's
per-shape use of it), ``eager`` (gather and SDPA: every device, and the fallback of the others) and ``reference``
(contiguous float64, for tests).
"""
from __future__ import annotations

import math

import torch

from . import compiled, eager, native, reference
from .plan import DecodePlan, _check, bytes_per_token, check_window, group_bytes_for, plan_decode

_ORDERS = {
    "default": ("native", "auto", "eager"),  # the native kernel; else the fused kernel where measured faster; eager
    "compiled": ("compiled", "eager"),  # the fused kernel for every shape (EngineConfig.compile_attention)
    "eager": ("eager",),
    "reference": ("reference",),
}


class Attention:
    """Attention for the engine's mixed batches (decodes first, then prefill chunks), all read through block tables.

    ``name`` picks the decode paths tried in order, the first that answers wins (each gives the same attention, to
    rounding); prefill chunks always take the eager path's causal SDPA. Called as the model calls attention:
    ``attention(q, key_cache, value_cache, meta, scale, block_size)``."""

    def __init__(self, name: str):
        if name not in _ORDERS:
            raise ValueError(f"no attention backend {name!r}: one of {', '.join(_ORDERS)}")
        self.name = name
        self.order = _ORDERS[name]

    def __repr__(self) -> str:
        return f"Attention({self.name!r})"

    def decodes_natively(self) -> bool:
        """Whether a decode-only batch goes to the native kernel (:func:`engine.native.decode`) as things are set now
        (engine.model.causal_lm's one-call decode step, which takes that kernel itself, is used only then)."""
        return self.order[0] == "native" and native.available()

    def decode(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
               scale: float) -> torch.Tensor:
        """Decode attention with the tables already planned (the engine plans once per step, not per layer)."""
        window = plan.window if plan.window is not None and plan.max_len > plan.window else None
        for path in self.order:
            if path == "native":
                out = native.decode(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale, window)
            elif path == "auto":  # (the background-compiled kernels are for unwindowed shapes)
                out = None if window is not None else compiled._auto.kernel(query, key_cache, value_cache, plan,
                                                                              scale)
            elif path == "compiled":
                out = compiled._try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale,
                                             window)
            elif path == "reference":
                out = reference.decode(query, key_cache, value_cache, plan, scale)
            else:
                out = eager._paged_attention_eager(query, key_cache, value_cache, plan, scale)
            if out is not None:
                return out
        return eager._paged_attention_eager(query, key_cache, value_cache, plan, scale)

    def __call__(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta, scale: float,
                 block_size: int) -> torch.Tensor:
        if not meta.prefills:  # decode only: no assembly needed
            return self.decode(q, key_cache, value_cache, meta.decode_plan, scale)
        out = torch.empty_like(q)  # [tokens, heads, dim]
        if meta.num_decode:
            out[: meta.num_decode] = self.decode(q[: meta.num_decode], key_cache, value_cache, meta.decode_plan,
                                                 scale)
        window = getattr(meta, "sliding_window", None)
        for first, count, tables, start in _prefill_runs(meta.prefills, window):
            if len(tables) > 1:  # several fresh prompts of one length, side by side: one batched call
                end = first + len(tables) * count
                out[first:end] = eager.fresh_prefill_attention(q[first:end], key_cache, value_cache, tables, count,
                                                               scale)
            else:
                out[first:first + count] = eager.paged_prefill_attention(q[first:first + count], key_cache,
                                                                         value_cache, tables[0], start, scale, window)
        return out


def _prefill_runs(prefills, window: int | None):
    """The step's prefill chunks as (first, count, tables, start) runs: consecutive chunks that start at position 0
    with the same length, next to each other in the batch and within the window (so plain causal attention is
    theirs), make one run; every other chunk is a run of its own."""
    runs: list[tuple[int, int, list, int]] = []
    joinable = False  # whether the last run is of fresh chunks
    for first, count, table, start in prefills:
        fresh = start == 0 and (window is None or count <= window)
        if fresh and joinable:
            last_first, last_count, tables, _ = runs[-1]
            if count == last_count and first == last_first + len(tables) * count:
                tables.append(table)
                continue
        runs.append((first, count, [table], start))
        joinable = fresh
    return runs


DEFAULT = Attention("default")
COMPILED = Attention("compiled")
EAGER = Attention("eager")
REFERENCE = Attention("reference")
BACKENDS = {a.name: a for a in (DEFAULT, COMPILED, EAGER, REFERENCE)}


def choose(compile_attention: bool = False) -> Attention:
    """The attention an engine uses, from its config: the fused kernel for every shape when ``compile_attention``,
    else the default order."""
    return COMPILED if compile_attention else DEFAULT


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float | None = None,
                    sliding_window: int | None = None) -> torch.Tensor:
    """Single-token attention for a batch of sequences whose K/V sit in paged caches.

    query [seqs, heads, dim]; caches [num_blocks, block_size, kv_heads, dim]; block_tables int [seqs, max_blocks];
    seq_lens int [seqs] (context length, including the query's own position) -> [seqs, heads, dim].
    Query head h reads K/V head h // (heads // kv_heads). Default scale 1/sqrt(dim). Table entries past a
    sequence's last block are ignored (-1 and stale ids alike). Slots past a sequence's length must hold finite
    values (the engine's cache is zero-initialised); they get zero weight.

    ``sliding_window``: the query at position p = seq_len - 1 reads only the keys at positions > p - window (as
    transformers' and vLLM's sliding-window layers do); the table entries of blocks wholly before that are absent
    (-1 where a window released them) and never read.

    Checked first (bad input raises EngineError); then the process-wide switches pick the path, as for the default
    backend: the fused kernel if :func:`use_compiled_attention` is on, the native kernel, the fused kernel for a
    long shape measured faster, the eager path.
    """
    window = check_window(sliding_window)
    max_len = _check(query, key_cache, value_cache, block_tables, seq_lens, window)
    if not query.shape[0]:
        return query.new_empty(query.shape)  # no sequences: nothing to attend
    if window is not None and max_len <= window:
        window = None  # every key is inside every window: plain attention (no entry is absent)
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else float(scale)
    fused = compiled._compiled
    if fused.enabled:
        out = compiled._try_compiled(query, key_cache, value_cache, block_tables.to(query.device),
                                     seq_lens.to(query.device), scale, window)
        if out is not None:
            return out
    out = native.decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window)
    if out is not None:
        return out
    if window is not None:
        plan = plan_decode(block_tables.to(query.device), seq_lens, key_cache.shape[1], group_bytes_for(key_cache),
                           bytes_per_token(key_cache), window)
        return eager._paged_attention_eager(query, key_cache, value_cache, plan, scale)
    auto = compiled._auto
    if auto.enabled and not fused.failed and max_len >= compiled.AUTO_MIN_POSITIONS:
        key = auto.key(query, key_cache, query.shape[0], max_len, scale)  # a shape on the fused kernel: no plan
        if auto.choice(key) is True:
            width = -(-max_len // key_cache.shape[1])
            out = compiled._try_compiled(query, key_cache, value_cache, block_tables[:, :width].to(query.device),
                                         seq_lens.to(query.device), scale)
            if out is not None:
                return out
    plan = plan_decode(block_tables.to(query.device), seq_lens, key_cache.shape[1], group_bytes_for(key_cache),
                       bytes_per_token(key_cache))
    out = auto.kernel(query, key_cache, value_cache, plan, scale)
    return out if out is not None else eager._paged_attention_eager(query, key_cache, value_cache, plan, scale)


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
                 scale: float, compiled: bool = False) -> torch.Tensor:
    """:meth:`Attention.decode` of the compiled backend (``compiled``) or the default one."""
    return (COMPILED if compiled else DEFAULT).decode(query, key_cache, value_cache, plan, scale)


def decodes_natively(attend) -> bool:
    """Whether ``attend`` (an :class:`Attention`) gives decode-only batches to the native kernel now."""
    return isinstance(attend, Attention) and attend.decodes_natively()
