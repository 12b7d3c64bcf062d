"""The physical KV cache: for every layer, a K and a V tensor of shape [num_blocks, block_size, kv_heads, head_dim].

All layers live in one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` so that copy-on-write and
relocation move a block's K and V in every layer at once. Bulk copies go through row views of that tensor (one row
per block of one layer's K or V, or per slot), because ``index_select`` / ``index_copy_`` along the leading dimension
copy whole rows, while along an inner dimension they go element by element (several times slower: docs/engine.md,
"Figures behind the engine's choices").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from . import fp8
from .fp8 import KVScales

MOVE_CHUNK_ROWS = 512  # block rows (8 KiB each for the built-in model) staged per copy while relocating: 4 MiB,
#                        small enough to stay in cache, large enough that per-call overhead does not show


def write_slots(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float = 1.0) -> None:
    """``values`` [tokens, kv_heads, dim] into ``slots`` (block * block_size + offset) of one layer's K or V
    ``cache`` [blocks, block_size, kv_heads, dim]; an fp8 cache stores them quantised with ``scale`` as vLLM's
    cache write does (engine/kv/fp8.py)."""
    rows = cache.view(-1, cache.shape[2], cache.shape[3])  # [slots, kv_heads, dim]
    if fp8.is_fp8(cache.dtype):
        rows.view(torch.uint8).index_copy_(0, slots, fp8.quantize(values, cache.dtype, scale).view(torch.uint8))
    else:
        rows.index_copy_(0, slots, values)


@dataclass(frozen=True)
class SavedKV:
    """A copy of some rows of the cache, taken before they are overwritten, so a rollback can put them back."""

    rows: torch.Tensor  # int64 [n]: row ids in ``view`` (every layer's K and V rows of the saved slots or blocks)
    data: torch.Tensor  # [n, row elements]: what those rows held
    per_slot: bool  # rows are slots (True) or whole blocks (False)


class KVCache:
    """The K/V tensors of the whole pool, with the bulk copies that the engine's operations need (copy-on-write,
    relocation, saving what a step overwrites); it keeps no bookkeeping of which block holds what."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, layer_slots: Sequence[int] | None = None,
                 scales: KVScales | None = None):
        """``layer_slots``: for a model of several KV cache groups, the place of each model layer in its group
        (vLLM's hybrid layout: a block id names one slot of memory per place, so layer j of every group shares
        plane j and each group's tables say which block ids are its own); ``num_layers`` is then the most layers
        any group has. None: layer i is plane i (one group). ``dtype``: what the pool stores (the model's dtype, or
        float8: engine/kv/fp8.py, with ``scales``, each model layer's K and V scale, 1.0 where None)."""
        # Zeros, not empty: masked slots must never hold NaN, which would poison 0 * NaN in attention.
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        slots = range(num_layers) if layer_slots is None else layer_slots
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in slots]  # (K, V) views per model layer
        self.layer_planes = list(slots)  # the plane (index into data's first dimension) of each model layer
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_planes = num_layers * 2  # one K and one V "plane" per layer
        self.fp8 = fp8.is_fp8(dtype)
        self.scales = scales if scales is not None else fp8.KVScales.ones(len(self.layers))
        # the bulk copies move raw elements: bytes for float8, which torch's index_copy_ does not take
        raw = self.data.view(torch.uint8) if self.fp8 else self.data
        self._block_rows = raw.view(self.num_planes * num_blocks, -1)  # [planes * blocks, slots*heads*dim]
        self._slot_rows = raw.view(self.num_planes * num_blocks * block_size, -1)  # [planes*blocks*slots, heads*dim]

    @staticmethod
    def bytes_for(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        """Bytes the cache tensor of that shape takes (checked against free memory before allocating)."""
        return num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        layers, two, _, block_size, kv_heads, dim = self.data.shape
        return layers * two * block_size * kv_heads * dim * self.data.element_size()

    # ---- row ids --------------------------------------------------------------------------------------------
    def _ids(self, values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.long, device=self.data.device).reshape(-1)

    def _rows_of(self, ids: torch.Tensor, per_plane: int) -> torch.Tensor:
        """Row ids of ``ids`` (blocks or slots) in every plane: [planes * n], plane-major."""
        planes = torch.arange(self.num_planes, device=ids.device)[:, None] * per_plane  # [planes, 1]
        return (planes + ids[None, :]).reshape(-1)  # [planes, n] -> [planes * n]

    # ---- copies ---------------------------------------------------------------------------------------------
    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write: the first ``n`` slots of block ``src`` into block ``dst``, K and V, every layer."""
        for src, dst, n in copies:
            if n:
                self.data[:, :, dst, :n] = self.data[:, :, src, :n]

    def move_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block ``src[i]``'s K/V goes to ``dst[i]`` for every i (a relocation: ``dst`` holds distinct ids, sources
        and destinations may overlap). Costs what moves, not the whole cache.

        A move whose destination is no source can be written at any time (nothing still to be read is there), so
        those go straight across in small staged chunks. Only moves into another source's place (chains and
        cycles among the moving blocks) need their sources held aside first. Everything that must be allocated
        is allocated before the first write, so running out of memory leaves the cache untouched."""
        src_ids, dst_ids = self._ids(list(src)), self._ids(list(dst))
        if src_ids.numel() != dst_ids.numel():
            raise ValueError(f"move_blocks: {src_ids.numel()} sources but {dst_ids.numel()} destinations")
        if not src_ids.numel():
            return
        is_source = torch.zeros(self.num_blocks, dtype=torch.bool, device=src_ids.device)
        is_source[src_ids] = True
        onto_source = is_source[dst_ids]  # [moves]: this move overwrites a block that itself still has to move
        held_rows = self._rows_of(dst_ids[onto_source], self.num_blocks)
        held = self._block_rows.index_select(0, self._rows_of(src_ids[onto_source], self.num_blocks))  # reads only
        direct_src = self._rows_of(src_ids[~onto_source], self.num_blocks)
        direct_dst = self._rows_of(dst_ids[~onto_source], self.num_blocks)
        stage = self._block_rows.new_empty(min(MOVE_CHUNK_ROWS, direct_src.numel()), self._block_rows.shape[1])
        for start in range(0, direct_src.numel(), MOVE_CHUNK_ROWS):  # writes only rows no one reads afterwards
            rows = direct_src[start:start + MOVE_CHUNK_ROWS]
            part = stage[: rows.numel()]
            torch.index_select(self._block_rows, 0, rows, out=part)
            self._block_rows.index_copy_(0, direct_dst[start:start + MOVE_CHUNK_ROWS], part)
        if held_rows.numel():
            self._block_rows.index_copy_(0, held_rows, held)

    # ---- saving what is about to be overwritten -------------------------------------------------------------
    def save_slots(self, slots: torch.Tensor) -> SavedKV | None:
        """A copy of the K/V in some slots (``block * block_size + offset``, every layer), taken before a step
        writes there, so a rolled-back step can put the cache back byte for byte."""
        slots = self._ids(slots)
        if not slots.numel():
            return None
        rows = self._rows_of(slots, self.num_blocks * self.block_size)
        return SavedKV(rows, self._slot_rows.index_select(0, rows), True)

    def save_blocks(self, blocks: Sequence[int]) -> SavedKV | None:
        """:meth:`save_slots` of every slot of ``blocks`` (one row per block and plane)."""
        ids = self._ids(list(blocks))
        if not ids.numel():
            return None
        rows = self._rows_of(ids, self.num_blocks)
        return SavedKV(rows, self._block_rows.index_select(0, rows), False)

    def restore_slots(self, saved: SavedKV | None) -> None:
        """Put back what :meth:`save_slots` or :meth:`save_blocks` saved."""
        if saved is not None:
            (self._slot_rows if saved.per_slot else self._block_rows).index_copy_(0, saved.rows,
                                                                                  saved.data.to(self.data.device))

    def read_block(self, block: int, num_slots: int, layers: Sequence[int] | None = None):
        """K and V of a block's filled slots: each [planes, slots, kv_heads, head_dim] float32 numpy, the values
        attention reads (an fp8 pool's codes times their layer's scale). ``layers``: the model layer each plane
        holds for this block (its KV cache group's layers; None: plane i is layer i), whose scales apply."""
        kv = self.data[:, :, block, :num_slots].float()  # [planes, 2, slots, kv_heads, dim]
        if self.fp8:
            planes = kv.shape[0]
            layers = list(range(planes)) if layers is None else list(layers)[:planes]
            scales = torch.ones(planes, 2)
            for plane, layer in enumerate(layers):
                if layer < len(self.scales.k):
                    scales[plane] = torch.tensor([self.scales.k[layer], self.scales.v[layer]])
            kv = kv * scales.to(kv.device)[:, :, None, None, None]
        kv = kv.cpu().numpy()
        return kv[:, 0].copy(), kv[:, 1].copy()

    def read_block_codes(self, block: int, num_slots: int):
        """What an fp8 pool stores for a block's filled slots: K's and V's bytes, each [planes, slots, kv_heads,
        head_dim] uint8 numpy; None for a pool of another dtype (its stored values are :meth:`read_block`'s)."""
        if not self.fp8:
            return None
        codes = self.data[:, :, block, :num_slots].view(torch.uint8).cpu().numpy()
        return codes[:, 0].copy(), codes[:, 1].copy()

    @property
    def kv_dtype_name(self) -> str:
        """The stored dtype as the views name it: float32, bfloat16, fp8_e4m3, fp8_e5m2."""
        return {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}.get(
            self.data.dtype, str(self.data.dtype).removeprefix("torch."))

    # ---- raw block bytes (the lower tiers) ------------------------------------------------------------------
    def _block_major_rows(self, blocks: Sequence[int]) -> torch.Tensor:
        """Row ids of every plane of each block, block by block: [n * planes]. In this order the rows of ``n``
        blocks are exactly ``n`` lower-tier blocks laid end to end, so one gather or one scatter moves them all."""
        ids = self._ids(list(blocks))
        planes = torch.arange(self.num_planes, device=ids.device)[None, :] * self.num_blocks  # [1, planes]
        return (ids[:, None] + planes).reshape(-1)  # [n, planes] -> [n * planes]

    def read_block_bytes(self, block: int) -> np.ndarray:
        """Every layer's K and V of one block as raw bytes (uint8 numpy, bytes_per_block long, plane-major): what
        a lower tier keeps. Raw bytes, not values, so any dtype (bfloat16 too) goes down and comes back exact."""
        return self.read_blocks_bytes([block])[0]

    def read_blocks_bytes(self, blocks: Sequence[int], out: np.ndarray | None = None) -> np.ndarray:
        """:meth:`read_block_bytes` of several blocks in one gather: uint8 [n, bytes_per_block] (into ``out`` when
        given, a C-contiguous array of that shape). One call, not one per block: an eviction that offloads a whole
        conversation then costs one pass over its bytes."""
        if len(blocks) and (min(blocks) < 0 or max(blocks) >= self.num_blocks):  # (the gather below does not check)
            raise IndexError(f"read_blocks_bytes: block ids must be in 0..{self.num_blocks - 1}, got "
                             f"{min(blocks)}..{max(blocks)}")
        rows = self._block_major_rows(blocks)
        if out is None:
            out = np.empty((len(blocks), self.bytes_per_block), np.uint8)
        if self.data.device.type == "cpu":
            # numpy's take, one thread: a torch gather of a block's rows is large enough to run on the OpenMP
            # pool, whose threads then spin beside the native decode kernels' own (the offload-stream decode slowed:
            # docs/engine.md, "Figures behind the engine's choices"; raw bytes, so any dtype).
            # mode="clip": the rows are ours and in range; take's default mode buffers its whole output in a fresh
            # temporary first (most of a large eviction's step went to its new pages: docs/engine.md, "Figures
            # behind the engine's choices")
            source = self._block_rows.view(torch.uint8).numpy()  # [planes * blocks, row bytes], no copy
            np.take(source, rows.numpy(), axis=0, out=out.reshape(len(rows), -1), mode="clip")
        else:
            target = torch.from_numpy(out).view(self._block_rows.dtype).reshape(len(rows), -1)  # [n * planes, row]
            target.copy_(self._block_rows.index_select(0, rows))
        return out

    def write_blocks_bytes(self, blocks: Sequence[int], data) -> None:
        """Put back what :meth:`read_blocks_bytes` read: ``data[i]`` (uint8 [n, bytes] or a sequence of
        bytes_per_block arrays) into block ``blocks[i]``, K and V, every layer, in one scatter."""
        if not len(blocks):
            return
        rows = self._block_major_rows(blocks)
        raw = data if isinstance(data, np.ndarray) and data.ndim == 2 else np.stack([np.asarray(d, np.uint8) for d in data])
        values = torch.from_numpy(np.ascontiguousarray(raw, np.uint8)).view(self._block_rows.dtype)  # [n, bytes / size]
        values = values.reshape(len(rows), -1)  # [n, planes * row] -> [n * planes, row] (no copy)
        self._block_rows.index_copy_(0, rows, values.to(self.data.device))

    def saved_from_bytes(self, blocks: Sequence[int], data: np.ndarray) -> SavedKV | None:
        """A :class:`SavedKV` of ``blocks`` made from bytes already read (``data``: uint8 [n, bytes], what
        :meth:`read_blocks_bytes` gave while the pool evicted them and nothing has written them since), so a load
        into those blocks is undone without a second copy of what they held."""
        if not len(blocks):
            return None
        values = torch.from_numpy(data).view(self._block_rows.dtype).reshape(len(blocks) * self.num_planes, -1)
        return SavedKV(self._block_major_rows(blocks), values, False)
