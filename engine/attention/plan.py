"""What every decode backend shares: the checks of paged attention's inputs and the decode plan.

A :class:`DecodePlan` is made once per step from the batch's block tables and read by every layer: the native
kernel reads only its tables and lengths, the eager path its length-sorted, cache-sized groups (worked out the first
time a layer asks), the compiled kernel its tables again.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import EngineError


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


GROUP_BYTES = 4 << 20  # K+V bytes one decode group gathers at most (CPU): a copy that stays in the last-level cache,
#                       so SDPA reads it from cache, not memory (see _paged_attention_eager); the sizes tried are in
#                       docs/engine.md, "Figures behind the engine's choices"


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



def group_bytes_for(cache: torch.Tensor) -> int | None:
    """The decode group size for a cache: cache-sized groups on CPU, one group elsewhere."""
    return GROUP_BYTES if cache.device.type == "cpu" else None


def bytes_per_token(cache: torch.Tensor) -> int:
    """K+V bytes of one position (one layer)."""
    return 2 * cache.shape[2] * cache.shape[3] * cache.element_size()


def _bucket(n: int) -> int:
    """Next power of two: batch sizes and table widths are padded to these, so a handful of static kernels serve
    every step (kernels compiled for symbolic sizes ran slower: docs/engine.md, "Figures behind the engine's
    choices")."""
    return 1 << max(0, n - 1).bit_length()
