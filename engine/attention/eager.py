"""The eager backend: decode attention by gathering each group's K/V into a small contiguous copy, then attending
(torch's SDPA, or two batched matmuls for short contexts); and prefill attention, which every backend shares.

It runs on every device and dtype and is what the other backends fall back to where they do not apply.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .plan import DecodeGroup, DecodePlan, _bucket


def gather_kv(cache: torch.Tensor, group: DecodeGroup, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Copy a group's K (or V) into a padded contiguous tensor [n, length, kv_heads, dim], in ``dtype`` (the
    queries': an fp8 pool's values are read exactly, its scales are the caller's). (Fresh tensors: reused scratch
    ones measured no faster in the engine.)"""
    _, block_size, kv_heads, dim = cache.shape
    out = as_compute(cache.index_select(0, group.rows), dtype)  # [n * num_blocks, block_size, kv_heads, dim]
    return out.view(group.end - group.start, group.num_blocks * block_size, kv_heads, dim)[:, : group.length]


def as_compute(kv: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """K or V read from the pool, in the dtype attention computes in: the same tensor where the pool stores that
    dtype; an fp8 pool's codes as their exact values (each fp8 value is a float32 and a bfloat16 value)."""
    return kv if dtype is None or kv.dtype == dtype else kv.to(dtype)



CROSS_HEAD_MIN_SEQS = 32  # decode groups of at least this many sequences,
CROSS_HEAD_MAX_HEAD_DIM = 32  # heads of at most this dim,
CROSS_HEAD_MAX_COLUMNS = 1024  # at most this many context positions x kv_heads and
CROSS_HEAD_MAX_WORK = 8192  # at most this many positions x head_dim per (sequence, KV head) attend by two batched
#                              matmuls over all heads (_cross_head_attention); the others by SDPA. The limits are where
#                              the matmuls beat SDPA on several threads (small head dims, short contexts, groups big
#                              enough); on one thread SDPA won everywhere. The measurements behind them:
#                              docs/engine.md, "Figures behind the engine's choices"


def _use_cross_head(num_seqs: int, length: int, kv_heads: int, head_dim: int, device: torch.device) -> bool:
    """Whether a decode group of ``num_seqs`` sequences and ``length`` positions attends by
    :func:`_cross_head_attention` (True) or SDPA (always on GPUs, whose SDPA kernels have no such overhead)."""
    return (device.type == "cpu" and num_seqs >= CROSS_HEAD_MIN_SEQS and head_dim <= CROSS_HEAD_MAX_HEAD_DIM
            and length * kv_heads <= CROSS_HEAD_MAX_COLUMNS and length * head_dim <= CROSS_HEAD_MAX_WORK
            and torch.get_num_threads() > 1)


@functools.lru_cache(maxsize=16)
def _head_pattern(heads: int, kv_heads: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[heads, width]: 0 where query head h may read column c (KV head c % kv_heads is its own,
    h // (heads // kv_heads)), -inf elsewhere. Periodic in c, so its first columns serve any shorter length."""
    own_head = (torch.arange(width, device=device) % kv_heads)[None, :] == \
        (torch.arange(heads, device=device) // (heads // kv_heads))[:, None]  # [heads, max columns]
    return torch.zeros(own_head.shape, dtype=dtype, device=device).masked_fill_(~own_head, float("-inf"))


def _cross_head_bias(group: DecodeGroup, heads: int, kv_heads: int, dtype: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """Additive mask [n, heads, length * kv_heads] for :func:`_cross_head_attention`: 0 where query head h may read
    the column (its own KV head, a position inside its sequence), -inf elsewhere. Made once per step and group
    (cached on the group: every layer uses it); without a length mask it is a view of a cached pattern."""
    key = (heads, kv_heads, dtype, device)
    bias = group.cache.get(key)
    if bias is None:
        n, columns = group.end - group.start, group.length * kv_heads
        width = max(CROSS_HEAD_MAX_COLUMNS, _bucket(columns))
        bias = _head_pattern(heads, kv_heads, width, dtype, device)[:, :columns].expand(n, heads, columns)
        if group.mask is not None:  # [n, 1, 1, length] -> [n, 1, columns] (column t * kv_heads + k is position t)
            outside = ~group.mask.view(n, 1, group.length).repeat_interleave(kv_heads, dim=2)
            bias = bias.masked_fill(outside, float("-inf"))  # [n, heads, columns]
        group.cache[key] = bias
    return bias


def _cross_head_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Decode attention for short contexts as two plain batched matmuls.

    q [n, kv_heads, group, dim]; keys/values [n, T, kv_heads, dim] as gathered (a sequence's K is then one matrix
    [T * kv_heads, dim]) -> [n, kv_heads, group, dim]. Every query head is scored against every KV head's keys and
    ``bias`` (-inf off a head's own KV head and past a sequence's end) zeroes the cross terms in the softmax, so the
    same weights meet V in one more matmul. That is kv_heads times the arithmetic of grouped attention, but for
    short contexts decode attention is all overhead, not arithmetic: SDPA's CPU kernel runs one small task per
    (sequence, KV head) and barely gains from a second thread, while one MKL batched matmul of [heads, dim] x
    [dim, T * kv_heads] per sequence does."""
    n, kv_heads, group, dim = q.shape
    columns = keys.shape[1] * kv_heads
    scores = torch.baddbmm(bias, q.reshape(n, kv_heads * group, dim), keys.reshape(n, columns, dim).transpose(1, 2),
                           alpha=scale)  # [n, heads, columns]
    out = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(n, columns, dim))  # [n, heads, dim]
    return out.view(n, kv_heads, group, dim)


def _paged_attention_eager(query, key_cache, value_cache, plan: DecodePlan, scale):
    """Per group of similar-length sequences: gather their K/V into a small contiguous tensor, then attend (two
    batched matmuls for short contexts, :func:`_cross_head_attention`; SDPA for longer ones).

    Gathering the whole batch first (the earlier default) wrote a copy as large as the batch's K/V and read it back
    from memory: three passes over memory instead of one. A group's copy is small enough to be read back from cache
    right after it is written, so memory is read about once.

    The query heads that share a KV head go in as that head's "query positions" ([seqs, kv_heads, group, dim]):
    with no causal mask that is exactly grouped-query attention, and SDPA then reads each K/V row once per group
    instead of expanding K/V for every query head (faster than ``enable_gqa``). Figures: docs/engine.md,
    "Figures behind the engine's choices"."""
    seqs, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    q = query.view(seqs, kv_heads, heads // kv_heads, dim)  # [seqs, kv_heads, group, dim]
    if plan.order is not None:
        q = q.index_select(0, plan.order)  # longest first

    def attend(group: DecodeGroup) -> torch.Tensor:
        keys = gather_kv(key_cache, group, q.dtype)  # [n, T, kv_heads, dim]
        values = gather_kv(value_cache, group, q.dtype)
        if _use_cross_head(group.end - group.start, group.length, kv_heads, dim, q.device):
            bias = _cross_head_bias(group, heads, kv_heads, q.dtype, q.device)
            return _cross_head_attention(q[group.start:group.end], keys, values, bias, scale)
        return F.scaled_dot_product_attention(
            q[group.start:group.end],
            keys.transpose(1, 2),  # [n, kv_heads, T, dim]
            values.transpose(1, 2),
            attn_mask=group.sdpa_mask(q.dtype),  # [n, 1, 1, T] or None
            scale=scale,
        )  # [n, kv_heads, group, dim]

    if len(plan.groups) == 1:
        out = attend(plan.groups[0])
    else:
        out = q.new_empty(q.shape)
        for group in plan.groups:
            out[group.start:group.end] = attend(group)
    if plan.inverse is not None:
        out = out.index_select(0, plan.inverse)  # back to batch order
    return out.reshape(seqs, heads, dim)



def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, start: int, scale: float | None = None,
                            sliding_window: int | None = None) -> torch.Tensor:
    """Causal attention for one sequence's chunk of new tokens at positions start..start+T-1.

    query [T, heads, dim]; the chunk's own K/V must already be written to the cache; earlier positions (a cached
    prefix, or earlier chunks) are read from the pool through ``block_table`` [blocks] -> [T, heads, dim].
    ``sliding_window``: query p reads keys at positions > p - window; blocks wholly before the first query's window
    are not read (their entries may be -1)."""
    num_new, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    total = start + num_new
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    if sliding_window is not None and total > sliding_window:
        return _windowed_prefill(query, key_cache, value_cache, block_table, start, scale, sliding_window)
    blocks = block_table[: -(-total // key_cache.shape[1])].long()
    keys = as_compute(key_cache.index_select(0, blocks), query.dtype).flatten(0, 1)[:total]  # [total, kv_heads, dim]
    values = as_compute(value_cache.index_select(0, blocks), query.dtype).flatten(0, 1)[:total]
    if start == 0:
        mask, causal = None, True
    else:  # query i sits at position start + i and sees keys 0..start + i
        q_pos = torch.arange(start, total, device=query.device)[:, None]
        mask, causal = torch.arange(total, device=query.device)[None, :] <= q_pos, False  # [T, total]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, heads, T, dim]
        keys.transpose(0, 1)[None],  # [1, kv_heads, total, dim]
        values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=kv_heads != heads,
    )  # [1, heads, T, dim]
    return out[0].transpose(0, 1)


def fresh_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: list[torch.Tensor], count: int, scale: float) -> torch.Tensor:
    """Causal attention for several sequences' first ``count`` tokens at once: one SDPA over a batch instead of one
    call per sequence (a step that admits 64 prompts of one length made 64 calls per layer before).

    query [seqs * count, heads, dim], the sequences' tokens one after another; each one's K/V already written to the
    cache at positions 0..count-1 through its table in ``block_tables`` -> [seqs * count, heads, dim]. Each
    sequence's attention is computed exactly as :func:`paged_prefill_attention` computes it alone (SDPA works each
    (sequence, head) apart; tested on the CPU)."""
    seqs = len(block_tables)
    _, heads, dim = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    width = -(-count // block_size)
    blocks = torch.stack([t[:width] for t in block_tables]).long().flatten()  # [seqs * width]
    keys = as_compute(key_cache.index_select(0, blocks), query.dtype).view(seqs, width * block_size, kv_heads,
                                                                         dim)[:, :count]
    values = as_compute(value_cache.index_select(0, blocks), query.dtype).view(seqs, width * block_size, kv_heads,
                                                                             dim)[:, :count]
    out = F.scaled_dot_product_attention(
        query.view(seqs, count, heads, dim).transpose(1, 2),  # [seqs, heads, count, dim]
        keys.transpose(1, 2), values.transpose(1, 2),  # [seqs, kv_heads, count, dim]
        is_causal=True, scale=scale, enable_gqa=kv_heads != heads,
    )  # [seqs, heads, count, dim]
    return out.transpose(1, 2).reshape(seqs * count, heads, dim)


def _windowed_prefill(query, key_cache, value_cache, block_table, start: int, scale: float, window: int):
    """paged_prefill_attention with a window: only the blocks from the one holding the first query's first key
    are gathered (the chunk reads nothing before it), and each query sees the keys p - window < k <= p."""
    num_new, heads, _ = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    total = start + num_new
    first = max(0, start - window + 1) // block_size  # block of the first key the first query reads
    blocks = block_table[first: -(-total // block_size)].long().clamp_min(0)  # (none of these is absent)
    offset = first * block_size  # position of the first gathered slot
    keys = as_compute(key_cache.index_select(0, blocks), query.dtype).flatten(0, 1)[: total - offset]  # [T', kv, dim]
    values = as_compute(value_cache.index_select(0, blocks), query.dtype).flatten(0, 1)[: total - offset]
    q_pos = torch.arange(start, total, device=query.device)[:, None]  # [T, 1]
    k_pos = torch.arange(offset, total, device=query.device)[None, :]  # [1, total - offset]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [T, total - offset]
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],  # [1, heads, T, dim]
        keys.transpose(0, 1)[None],  # [1, kv_heads, total - offset, dim]
        values.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=kv_heads != heads,
    )  # [1, heads, T, dim]
    return out[0].transpose(0, 1)


