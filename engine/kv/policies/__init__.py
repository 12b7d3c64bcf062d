"""Eviction policies: which cached block the pool gives up first (``EngineConfig.eviction_policy``).

One file each behind :class:`EvictionPolicy`: "lru" (vLLM v1's free queue, the default), "fifo", "s3fifo" (and its
variant "s3lru", whose main queue is LRU), "radix" (SGLang's radix cache) and "belady" (the offline optimum's rule,
which needs the future: trace replays only).
They decide for the device pool and for each lower tier.
"""
from __future__ import annotations

from .base import EvictionPolicy
from .belady import NEVER, BeladyPolicy, Future
from .fifo import FIFOPolicy
from .lru import LRUPolicy
from .radix import RadixPolicy
from .s3fifo import S3FIFOPolicy, S3LRUPolicy

POLICIES = {cls.name: cls for cls in (LRUPolicy, FIFOPolicy, S3FIFOPolicy, S3LRUPolicy, RadixPolicy,
                                      BeladyPolicy)}
NAMES = tuple(POLICIES)
EVICTION_POLICIES = NAMES  # the engine's public name for them
ONLINE = tuple(name for name, cls in POLICIES.items() if not cls.needs_future)


def make_policy(name: str, future: Future | None = None) -> EvictionPolicy:
    """A fresh policy by name; ``future`` for one that needs it (a ValueError names what is missing)."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction policy must be one of {', '.join(NAMES)}, got {name!r}")
    if cls.needs_future:
        if future is None:
            raise ValueError(f"the {name} policy needs to know every request to come: only a trace replay "
                             f"(--trace) can run it")
        return cls(future)
    return cls()


__all__ = ["EvictionPolicy", "POLICIES", "NAMES", "ONLINE", "NEVER", "Future", "make_policy"]
