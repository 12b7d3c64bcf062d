"""Paged attention: queries read K/V from a pool of fixed-size blocks through per-sequence block tables.

The caches are ``[num_blocks, block_size, kv_heads, head_dim]``. Logical block ``i`` of sequence ``s`` lives in
physical block ``block_tables[s, i]``; where that is in memory does not matter to the result, only which slots
hold which position. :func:`dense_attention` is the contiguous reference the tests compare against.

One module per backend (``native``, ``compiled``, ``eager``, ``reference``), the plan they share (``plan``), and
the one object an engine chooses once and attends through (``backend``: :class:`Attention`, :func:`choose`).
"""
from __future__ import annotations

from . import compiled, eager, native, plan, reference
from .backend import (BACKENDS, COMPILED, DEFAULT, EAGER, REFERENCE, Attention, choose, decodes_natively,
                      paged_attention, paged_decode)
from .compiled import (AUTO_MARGIN, AUTO_MIN_CALLS, AUTO_MIN_POSITIONS, AUTO_TIMING_CALLS, AUTO_WARMUP_CALLS,
                       CHUNK_BLOCKS, kernel_key, use_auto_kernels, use_compiled_attention, wait_for_kernels)
from .eager import fresh_prefill_attention, gather_kv, paged_prefill_attention
from .native import use_native_kernel
from .plan import (DecodeGroup, DecodePlan, bytes_per_token, check_window, group_bytes_for, plan_decode,
                   plan_lists)
from .reference import dense_attention

attend_batch = DEFAULT  # the names the engine's attention functions had: the default and the compiled backend
attend_batch_compiled = COMPILED

__all__ = [
    "AUTO_MARGIN", "AUTO_MIN_CALLS", "AUTO_MIN_POSITIONS", "AUTO_TIMING_CALLS", "AUTO_WARMUP_CALLS", "Attention",
    "BACKENDS", "CHUNK_BLOCKS", "COMPILED", "DEFAULT", "DecodeGroup", "DecodePlan", "EAGER", "REFERENCE",
    "attend_batch", "attend_batch_compiled", "bytes_per_token", "check_window", "choose", "compiled",
    "decodes_natively", "dense_attention", "eager", "fresh_prefill_attention", "gather_kv", "group_bytes_for", "kernel_key", "native",
    "paged_attention", "paged_decode", "paged_prefill_attention", "plan", "plan_decode", "plan_lists", "reference",
    "use_auto_kernels", "use_compiled_attention", "use_native_kernel", "wait_for_kernels",
]
