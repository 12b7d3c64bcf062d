"""Tokens for a trace's hash ids: each id becomes its own ``block_size`` tokens, deterministic, no two ids alike.

A trace names blocks, not text. Giving every id tokens of its own and laying a request's ids end to end gives a
prompt whose full blocks the engine hashes, chained, exactly as it hashes real text: two prompts share a block's hash
exactly when the trace says they share that prefix. The map is a bijection (an affine permutation of the ids' dense
indices, written in base ``hi - lo`` over ``block_size`` digits), so two ids never get the same tokens, and it is
spread over the vocabulary so a real model reads varied tokens rather than runs of zeros.
"""
from __future__ import annotations

import numpy as np

_PRIMES = (1_000_003, 998_244_353, 2_147_483_647)  # a multiplier for small moduli: the first not dividing it
_GOLDEN = 0x9E3779B97F4A7C15  # odd: multiplying by it permutes 64-bit words


class SynthesisError(ValueError):
    """The vocabulary and block size cannot give every id distinct tokens."""


class TokenSynth:
    """Tokens in ``[lo, hi)`` for ids given as dense indices 0..n-1 (a trace's distinct ids, in any fixed order)."""

    def __init__(self, block_size: int, lo: int, hi: int, num_ids: int):
        base = hi - lo
        if block_size < 1 or base < 2:
            raise SynthesisError(f"cannot make tokens from {base} symbols in blocks of {block_size}")
        space = base ** block_size  # distinct blocks the vocabulary allows
        if num_ids > space:
            raise SynthesisError(f"{num_ids:,} distinct hash ids need more distinct blocks than {block_size}-token "
                                 f"blocks over {base} token ids give ({space:,}); use a larger block size")
        self.block_size, self.lo, self.base = block_size, lo, base
        # the permutation: of all 64-bit words when the digits hold one whole; of [0, space) when space is small
        self.wide = space >= 1 << 64
        self.space = space
        self.multiplier = 1 if 1 << 32 <= space < 1 << 64 else next((p for p in _PRIMES if space % p), 1)
        self.digits = 1  # digits that spell the permuted index (a 64-bit word at most)
        while self.digits < block_size and base ** self.digits < min(space, 1 << 64):
            self.digits += 1

    def tokens(self, indices) -> np.ndarray:
        """int64 [len(indices) * block_size]: each index's tokens, one block after another. The first digits
        (base ``hi - lo``) spell a permutation of the index, so they alone tell ids apart; any digits past a 64-bit
        word are a hash of it, so long blocks look varied too."""
        idx = np.asarray(indices, np.int64).astype(np.uint64)
        with np.errstate(over="ignore"):
            if self.wide or self.space & (self.space - 1) == 0:  # 2^64, or a power of two dividing it
                x = idx * np.uint64(_GOLDEN) + np.uint64(0x632BE59BD9B4E019)
                if not self.wide:
                    x = x & np.uint64(self.space - 1)
            else:
                x = (idx * np.uint64(self.multiplier) + np.uint64(self.space // 3)) % np.uint64(self.space)
            base = np.uint64(self.base)
            out = np.empty((len(idx), self.block_size), np.int64)
            rest = x.copy()
            for k in range(self.block_size):
                if k < self.digits:
                    out[:, k] = (rest % base).astype(np.int64) + self.lo
                    rest = rest // base
                else:  # splitmix64's finaliser of the word and the digit's place: deterministic, spread
                    z = x ^ np.uint64((k * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF)
                    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
                    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
                    out[:, k] = ((z ^ (z >> np.uint64(31))) % base).astype(np.int64) + self.lo
        return out.reshape(-1)


def dense_ids(ids: np.ndarray) -> np.ndarray:
    """Each id's index among the distinct ids (in order of value): what :class:`TokenSynth` takes."""
    _, inverse = np.unique(ids, return_inverse=True)
    return inverse.astype(np.int64)
