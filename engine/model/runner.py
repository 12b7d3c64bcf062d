"""Running the model on one scheduled batch: lay the tokens out, plan attention, forward, sample.

The batch is flattened: every conversation computing a single token (a decode, or the last token of a prompt that
was all cached) comes first and reads its context through one decode plan; every multi-token prefill chunk follows,
back to back, each reading its earlier positions from the pool through its block table. Only conversations whose
chunk reaches their last token are sampled (a chunk in the middle of a long prompt produces no token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import native

from . import sampling
from ..attention import Attention, DecodePlan, bytes_per_token, group_bytes_for, plan_lists
from ..kv.cache import KVCache
from .causal_lm import BatchMetadata, CausalLM, decode_rows
from ..scheduler import ScheduledBatch
from ..sequence import Sequence


@dataclass
class PreparedBatch:
    """Tensors of one forward pass, and which conversations get a sampled token."""

    meta: BatchMetadata
    input_ids: torch.Tensor  # int64 [tokens]
    positions: torch.Tensor  # int64 [tokens]
    sample_index: torch.Tensor  # int64 [sampled]: the row of each sampled conversation's last token
    sampled: list[Sequence]  # conversations whose chunk ends at their last token, in sample_index order
    num_prefill_tokens: int  # tokens computed that were not single-token decodes


class ModelRunner:
    """Owns nothing but references: the model, the K/V cache and the attention the engine chose."""

    def __init__(self, model: CausalLM, kv: KVCache, device: torch.device, block_size: int, attend: Attention):
        self.model = model
        self.kv = kv
        self.device = device
        self.block_size = block_size
        self.attend = attend  # engine.attention's Attention object, chosen once from the engine's config
        self.windows: list[int | None] = [None]  # each KV cache group's sliding window (set by the engine)

    @property
    def grouped(self) -> bool:
        """Whether steps need per-group metadata (several groups, or one with a window)."""
        return len(self.windows) > 1 or self.windows[0] is not None

    def prepare(self, batch: ScheduledBatch) -> PreparedBatch:
        bs = self.block_size
        singles = [s for s, n in zip(batch.seqs, batch.num_tokens) if n == 1]  # (a prefill-only request all of
        #                                                                      whose prompt was cached computes 0)
        chunks = [(s, n) for s, n in zip(batch.seqs, batch.num_tokens) if n > 1]
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sampled: list[Sequence] = []
        sample_rows: list[int] = []
        for row, seq in enumerate(singles):
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            if p + 1 == seq.num_tokens and not seq.prefill_only:
                sampled.append(seq)
                sample_rows.append(row)
        prefills = []
        num_prefill = 0
        for seq, n in chunks:
            first, start = len(ids), seq.num_computed_tokens
            end = start + n
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            table = np.asarray(seq.block_table, dtype=np.int64)
            p = np.arange(start, end)
            slots.extend((table[p // bs] * bs + p % bs).tolist())
            prefills.append((first, n, torch.as_tensor(table, device=self.device), start))
            num_prefill += n
            if end == seq.num_tokens and not seq.prefill_only:
                sampled.append(seq)
                sample_rows.append(first + n - 1)
        plan = self.plan(singles, [s.num_computed_tokens + 1 for s in singles]) if singles else None
        dev = self.device
        meta = BatchMetadata(torch.as_tensor(slots, dtype=torch.int64, device=dev), len(singles), plan, prefills)
        if self.grouped:
            meta = self._group_metas(meta, singles, chunks)
        return PreparedBatch(meta, torch.as_tensor(ids, dtype=torch.int64, device=dev),
                             torch.as_tensor(pos, dtype=torch.int64, device=dev),
                             torch.as_tensor(sample_rows, dtype=torch.int64, device=dev), sampled, num_prefill)

    def plan(self, seqs: list[Sequence], lens: list[int], group: int = 0) -> DecodePlan:
        """The decode plan for ``seqs`` with ``lens`` tokens of context each, from the block tables they hold (of
        KV cache ``group``, with its window)."""
        cache = self.kv.layers[0][0]
        return plan_lists([s.group_table(group) for s in seqs], lens, self.block_size, self.device,
                          group_bytes_for(cache), bytes_per_token(cache), self.windows[group])

    def _group_metas(self, meta: BatchMetadata, singles: list[Sequence], chunks: list) -> BatchMetadata:
        """Per KV cache group: the same tokens, their slots in that group's blocks, its tables and window. Group
        0's are ``meta``'s (built from block_table); the others are built the same way from their own tables."""
        bs, dev = self.block_size, self.device
        metas = [BatchMetadata(meta.slot_mapping, meta.num_decode, meta.decode_plan, meta.prefills, self.windows[0])]
        for g in range(1, len(self.windows)):
            slots: list[int] = []
            for seq in singles:
                p = seq.num_computed_tokens
                slots.append(seq.group_table(g)[p // bs] * bs + p % bs)
            prefills = []
            for (seq, n), (first, _, _, start) in zip(chunks, meta.prefills):
                table = np.asarray(seq.group_table(g), dtype=np.int64)
                p = np.arange(start, start + n)
                slots.extend((table[p // bs] * bs + p % bs).tolist())
                prefills.append((first, n, torch.as_tensor(table, device=dev), start))
            plan = self.plan(singles, [s.num_computed_tokens + 1 for s in singles], g) if singles else None
            metas.append(BatchMetadata(torch.as_tensor(slots, dtype=torch.int64, device=dev), meta.num_decode, plan,
                                       prefills, self.windows[g]))
        if len(metas) == 1:
            return metas[0]  # one sliding group: its window on the one metadata
        return BatchMetadata(meta.slot_mapping, meta.num_decode, meta.decode_plan, meta.prefills, None, tuple(metas))

    def all_slots(self, meta: BatchMetadata) -> list[torch.Tensor]:
        """The slots a step writes, in every group (what a rollback must save)."""
        if meta.groups:
            return [m.slot_mapping for m in meta.groups]
        return [meta.slot_mapping]

    def forward(self, prepared: PreparedBatch) -> torch.Tensor:
        """K/V of every scheduled token written to the pool; logits [sampled, vocab] float32."""
        with torch.inference_mode(), decode_rows(not prepared.meta.prefills):
            hidden = self.model(prepared.input_ids, prepared.positions, prepared.meta, self.kv.layers, self.attend)
            return self.model.compute_logits(hidden[prepared.sample_index])

    @staticmethod
    def check(logits: torch.Tensor) -> tuple[frozenset[int], list[int] | None]:
        """The rows of ``logits`` holding a NaN or an infinity, and where there is none every row's argmax, from one
        pass of the native walk (torch's isfinite where the kernel does not serve, and no argmax)."""
        checked = native.argmax_checked(logits)
        if checked is not None:
            tokens, broken = checked
            return broken, None if broken else tokens
        if bool(torch.isfinite(logits).all()):
            return frozenset(), None
        return frozenset(torch.nonzero(~torch.isfinite(logits).all(-1)).flatten().tolist()), None

    @staticmethod
    def sample(logits: torch.Tensor, seqs: list[Sequence], greedy: list[int] | None = None) -> list[int]:
        """Greedy where temperature is 0, else a draw from softmax(logits / temperature) with the conversation's
        own random stream (engine.model.sampling: its seed and the position of the token drawn), all rows at once.
        ``greedy``: every row's argmax, where :meth:`check` already has it."""
        tokens = greedy if greedy is not None else native.argmax_rows(logits)
        if tokens is None:
            tokens = logits.argmax(dim=-1).tolist()
        rows = [i for i, seq in enumerate(seqs) if seq.temperature > 0]
        if rows:
            drawn = [seqs[i] for i in rows]
            for i, token in zip(rows, sampling.sample(logits[rows], [s.temperature for s in drawn],
                                                      [s.seed for s in drawn], [s.num_tokens for s in drawn])):
                tokens[i] = token
        return tokens

    def probe(self, seqs: list[Sequence]) -> np.ndarray:
        """Attention output of each conversation's last computed token in every layer, read through the block
        tables and writing nothing: [layers, seqs, heads, dim] float32."""
        lens = [s.num_computed_tokens for s in seqs]
        meta = BatchMetadata(None, len(seqs), self.plan(seqs, lens), [], self.windows[0])
        if len(self.windows) > 1:
            meta = BatchMetadata(None, len(seqs), meta.decode_plan, [], None, tuple(
                BatchMetadata(None, len(seqs), self.plan(seqs, lens, g), [], self.windows[g])
                for g in range(len(self.windows))))
        ids = torch.as_tensor([s.token_ids[s.num_computed_tokens - 1] for s in seqs], device=self.device)
        pos = torch.as_tensor([s.num_computed_tokens - 1 for s in seqs], device=self.device)
        outs: list[torch.Tensor] = []
        with torch.inference_mode(), decode_rows(True):
            self.model(ids, pos, meta, self.kv.layers, self.attend, layer_hook=lambda i, out: outs.append(out.float()))
        return torch.stack(outs).cpu().numpy()
