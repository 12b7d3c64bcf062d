"""The native backend: decode attention on the CPU by :mod:`engine.native`'s C kernel, which reads K/V in place
through the block tables (no gather), for float32 and bfloat16 caches.

It answers None where it does not apply (switched off, the kernel could not be built, another device or dtype), and
the backend that asked goes on to its next path. ``PAGED_KV_NATIVE=0`` keeps the kernel from being built at all.
"""
from __future__ import annotations

import sys

import torch

from .. import native as kernels

enabled = True  # the process-wide switch for benches and tests (use_native_kernel); an engine asks its backend


def use_native_kernel(enabled: bool = True) -> bool:  # noqa: F811 (the parameter shadows the switch)
    """Let decode attention on the CPU take the native kernel where it could be built (True, the default), or keep
    it off (False). Returns the previous setting."""
    module = sys.modules[__name__]
    previous, module.enabled = module.enabled, bool(enabled)
    return previous


def available() -> bool:
    """Whether decode batches go to the native kernel as things are set now: switched on and built."""
    return enabled and kernels.kernel() is not None


def decode(query, key_cache, value_cache, tables, seq_lens, scale, window=None) -> torch.Tensor | None:
    """The native kernel's answer, or None where it is off, unavailable or does not handle these tensors."""
    return kernels.decode(query, key_cache, value_cache, tables, seq_lens, scale, window) if enabled else None
