"""KV cache groups and the rule of each kind: what a group of full-attention or sliding-window layers keeps.

As vLLM v1's hybrid allocator pages them: one group per kind of layer, every group drawing its blocks from the one
:class:`engine.kv.pool.BlockPool`. A block id belongs to one group at a time and names one slot of memory per layer
of that group (:class:`engine.kv.cache.KVCache`'s layer planes), so each conversation has one block table per group,
and the groups share the pool's free queues, its prefix cache and its budget. The one manager,
:class:`engine.kv.manager.KVCacheManager`, keeps those tables; what differs between kinds is small, so it is not a
manager per kind (vLLM's single-type managers) but a policy object per group that the manager asks three questions:

- which logical blocks the next query still reads (:meth:`first_needed`): full attention reads them all; a sliding
  window reads only the keys at positions > p - window, so a block wholly before that is never read again. The
  manager releases such blocks at the step that makes them so (reason ``WINDOW_REASON``), a hashed one staying
  CACHED for prefix hits, and puts -1 in their place (:data:`ABSENT`, vLLM's null block). Paging alone never
  releases KV: a window does, because the model will not read it.
- how long a prefix hit the group can serve (:meth:`hit_length`): full attention needs every block of the prefix,
  a sliding window only the blocks inside the window of the hit's first computed token.
- the most blocks one conversation holds at once (:meth:`peak_blocks`), for refusing what can never fit.

Prefix caching per group: a block's cache key is its prefix hash mixed with its group (:func:`group_key`; group 0's
key is the hash itself, so a one-group pool is keyed as a plain pool is).
"""
from __future__ import annotations

from typing import Callable, Iterable

from kvstream.rules import cdiv, group_key, raw_hash  # noqa: F401 (re-exported: the groups' cache keys)
from kvstream.views import KVCacheGroupInfo

ABSENT = -1  # a table entry whose block a sliding window released

FULL_ATTENTION = KVCacheGroupInfo("full_attention", None, ())  # the one group of a plain pool (the lesson's)


class KindPolicy:
    """What one group's kind of layer keeps (subclasses: one per kind; the manager asks, never the other way)."""

    releases = False  # whether blocks go before their conversation does (the manager then releases them at commit)

    def __init__(self, block_size: int):
        self.block_size = block_size


class FullAttention(KindPolicy):
    """Every query reads every earlier key: the group keeps each block while its conversation runs."""

    def first_needed(self, num_computed: int) -> int:
        """The first logical block the query at position ``num_computed`` reads."""
        return 0

    def find(self, lookup: Callable[[int], object], keys: Iterable[int]) -> list:
        """The cached block (or lower-tier hit) of each leading key, up to the first miss: a hit needs them all, so
        nothing after a miss is looked up."""
        found = []
        for key in keys:
            block = lookup(key)
            if block is None:
                break
            found.append(block)
        return found

    def hit_length(self, found: list, length: int) -> int:
        """The longest hit of at most ``length`` blocks this group can serve from ``found`` (:meth:`find`'s)."""
        return min(len(found), length)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most blocks a conversation of ``num_tokens`` tokens holds at once in this group: all of them."""
        return cdiv(num_tokens, self.block_size)


class SlidingWindow(KindPolicy):
    """A query at position p reads only the keys at positions > p - ``window``: blocks before that are released."""

    releases = True

    def __init__(self, block_size: int, window: int):
        super().__init__(block_size)
        self.window = window

    def first_needed(self, num_computed: int) -> int:
        """vLLM's get_num_skipped_tokens: num_computed - window + 1 positions are skipped."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def find(self, lookup: Callable[[int], object], keys: Iterable[int]) -> list:
        """Every key's cached block (None where there is none): a hit needs only its window's blocks, so a miss
        early in the prefix does not end it."""
        return [lookup(key) for key in keys]

    def hit_length(self, found: list, length: int) -> int:
        """The longest hit whose window's blocks are all cached."""
        for cand in range(length, 0, -1):
            if all(found[i] is not None for i in range(self.first_needed(cand * self.block_size), cand)):
                return cand
        return 0

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The window's blocks plus a chunk's (a chunk's blocks are all held until the step that computed them
        ends), computing at most ``chunk`` tokens a step."""
        blocks = cdiv(num_tokens, self.block_size)
        return min(blocks, cdiv(self.window - 1 + min(chunk, num_tokens), self.block_size) + 1)


def policy_for(group: KVCacheGroupInfo, block_size: int) -> KindPolicy:
    """The rule of ``group``'s kind."""
    if group.sliding_window is None:
        return FullAttention(block_size)
    return SlidingWindow(block_size, group.sliding_window)


def kv_cache_group_infos(config) -> tuple[KVCacheGroupInfo, ...]:
    """The KV cache groups of a model (engine.model.causal_lm.ModelConfig.kv_cache_groups), as the views name them."""
    return tuple(KVCacheGroupInfo(kind, window, layers) for kind, window, layers in config.kv_cache_groups())


def kv_cache_layout(groups: tuple[KVCacheGroupInfo, ...], num_layers: int) -> tuple[int, list[int] | None]:
    """(layer planes of the KV tensor, each model layer's plane): as vLLM's hybrid allocator lays groups out, a
    block id is one slot of memory in each of ``max layers per group`` planes; layer j of a group (j-th in its
    group) lives in plane j. One group: every layer its own plane, in order (None)."""
    if len(groups) == 1:
        return num_layers, None
    slots = [0] * num_layers
    for group in groups:
        for j, layer in enumerate(group.layers):
            slots[layer] = j
    return max(len(g.layers) for g in groups), slots
