"""The reference backend: attention over one sequence's K/V stored contiguously, in float64, that the paged
paths are tested against."""
from __future__ import annotations

import math

import torch


def dense_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float | None = None) -> torch.Tensor:
    """Reference for one sequence stored contiguously: query [heads, dim], keys/values [T, kv_heads, dim]."""
    heads, dim = query.shape
    group = heads // keys.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    k = keys.repeat_interleave(group, dim=1)  # [T, heads, dim]
    v = values.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", query.double(), k.double()) * scale, dim=-1)  # [heads, T]
    return torch.einsum("ht,thd->hd", weights, v.double()).to(query.dtype)




def decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan, scale: float) -> torch.Tensor:
    """Decode attention of a planned batch, one sequence at a time: its blocks laid end to end, the positions its
    window reads (all without one) attended by :func:`dense_attention`. Slow; for tests and checks only."""
    block_size = key_cache.shape[1]
    tables = plan.tables
    outs = []
    for s, n in enumerate(plan.lens):
        first = 0 if plan.window is None or n <= plan.window else n - plan.window
        blocks = tables[s, : -(-n // block_size)]
        keys = key_cache.index_select(0, blocks).flatten(0, 1)[first:n]  # [positions, kv_heads, dim]
        values = value_cache.index_select(0, blocks).flatten(0, 1)[first:n]
        outs.append(dense_attention(query[s], keys, values, scale))
    return torch.stack(outs) if outs else query.new_empty(query.shape)
