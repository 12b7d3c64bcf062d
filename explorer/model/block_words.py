"""A block's facts in the inspector's words: why it has or has not a prefix hash.

The engine and the other sources state the reason as a :class:`~kvstream.views.HashReason` (a fact); the words
live here, above the floors that carry facts, so they can change without touching the engine or the wire.
Qt-free.
"""
from __future__ import annotations

from kvstream.views import BlockInfo, BlockState, HashReason


def hash_note(info: BlockInfo) -> str:
    """Why ``info``'s block has or has not a prefix hash, in words; "" when the source did not say."""
    reason = info.hash_reason
    if reason is None:
        return ""
    if reason == HashReason.FREE:
        return "free: holds no reusable KV"
    if reason == HashReason.HASHED:
        return ("full block, hashed with its prefix; a new prompt with the same prefix reuses it"
                + (" (cached: free, evicted least-recently-used first)" if info.state == BlockState.CACHED else ""))
    if reason == HashReason.PARTIAL:
        return (f"partially filled ({info.num_filled}/{info.block_size}): only full blocks are hashed and shared "
                f"through the prefix cache")
    if reason == HashReason.CACHING_OFF:
        return "full, but prefix caching is off"
    if reason == HashReason.DUPLICATE:
        return "full, but the same prefix is already cached in another block"
    return "full, but not hashed (prefix caching off, or the same prefix is cached in another block)"
