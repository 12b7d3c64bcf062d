"""Temperature sampling for a whole batch in a few tensor operations, each conversation with its own random stream.

A conversation's draw for the token at position ``p`` is a counter-based random number: a fixed mix of its seed and
``p`` (two rounds of the SplitMix64 finalizer), as stateless samplers (JAX's keys, the Philox ``(seed, offset)`` of
GPU sampling kernels) make theirs. So a conversation's tokens depend on its seed, its prompt and the model only: not
on which other conversations share the step, not on how often it was preempted and recomputed, and a step that is
rolled back and run again draws the same numbers, with no generator state to save or restore.

The token is then the inverse of the softmax's cumulative distribution at that number (one ``searchsorted`` per
batch): exact sampling from ``softmax(logits / temperature)``, never a token of probability zero.
"""
from __future__ import annotations

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """The SplitMix64 finalizer over uint64 (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seeds, positions) -> np.ndarray:
    """float64 [n] in [0, 1): the draw of each (seed, position) pair; 53 random bits each."""
    s = np.array(seeds, dtype=np.uint64)  # seeds and positions are non-negative, below 2**64
    p = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = _mix(s ^ _mix(p * _GOLDEN + _GOLDEN))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample(logits: torch.Tensor, temperatures, seeds, positions) -> list[int]:
    """One token per row of ``logits`` [rows, vocab] from softmax(row / temperature) (every temperature > 0), drawn
    with that row's (seed, position)."""
    if logits.shape[0] == 0:
        return []
    temps = torch.tensor(list(temperatures), dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(logits.float() / temps, dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    targets = torch.from_numpy(uniforms(seeds, positions)).unsqueeze(1) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # first index whose cdf exceeds the target
    out = tokens.tolist()
    vocab = logits.shape[1]
    if max(out) >= vocab:  # a target rounded up to the total (rare): the last token that can be drawn
        out = [t if t < vocab else int(torch.nonzero(probs[i] > 0).max()) for i, t in enumerate(out)]
    return out
