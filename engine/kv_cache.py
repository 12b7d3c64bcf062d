"""The physical KV cache: for every layer, a K and a V tensor of shape [num_blocks, block_size, kv_heads, head_dim].

All layers live in one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` so that copy-on-write and
relocation move a block's K and V in every layer with one indexing operation.
"""
from __future__ import annotations

from typing import Sequence

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Zeros, not empty: masked slots must never hold NaN, which would poison 0 * NaN in attention.
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]  # (K, V) views per layer

    @staticmethod
    def bytes_for(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype) -> int:
        """Bytes the cache tensor of that shape takes (checked against free memory before allocating)."""
        return num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        layers, two, _, block_size, kv_heads, dim = self.data.shape
        return layers * two * block_size * kv_heads * dim * self.data.element_size()

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write: the first ``n`` slots of block ``src`` into block ``dst``, K and V, every layer."""
        for src, dst, n in copies:
            if n:
                self.data[:, :, dst, :n] = self.data[:, :, src, :n]

    def move_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Block ``src[i]``'s K/V goes to ``dst[i]`` for every i (a relocation: sources and destinations may overlap,
        so all sources are read before any destination is written). Costs what moves, not the whole cache."""
        if not len(src):
            return
        device = self.data.device
        src_index = torch.as_tensor(list(src), dtype=torch.long, device=device)
        dst_index = torch.as_tensor(list(dst), dtype=torch.long, device=device)
        moving = self.data.index_select(2, src_index)  # [layers, 2, moved, block_size, kv_heads, dim]
        self.data.index_copy_(2, dst_index, moving)

    def save_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the K/V in some slots (``block * block_size + offset``, every layer), taken before a step
        writes there, so a rolled-back step can put the cache back byte for byte."""
        if not slots.numel():
            return None
        flat = self.data.flatten(2, 3)  # [layers, 2, blocks * block_size, kv_heads, dim]: a view
        return slots, flat.index_select(2, slots)

    def save_blocks(self, blocks: Sequence[int]):
        """:meth:`save_slots` of every slot of ``blocks``."""
        bs = self.data.shape[3]
        ids = torch.as_tensor(list(blocks), dtype=torch.long, device=self.data.device)
        return self.save_slots((ids[:, None] * bs + torch.arange(bs, device=ids.device)[None, :]).flatten())

    def restore_slots(self, saved: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        if saved is not None:
            slots, data = saved
            self.data.flatten(2, 3).index_copy_(2, slots, data)

    def read_block(self, block: int, num_slots: int):
        """K and V of a block's filled slots: each [layers, slots, kv_heads, head_dim] float32 numpy."""
        kv = self.data[:, :, block, :num_slots].float().cpu().numpy()
        return kv[:, 0].copy(), kv[:, 1].copy()
