"""The physical KV cache: for every layer, a K and a V tensor of shape [num_blocks, block_size, kv_heads, head_dim].

All layers live in one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` so that copy-on-write and
relocation move a block's K and V in every layer with one indexing operation.
"""
from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        # Zeros, not empty: masked slots must never hold NaN, which would poison 0 * NaN in attention.
        self.data = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]  # (K, V) views per layer

    @property
    def bytes_per_block(self) -> int:
        layers, two, _, block_size, kv_heads, dim = self.data.shape
        return layers * two * block_size * kv_heads * dim * self.data.element_size()

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy-on-write: the first ``n`` slots of block ``src`` into block ``dst``, K and V, every layer."""
        for src, dst, n in copies:
            if n:
                self.data[:, :, dst, :n] = self.data[:, :, src, :n]

    def permute(self, new_id: np.ndarray) -> None:
        """Move block b's data to ``new_id[b]`` for every b (a permutation)."""
        old_of_new = np.empty_like(new_id)
        old_of_new[new_id] = np.arange(len(new_id))
        index = torch.as_tensor(old_of_new, device=self.data.device)
        self.data.copy_(self.data.index_select(2, index))

    def read_block(self, block: int, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of a block's filled slots: each [layers, slots, kv_heads, head_dim] float32."""
        kv = self.data[:, :, block, :num_slots].float().cpu().numpy()
        return kv[:, 0].copy(), kv[:, 1].copy()
