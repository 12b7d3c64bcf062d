"""Paged attention: queries read K/V from a pool of fixed-size blocks through per-sequence block tables.

The caches are ``[num_blocks, block_size, kv_heads, head_dim]``. Logical block ``i`` of sequence ``s`` lives in
physical block ``block_tables[s, i]``; where that is in memory does not matter to the result, only which slots
hold which position. :func:`dense_attention` is the contiguous reference the tests compare against.
"""
from __future__ import annotations

import functools
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import native
from .errors import EngineError

log = logging.getLogger(__name__)


def _check(query, key_cache, value_cache, block_tables, seq_lens, window: int | None = None) -> int:
    """Refuse inputs paged_attention cannot answer correctly, with a message (never an index error or garbage);
    returns the longest seq_len (0 for no sequences). With a sliding ``window``, only the blocks holding a position
    the query reads must be valid ids (those wholly before the window are absent: -1 in the engine's tables)."""
    for name, value in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                        ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if not isinstance(value, torch.Tensor):
            raise EngineError(f"paged_attention: {name} must be a torch tensor, got {type(value).__name__}")
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise EngineError("paged_attention expects query [seqs, heads, dim] and caches [blocks, block_size, kv_heads, dim]")
    if query.shape[2] != key_cache.shape[3]:
        raise EngineError(f"query head dim ({query.shape[2]}) differs from the caches' ({key_cache.shape[3]})")
    heads, kv_heads = query.shape[1], key_cache.shape[2]
    if heads % kv_heads:
        raise EngineError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if block_tables.dim() != 2 or seq_lens.dim() != 1:
        raise EngineError("block_tables must be [seqs, max_blocks] and seq_lens [seqs]")
    if block_tables.shape[0] != query.shape[0] or seq_lens.shape[0] != query.shape[0]:
        raise EngineError("block_tables and seq_lens need one row per query sequence")
    for name, value in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise EngineError(f"paged_attention: {name} must hold integers, got {value.dtype}")
    if not query.shape[0]:
        return 0
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if block_tables.numel() <= 1024:  # a small batch: plain lists are several times cheaper than tensor operations
        lens = seq_lens.tolist()
        smallest, largest = min(lens), max(lens)
    else:
        lens_t = seq_lens.long().cpu()
        smallest, largest = int(lens_t.min()), int(lens_t.max())
    if smallest < 1:
        raise EngineError(f"every seq_len must be at least 1, got {smallest}")
    capacity = block_tables.shape[1] * block_size
    if largest > capacity:
        raise EngineError(f"a seq_len of {largest} needs more blocks than the table's {block_tables.shape[1]} "
                          f"({capacity} slots)")
    if block_tables.numel() <= 1024:
        ids = [b for row, n in zip(block_tables.tolist(), lens)
               for b in row[_first_block(n, window, block_size): -(-n // block_size)]]
        bad = next((b for b in ids if b < 0 or b >= num_blocks), None)
    else:
        columns = torch.arange(block_tables.shape[1])[None, :]
        live = columns * block_size < lens_t[:, None]  # [seqs, max_blocks]
        if window is not None:  # and the block holds a position > p - window (p = len - 1)
            live &= (columns + 1) * block_size > lens_t[:, None] - window
        ids_t = block_tables.long().cpu()[live]
        out_of_range = (ids_t < 0) | (ids_t >= num_blocks)
        bad = int(ids_t[out_of_range][0]) if bool(out_of_range.any()) else None
    if bad is not None:
        raise EngineError(f"block table entry {bad} is outside the cache (0..{num_blocks - 1}) within a "
                          f"sequence's live blocks")
    return largest


def _first_block(length: int, window: int | None, block_size: int) -> int:
    """The first logical block a query at position ``length - 1`` reads: 0, or with a sliding window the block
    holding position ``length - window`` (keys at positions > p - window, as transformers' sliding_window_overlay
    and vLLM's FlashAttention window (window - 1, 0) count them)."""
    return 0 if window is None or length <= window else (length - window) // block_size


def check_window(sliding_window) -> int | None:
    """A sliding window argument: None or a positive integer."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise EngineError(f"sliding_window must be a positive integer or None, got {sliding_window!r}")
    return int(sliding_window)


GROUP_BYTES = 4 << 20  # K+V bytes one decode group gathers at most (CPU): 4 MiB stays in this machine's 32 MiB L3,
#                       so SDPA reads the copy from cache, not memory (see _paged_attention_eager). 1, 2 and 4 MiB
#                       were measured; 4 MiB was best at batch 256 in the engine (bench/scale.py) and at 32 x 1024


@dataclass(frozen=True)
class DecodeGroup:
    """Consecutive sequences of a length-sorted decode batch whose K/V are gathered and attended together."""

    start: int  # first row, in sorted order
    end: int  # one past the last row
    rows: torch.Tensor  # int64 [(end - start) * num_blocks]: physical blocks to gather, sequence-major
    num_blocks: int  # blocks per sequence gathered (the longest one's)
    length: int  # context length of the longest sequence in the group (the gathered, padded length)
    mask: torch.Tensor | None  # bool [end - start, 1, 1, length]; None when all have ``length`` tokens
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # masks derived from ``mask``, made by
    #                                                                       the first layer, reused by the others

    def sdpa_mask(self, dtype: torch.dtype) -> torch.Tensor | None:
        """``mask`` as SDPA's additive float mask (0 / -inf), converted once per step instead of once per layer."""
        if self.mask is None:
            return None
        additive = self.cache.get(dtype)
        if additive is None:
            additive = self.cache[dtype] = torch.zeros(self.mask.shape, dtype=dtype, device=self.mask.device) \
                .masked_fill_(~self.mask, float("-inf"))
        return additive


@dataclass
class DecodePlan:
    """Everything about a decode batch's block tables that every layer shares: made once per step. The native kernel
    reads only ``tables`` and ``seq_lens``; the eager path's sorted, cache-sized groups are worked out the first
    time a layer asks for them."""

    lens: list[int]  # each sequence's context length, in batch order
    max_len: int  # longest context in the batch
    block_size: int  # slots per block
    device: torch.device  # where the tensors live
    source: list[list[int]] | torch.Tensor  # the tables planned from (live blocks per sequence, or [seqs, >= width]);
    #                                         read only during the step the plan was made for
    group_bytes: int | None = None  # K+V bytes a group gathers at most (None: one group, as on GPUs)
    bytes_per_token: int = 0  # K+V bytes of one position
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # what the first layer worked out for all
    window: int | None = None  # sliding window: a query at position p reads keys > p - window (None: all of them);
    #                            table entries of blocks wholly before the window are absent (-1) and never read

    @functools.cached_property
    def tables(self) -> torch.Tensor:
        """int64 [seqs, max_blocks]: the live blocks, 0 past each sequence's end (the kernels read these)."""
        width = -(-self.max_len // self.block_size)
        if isinstance(self.source, torch.Tensor):
            tables = _neutralised(self.source, self.seq_lens, width, self.block_size, self.lens)
            return tables if self.window is None else tables.clamp_min(0)  # absent (-1): block 0, masked out
        padded = _padded(self.source, self.lens, width, self.block_size)
        if self.window is not None:
            np.maximum(padded, 0, out=padded)
        return torch.as_tensor(padded, device=self.device)

    @functools.cached_property
    def seq_lens(self) -> torch.Tensor:
        """int64 [seqs]."""
        return torch.as_tensor(self.lens, dtype=torch.long, device=self.device)

    @property
    def order(self) -> torch.Tensor | None:
        """int64 [seqs]: batch row at each sorted position (longest first); None: already in that order."""
        return self._layout[0]

    @property
    def inverse(self) -> torch.Tensor | None:
        """int64 [seqs]: sorted position of each batch row; None with order."""
        return self._layout[1]

    @property
    def groups(self) -> list[DecodeGroup]:
        """The sorted batch cut into cache-sized groups."""
        return self._layout[2]

    @functools.cached_property
    def _layout(self) -> tuple[torch.Tensor | None, torch.Tensor | None, list[DecodeGroup]]:
        ranked, bounds = _groups(self.lens, self.block_size, self.group_bytes, self.bytes_per_token)
        if isinstance(self.source, torch.Tensor):
            tables = self.tables  # [seqs, width]; absent entries (a window's -1) already block 0
            if ranked is not None:
                tables = tables.index_select(0, torch.as_tensor(ranked, dtype=torch.long, device=tables.device))
            rows = [tables[s:e, :n].reshape(-1) for s, e, n in bounds]  # [n_seqs * n_blocks] each
        else:
            order = range(len(self.lens)) if ranked is None else ranked
            width = -(-self.max_len // self.block_size)
            table = _padded([self.source[i] for i in order], [self.lens[i] for i in order], width,
                            self.block_size)  # sorted
            if self.window is not None:
                np.maximum(table, 0, out=table)  # absent (-1): block 0, masked out below
            flat = torch.from_numpy(np.concatenate([table[s:e, :n].reshape(-1) for s, e, n in bounds]))
            rows = list(flat.to(self.device).split([(e - s) * n for s, e, n in bounds]))  # views, one per group
        return _layout(self.lens, ranked, bounds, rows, self.device, self.window)


def _neutralised(tables: torch.Tensor, seq_lens: torch.Tensor, width: int, block_size: int,
                 lens: list[int] | None = None) -> torch.Tensor:
    """int64 [seqs, width]: ``tables`` trimmed to ``width`` columns, entries past each sequence's end set to 0."""
    tables = tables[:, :width].long()  # [seqs, width]
    if lens is not None and min(lens) > (width - 1) * block_size:
        return tables  # every sequence reaches into the last column: every entry is live
    live = torch.arange(width, device=tables.device)[None, :] * block_size < seq_lens.to(tables.device)[:, None]
    return torch.where(live, tables, 0)


def _padded(block_lists: list[list[int]], lens: list[int], width: int, block_size: int) -> np.ndarray:
    """int64 [seqs, width] numpy: each sequence's live blocks, then zeros."""
    out = np.zeros((len(lens), width), dtype=np.int64)
    for i, (blocks, n) in enumerate(zip(block_lists, lens)):
        live = -(-n // block_size)
        out[i, :live] = blocks[:live]
    return out


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                group_bytes: int | None = None, bytes_per_token: int = 0, window: int | None = None) -> DecodePlan:
    """The plan for tables given as a tensor [seqs, max_blocks] (entries past a sequence's last block may hold
    anything: -1, stale ids): for the eager path sorted by length and cut into groups whose gathered K+V
    (``bytes_per_token`` per position) stay under ``group_bytes`` (None: one group, as on GPUs)."""
    lens = seq_lens.tolist()
    return DecodePlan(lens, max(lens), block_size, block_tables.device, block_tables, group_bytes, bytes_per_token,
                      window=window)


def plan_lists(block_lists: list[list[int]], lens: list[int], block_size: int, device: torch.device,
               group_bytes: int | None = None, bytes_per_token: int = 0, window: int | None = None) -> DecodePlan:
    """:func:`plan_decode` for tables held as Python lists (``block_lists[i]`` holds at least sequence i's live
    blocks), as the engine's conversations hold them: no tensor is made until a path asks for one."""
    return DecodePlan(list(lens), max(lens), block_size, device, block_lists, group_bytes, bytes_per_token,
                      window=window)


def _groups(lens: list[int], block_size: int, group_bytes: int | None,
            bytes_per_token: int) -> tuple[list[int] | None, list[tuple[int, int, int]]]:
    """(sorted order, or None when already longest first; (start, end, blocks per sequence) of each group in that
    order). Padding inside a group is bounded: a sequence shorter than half the group's longest starts a new one."""
    count = len(lens)
    ranked = sorted(range(count), key=lambda i: -lens[i])  # stable: equal lengths keep their order
    in_order = all(r == i for i, r in enumerate(ranked))
    sorted_lens = lens if in_order else [lens[i] for i in ranked]
    limit = None if group_bytes is None else max(1, group_bytes // max(1, bytes_per_token))  # positions per group
    bounds, start = [], 0
    while start < count:
        longest = sorted_lens[start]
        end = start + 1
        while end < count and (limit is None or ((end + 1 - start) * longest <= limit
                                                 and 2 * sorted_lens[end] >= longest)):
            end += 1
        bounds.append((start, end, -(-longest // block_size)))
        start = end
    return (None if in_order else ranked), bounds


def _layout(lens, ranked, bounds, rows, device,
            window: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None, list[DecodeGroup]]:
    """(order, inverse, groups) of DecodePlan from the sorted order, the groups' bounds and the blocks each
    gathers; with a sliding ``window`` the masks also hide the positions before each sequence's window."""
    order = inverse = None
    sorted_lens = lens
    if ranked is not None:
        order = torch.as_tensor(ranked, dtype=torch.long, device=device)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(ranked), device=device)
        sorted_lens = [lens[i] for i in ranked]
    lens_t = positions = None
    groups = []
    for (start, end, num_blocks), group_rows in zip(bounds, rows):
        longest = sorted_lens[start]
        mask = None
        windowed = window is not None and longest > window
        if sorted_lens[end - 1] != longest or windowed:
            if lens_t is None:
                lens_t = torch.as_tensor(sorted_lens, device=device)
                positions = torch.arange(sorted_lens[0], device=device)
            mask = (positions[None, :longest] < lens_t[start:end, None])[:, None, None, :]  # [n, 1, 1, longest]
            if windowed:  # position t visible to the query at len - 1 when t > len - 1 - window
                mask = mask & (positions[None, :longest] >= lens_t[start:end, None] - window)[:, None, None, :]
        groups.append(DecodeGroup(start, end, group_rows, num_blocks, longest, mask))
    return order, inverse, groups


def gather_kv(cache: torch.Tensor, group: DecodeGroup) -> torch.Tensor:
    """Copy a group's K (or V) into a padded contiguous tensor [n, length, kv_heads, dim]. (Gathering into reused
    scratch tensors instead of fresh ones measured no faster in the engine.)"""
    _, block_size, kv_heads, dim = cache.shape
    out = cache.index_select(0, group.rows)  # [n * num_blocks, block_size, kv_heads, dim]
    return out.view(group.end - group.start, group.num_blocks * block_size, kv_heads, dim)[:, : group.length]


CROSS_HEAD_MIN_SEQS = 32  # decode groups of at least this many sequences,
CROSS_HEAD_MAX_HEAD_DIM = 32  # heads of at most this dim,
CROSS_HEAD_MAX_COLUMNS = 1024  # at most this many context positions x kv_heads and
CROSS_HEAD_MAX_WORK = 8192  # at most this many positions x head_dim per (sequence, KV head) attend by two batched
#                              matmuls over all heads (_cross_head_attention); the others by SDPA. Alone, on 2
#                              threads, 2-64 sequences (2026-12-01, SDPA time / matmuls time, a loaded machine): head
#                              dim 32, 4 KV heads, context 96-256: 1.1-3x; head dim 64: 1.2x at context 64 but 0.8-0.9x
#                              at 128 through paged_attention (bench/attention.py 32 x 128: 0.79-0.84x); 0.5-0.8x at
#                              2,048 columns. Inside the engine (bench/peers.py against the tree before, 5-6 rounds; an
#                              A/A run of that bench favours the --baseline worker by about 4%): the 3M model (head dim
#                              32) at batch 64 1.06-1.09x, but 0.90x at batch 16, hence the minimum group. On one
#                              thread SDPA was 10-45% faster everywhere.


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
    from memory: three passes over memory instead of one, 1.6-1.75x contiguous SDPA at batch 32, context 1024. A
    group's copy is small enough to be read back from cache right after it is written, so memory is read about once.

    The query heads that share a KV head go in as that head's "query positions" ([seqs, kv_heads, group, dim]):
    with no causal mask that is exactly grouped-query attention, and SDPA then reads each K/V row once per group
    instead of expanding K/V for every query head (7-25% faster here than ``enable_gqa``)."""
    seqs, heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    q = query.view(seqs, kv_heads, heads // kv_heads, dim)  # [seqs, kv_heads, group, dim]
    if plan.order is not None:
        q = q.index_select(0, plan.order)  # longest first

    def attend(group: DecodeGroup) -> torch.Tensor:
        keys = gather_kv(key_cache, group)  # [n, T, kv_heads, dim]
        values = gather_kv(value_cache, group)
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


def group_bytes_for(cache: torch.Tensor) -> int | None:
    """The decode group size for a cache: cache-sized groups on CPU, one group elsewhere."""
    return GROUP_BYTES if cache.device.type == "cpu" else None


def bytes_per_token(cache: torch.Tensor) -> int:
    """K+V bytes of one position (one layer)."""
    return 2 * cache.shape[2] * cache.shape[3] * cache.element_size()


def _paged_attention_fused(query, key_cache, value_cache, block_tables, seq_lens, scale: float, chunk: int,
                           window: int | None = None):
    """The same attention written so that torch.compile (inductor) fuses the block-table lookups into the
    reductions: each K/V row is read straight from its physical block and nothing is gathered.

    Two choices make the generated loops fast. Scores are laid out with the block's slots innermost, so the dot
    products over ``dim`` become 16-wide vector accumulations over slots instead of one horizontal reduction per
    score. And the softmax runs per chunk of ``chunk`` blocks (split-K, as in flash-decoding): each chunk keeps its
    own maximum, its weighted V sum and its denominator, and the chunks are rescaled to the global maximum and
    added at the end, so no pass over all scores has to finish before V is read."""
    seqs, heads, dim = query.shape
    _, block_size, kv_heads, _ = key_cache.shape
    group = heads // kv_heads
    width = block_tables.shape[1]
    chunks = width // chunk
    live = torch.arange(width, device=query.device).view(1, width) * block_size < seq_lens.view(seqs, 1)
    if window is not None:  # a window's absent blocks (-1) -> block 0, masked out below
        live = live & (block_tables >= 0)
    tables = torch.where(live, block_tables, 0).long().view(seqs, chunks, chunk)  # entries past the end -> block 0
    pos = torch.arange(width * block_size, device=query.device).view(1, chunks, chunk, 1, 1, block_size)
    valid = pos < seq_lens.view(seqs, 1, 1, 1, 1, 1)
    if window is not None:  # the query at len - 1 reads positions > len - 1 - window
        valid = valid & (pos >= seq_lens.view(seqs, 1, 1, 1, 1, 1) - window)
    # [seqs, chunks, chunk, kv_heads, 1, block_size, dim]: indexed inside the fused loops, never materialised
    k = key_cache[tables].permute(0, 1, 2, 4, 3, 5).unsqueeze(4)
    v = value_cache[tables].permute(0, 1, 2, 4, 3, 5).unsqueeze(4)
    q = (query * scale).view(seqs, 1, 1, kv_heads, group, 1, dim)
    scores = torch.where(valid, (k * q).sum(-1), float("-inf"))  # [seqs, chunks, chunk, kv_heads, group, block_size]
    # A chunk wholly past the end has maximum -inf; clamping keeps exp() at 0 there instead of NaN.
    chunk_max = scores.amax((2, 5), keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - chunk_max)
    partial = (weights.unsqueeze(-1) * v).sum((2, 5))  # [seqs, chunks, kv_heads, group, dim]
    denom = weights.sum((2, 5))  # [seqs, chunks, kv_heads, group]
    chunk_max = chunk_max.view(seqs, chunks, kv_heads, group)
    rescale = torch.exp(chunk_max - chunk_max.amax(1, keepdim=True))  # chunk 0 always holds the first token
    out = (partial * rescale.unsqueeze(-1)).sum(1) / (denom * rescale).sum(1).unsqueeze(-1)
    return out.reshape(seqs, heads, dim)


CHUNK_BLOCKS = 8  # blocks per softmax chunk in the fused kernel (4 and 8 ran alike at batch 32, context 1024)


def _bucket(n: int) -> int:
    """Next power of two: batch sizes and table widths are padded to these, so a handful of static kernels serve
    every step (kernels compiled for symbolic sizes ran about 2x slower here)."""
    return 1 << max(0, n - 1).bit_length()


class _Compiled:
    """Lazily compiled fused kernel, one static specialisation per (batch, width, cache shape) bucket; any failure
    (no C++ compiler, unsupported backend) falls back to eager for good. Past ``MAX_KERNELS`` specialisations new
    shapes take the eager path (dynamo would otherwise run the fused code uncompiled, which is slow)."""

    MAX_KERNELS = 64

    def __init__(self):
        self.enabled = False
        self.failed = False
        self._fn = None
        self._kernels: set[tuple] = set()
        self._lock = threading.Lock()

    def __call__(self, query, key_cache, value_cache, block_tables, seq_lens, scale,
                 window: int | None = None) -> torch.Tensor | None:
        """The attention output, or None for a shape with no kernel left to compile (the caller goes eager)."""
        if not getattr(_thread_state, "limit_raised", False):  # dynamo's settings may be per thread: in each one
            config = torch._dynamo.config
            config.cache_size_limit = max(config.cache_size_limit, self.MAX_KERNELS + 8)
            _thread_state.limit_raised = True
        if self._fn is None:
            with self._lock:
                if self._fn is None:
                    self._fn = torch.compile(_paged_attention_fused, dynamic=False)
        seqs, width = block_tables.shape
        padded_seqs, padded_width = _bucket(seqs), _bucket(width)
        key = kernel_key(query, key_cache, seqs, width, scale) + ((window,) if window is not None else ())
        # fresh contiguous copies made in the caller's mode (small: a step's queries and tables), so that what the
        # kernel's guards check (strides, inference-ness, requires_grad) is the same for every call in that mode,
        # from any thread: a view of a caller's tensor would be compiled again on the caller's thread (seconds)
        query = query.detach().clone(memory_format=torch.contiguous_format)
        block_tables = block_tables.to(torch.long, copy=True).contiguous()
        seq_lens = seq_lens.to(torch.long, copy=True).contiguous()
        if key not in self._kernels:
            with self._lock:
                if len(self._kernels) >= self.MAX_KERNELS:
                    return None
                self._kernels.add(key)
        if (padded_seqs, padded_width) != (seqs, width):  # padding rows attend to one slot of block 0; dropped below
            query = torch.cat([query, query.new_zeros(padded_seqs - seqs, *query.shape[1:])])
            block_tables = torch.nn.functional.pad(block_tables, (0, padded_width - width, 0, padded_seqs - seqs))
            seq_lens = torch.cat([seq_lens, seq_lens.new_ones(padded_seqs - seqs)])
        if window is None:
            out = self._fn(query, key_cache, value_cache, block_tables, seq_lens, scale, min(CHUNK_BLOCKS, padded_width))
        else:
            out = self._fn(query, key_cache, value_cache, block_tables, seq_lens, scale, min(CHUNK_BLOCKS, padded_width),
                           window)
        return out[:seqs]


def kernel_key(query, key_cache, num_seqs: int, width: int, scale) -> tuple:
    """The shape bucket a fused kernel is compiled for (one static specialisation each) for ``num_seqs`` sequences
    and tables ``width`` blocks wide, with what else its guards check: grad and inference mode, and whether the
    caches are inference tensors (queries, tables and lengths are copied in the caller's mode: see _Compiled)."""
    return (_bucket(num_seqs), _bucket(width), tuple(query.shape[1:]), tuple(key_cache.shape), query.dtype,
            key_cache.dtype, query.device, float(scale), torch.is_inference_mode_enabled(), torch.is_grad_enabled(),
            key_cache.is_inference())


_thread_state = threading.local()


_compiled = _Compiled()

AUTO_MIN_POSITIONS = 512  # longest context in a batch below which decode always takes the eager path (the fused
#                           kernel lost to it inside the engine at short contexts)
AUTO_MIN_CALLS = 32  # calls of one shape bucket before it is compiled (a bucket seen once is not worth seconds)
AUTO_MARGIN = 0.95  # the compiled kernel takes over a bucket only when its median is at most this times the eager one
AUTO_WARMUP_CALLS = 3  # untimed calls of each path first (the first calls after a compile are slow)
AUTO_TIMING_CALLS = 7  # then timed calls of each path, alternating, whose medians decide a bucket
_TRIAL = "trial"  # a bucket's kernel is compiled and the caller's calls are timing both paths


class _AutoKernels:
    """The default decode path: eager everywhere, and for each long-context shape bucket in steady use, the fused
    kernel once it has been compiled in the background and then measured faster than the eager path on that shape.

    Nothing waits for a compile: the caller goes on eagerly while the "attention-compile" thread compiles (inductor
    keeps what it built in its on-disk cache, so a later run compiles again in a fraction of the time). The timing
    is done by the caller's own calls, which then take the two paths in turn (both give the same attention, to
    rounding): a thread of its own runs torch's kernels at another speed (its own OpenMP team; 2x slower here while
    the other team spins) and with another load, so only the caller measures what the caller gets. A compile that
    fails turns the fused kernel off for good (the eager path computes the same thing)."""

    def __init__(self):
        self.enabled = True
        self._lock = threading.Lock()
        self._calls: dict[tuple, int] = {}  # bucket -> calls seen before it was queued
        self._choice: dict[tuple, bool | str | None] = {}  # bucket -> True: fused, False: eager, None: compiling,
        #                                                     _TRIAL: compiled, being timed
        self._trials: dict[tuple, tuple[list, list]] = {}  # bucket -> (eager, fused) seconds of the timed calls
        self._jobs: list = []  # buckets waiting for the thread, with their inputs
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition(self._lock)
        self.decisions: dict[tuple, tuple[float, float]] = {}  # bucket -> (eager, fused) median seconds
        self.timer = time.perf_counter

    def kernel(self, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> torch.Tensor | None:
        """The attention output where this shape's bucket takes the fused kernel or is being timed, else None (go
        eager); notes the shape, and queues its compile once it is in steady use."""
        if not self.enabled or _compiled.failed:
            return None
        key = plan.cache.get("auto")  # the first layer works it out for the step; the others reuse it
        if key is None:
            key = plan.cache["auto"] = self.key(query, key_cache, len(plan.lens), plan.max_len, scale)
        if not key:
            return None
        choice = self._choice.get(key, False)
        if choice is True:
            return _try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale)
        if choice == _TRIAL:
            return self._trial(key, query, key_cache, value_cache, plan, scale)
        if choice is False and key not in self._choice:
            self._note(key, query, key_cache, value_cache, plan, scale)
        return None

    @staticmethod
    def key(query, key_cache, num_seqs: int, max_len: int, scale: float) -> tuple:
        """kernel_key of tables for ``num_seqs`` sequences of at most ``max_len`` tokens, without making them; ()
        for a context too short to consider."""
        if max_len < AUTO_MIN_POSITIONS or query.device.type != "cpu":  # a GPU's kernels run asynchronously: the
            return ()  # caller's clock would time their launch, not their work (there, use compile_attention)
        return kernel_key(query, key_cache, num_seqs, -(-max_len // key_cache.shape[1]), scale)

    def _trial(self, key, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> torch.Tensor:
        """One call of a bucket being timed: the eager path and the fused kernel in turn."""
        trial = self._trials.get(key)
        if trial is None:  # decided (or reset) meanwhile by another caller
            return _paged_attention_eager(query, key_cache, value_cache, plan, scale)
        eager, fused = trial
        use_fused = len(fused) < len(eager)
        start = self.timer()
        out = _try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale) if use_fused else None
        if out is None and use_fused:  # the kernel went away (a failure elsewhere): eager from now on
            with self._lock:
                self._choice[key] = False
                self._trials.pop(key, None)
            return _paged_attention_eager(query, key_cache, value_cache, plan, scale)
        if out is None:
            out = _paged_attention_eager(query, key_cache, value_cache, plan, scale)
        (fused if use_fused else eager).append(self.timer() - start)
        needed = AUTO_WARMUP_CALLS + AUTO_TIMING_CALLS
        if len(fused) >= needed and len(eager) >= needed:
            with self._lock:
                if self._trials.pop(key, None) is not None:  # once, whichever caller gets here first
                    e = statistics.median(eager[AUTO_WARMUP_CALLS:needed])
                    f = statistics.median(fused[AUTO_WARMUP_CALLS:needed])
                    self.decisions[key] = (e, f)
                    self._choice[key] = f <= AUTO_MARGIN * e
                    self._idle.notify_all()
        return out

    def _note(self, key, query, key_cache, value_cache, plan: DecodePlan, scale: float) -> None:
        with self._lock:
            if key in self._choice:
                return
            calls = self._calls[key] = self._calls.get(key, 0) + 1
            if calls < AUTO_MIN_CALLS or len(self._choice) >= _Compiled.MAX_KERNELS:
                return
            del self._calls[key]
            self._choice[key] = None
            # copies of what changes from step to step (the caches themselves are only read); the compile runs in
            # the caller's modes, which the kernel's guards check
            query, tables, seq_lens = (t.detach().clone() for t in (query, plan.tables, plan.seq_lens))
            modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
            self._jobs.append((key, modes, query, key_cache, value_cache, tables, seq_lens, scale))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._work, name="attention-compile", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        try:
            while True:
                with self._lock:
                    if not self._jobs:
                        return
                    job = self._jobs.pop(0)
                    if _compiled.failed:  # one compile failed: the others would too, each taking seconds
                        self._choice[job[0]] = False
                        continue
                key, modes, *inputs = job
                compiled = False
                try:
                    with torch.inference_mode(modes[0]), torch.set_grad_enabled(modes[1]):
                        compiled = _compiled(*inputs) is not None  # None: no kernel left to compile for it
                except Exception as exc:  # no C++ compiler, an unsupported backend: eager for good
                    _compiled.failed, _compiled.enabled = True, False
                    log.warning("compiled paged attention unavailable (%s); using the eager path", exc)
                finally:
                    with self._lock:
                        if compiled:
                            self._trials[key] = ([], [])
                        self._choice[key] = _TRIAL if compiled else False
                del job, inputs
        finally:
            with self._lock:
                self._thread = None
                self._idle.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued bucket is compiled (its timing is then up to the caller's next calls); False if
        ``timeout`` passed first (for benches and tests)."""
        with self._lock:
            return self._idle.wait_for(lambda: not self._jobs and self._thread is None, timeout)

    def choice(self, key: tuple) -> bool | str | None:
        """What a bucket takes: True (fused), False (eager, or not seen), None (compiling), "trial" (being timed)."""
        return self._choice.get(key, False)

    def reset(self, timeout: float | None = 60.0) -> None:
        """Forget every shape seen and decided (kernels compiled stay compiled), after waiting up to ``timeout``
        for a compile under way."""
        self.wait(timeout)
        with self._lock:
            self._calls.clear()
            self._choice.clear()
            self._trials.clear()
            self.decisions.clear()


_auto = _AutoKernels()


def use_auto_kernels(enabled: bool = True) -> bool:
    """Let the default decode path switch long-context shapes to the fused kernel where a background compile found it
    faster (True, the default), or keep it eager everywhere (False). Returns the previous setting."""
    previous, _auto.enabled = _auto.enabled, bool(enabled)
    return previous


def wait_for_kernels(timeout: float | None = None) -> bool:
    """Wait until the background compiles queued so far have been built (the timing is then done by the next calls
    of each shape); False on timeout."""
    return _auto.wait(timeout)


def use_compiled_attention(enabled: bool = True) -> bool:
    """Route the public :func:`paged_attention` through the torch.compile'd fused kernel (True) or the eager gather
    (False); engines choose for themselves (EngineConfig.compile_attention). Returns whether the fused kernel is in
    use (False after a compile failure)."""
    _compiled.enabled = bool(enabled) and not _compiled.failed
    return _compiled.enabled


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
    """
    window = check_window(sliding_window)
    max_len = _check(query, key_cache, value_cache, block_tables, seq_lens, window)
    if not query.shape[0]:
        return query.new_empty(query.shape)  # no sequences: nothing to attend
    if window is not None and max_len <= window:
        window = None  # every key is inside every window: plain attention (no entry is absent)
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else float(scale)
    if _compiled.enabled:
        out = _try_compiled(query, key_cache, value_cache, block_tables.to(query.device), seq_lens.to(query.device),
                            scale, window)
        if out is not None:
            return out
    out = _native_decode(query, key_cache, value_cache, block_tables, seq_lens, scale, window)
    if out is not None:
        return out
    if window is not None:
        plan = plan_decode(block_tables.to(query.device), seq_lens, key_cache.shape[1], group_bytes_for(key_cache),
                           bytes_per_token(key_cache), window)
        return _paged_attention_eager(query, key_cache, value_cache, plan, scale)
    if _auto.enabled and not _compiled.failed and max_len >= AUTO_MIN_POSITIONS:
        key = _auto.key(query, key_cache, query.shape[0], max_len, scale)  # a shape on the fused kernel: no plan
        if _auto.choice(key) is True:
            width = -(-max_len // key_cache.shape[1])
            out = _try_compiled(query, key_cache, value_cache, block_tables[:, :width].to(query.device),
                                seq_lens.to(query.device), scale)
            if out is not None:
                return out
    plan = plan_decode(block_tables.to(query.device), seq_lens, key_cache.shape[1], group_bytes_for(key_cache),
                       bytes_per_token(key_cache))
    out = _auto.kernel(query, key_cache, value_cache, plan, scale)
    return out if out is not None else _paged_attention_eager(query, key_cache, value_cache, plan, scale)


_native_enabled = True


def use_native_kernel(enabled: bool = True) -> bool:
    """Let decode attention on the CPU (float32) take the native kernel (:mod:`engine.native`: reads K/V in place
    through the block tables, no gather) where it could be built (True, the default), or keep it off (False).
    Returns the previous setting."""
    global _native_enabled
    previous, _native_enabled = _native_enabled, bool(enabled)
    return previous


def _native_decode(query, key_cache, value_cache, tables, seq_lens, scale, window=None) -> torch.Tensor | None:
    """The native kernel's answer, or None where it is off, unavailable or does not handle these tensors."""
    return native.decode(query, key_cache, value_cache, tables, seq_lens, scale, window) if _native_enabled else None


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plan: DecodePlan,
                 scale: float, compiled: bool = False) -> torch.Tensor:
    """:func:`paged_attention` with the tables already planned (the engine plans once per step, not per layer).
    ``compiled``: try the fused kernel for every shape (an engine built with compile_attention asks for it);
    otherwise it is used where the background compile measured it faster (:class:`_AutoKernels`)."""
    window = plan.window if plan.window is not None and plan.max_len > plan.window else None
    if compiled:
        out = _try_compiled(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale, window)
    else:
        out = _native_decode(query, key_cache, value_cache, plan.tables, plan.seq_lens, scale, window)
        if out is None and window is None:  # (the background-compiled kernels are for unwindowed shapes)
            out = _auto.kernel(query, key_cache, value_cache, plan, scale)
    return out if out is not None else _paged_attention_eager(query, key_cache, value_cache, plan, scale)


def _try_compiled(query, key_cache, value_cache, block_tables, seq_lens, scale, window=None) -> torch.Tensor | None:
    """The fused kernel's result, or None when it has failed (then it stays off for good) or has no kernel for this
    shape; the eager path computes the same thing."""
    if _compiled.failed:
        return None
    try:
        return _compiled(query, key_cache, value_cache, block_tables, seq_lens, scale, window)
    except Exception as exc:
        _compiled.failed, _compiled.enabled = True, False
        log.warning("compiled paged attention unavailable (%s); using the eager path", exc)
        return None


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
    keys = key_cache.index_select(0, blocks).flatten(0, 1)[:total]  # [total, kv_heads, dim]
    values = value_cache.index_select(0, blocks).flatten(0, 1)[:total]
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


def _windowed_prefill(query, key_cache, value_cache, block_table, start: int, scale: float, window: int):
    """paged_prefill_attention with a window: only the blocks from the one holding the first query's first key
    are gathered (the chunk reads nothing before it), and each query sees the keys p - window < k <= p."""
    num_new, heads, _ = query.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    total = start + num_new
    first = max(0, start - window + 1) // block_size  # block of the first key the first query reads
    blocks = block_table[first: -(-total // block_size)].long().clamp_min(0)  # (none of these is absent)
    offset = first * block_size  # position of the first gathered slot
    keys = key_cache.index_select(0, blocks).flatten(0, 1)[: total - offset]  # [total - offset, kv_heads, dim]
    values = value_cache.index_select(0, blocks).flatten(0, 1)[: total - offset]
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


def attend_batch(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta, scale: float,
                 block_size: int, compiled: bool = False) -> torch.Tensor:
    """Attention for a mixed batch (decodes first, then prefill chunks), all read through block tables."""
    if not meta.prefills:  # decode only: no assembly needed
        return paged_decode(q, key_cache, value_cache, meta.decode_plan, scale, compiled)
    out = torch.empty_like(q)  # [tokens, heads, dim]
    if meta.num_decode:
        out[: meta.num_decode] = paged_decode(q[: meta.num_decode], key_cache, value_cache, meta.decode_plan, scale,
                                              compiled)
    window = getattr(meta, "sliding_window", None)
    for first, count, table, start in meta.prefills:
        out[first:first + count] = paged_prefill_attention(q[first:first + count], key_cache, value_cache,
                                                           table, start, scale, window)
    return out


def decodes_natively(attend) -> bool:
    """Whether ``attend`` gives a decode-only batch to the native kernel (:func:`engine.native.decode`) as things are
    set now: the default :func:`attend_batch`, the kernel on and built. (engine.model's one-call decode step, which
    takes that kernel itself, is used only then.)"""
    return attend is attend_batch and _native_enabled and native.kernel() is not None


def attend_batch_compiled(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta, scale: float,
                          block_size: int) -> torch.Tensor:
    """:func:`attend_batch` with decode attention through the fused kernel (EngineConfig.compile_attention)."""
    return attend_batch(q, key_cache, value_cache, meta, scale, block_size, compiled=True)
