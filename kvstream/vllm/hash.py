"""The 64-bit digest of a vLLM block hash that the pool stream carries.

vLLM v1 names a full block by a chained hash: 32 bytes of SHA-256 by default (older releases and
``prefix_caching_hash_algo`` variants use other sizes, and some very old ones a Python int). The project's views keep one
uint64 per block (``PoolSnapshot.block_hash``, ``BlockEvent.block_hashes``), so the plugin reduces each hash the way
vLLM itself does when ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` asks its KV events for integers
(``vllm.v1.core.kv_cache_utils.maybe_convert_block_hash``): the hash read as a big-endian integer, low 64 bits kept,
which is its last 8 bytes. So a pool stream from the plugin and an integer KV-event stream from the same server name
every block by the same number, and a reader of 32-byte KV events reaches the same number with :func:`hash64`.

The one change: a digest of 0 would read as "no hash" (``kvstream.views.NO_HASH``), so it becomes 1, as the
project's engine does for its own hashes. Stable across processes and runs (no Python ``hash()``, no salt).
"""
from __future__ import annotations

from kvstream.views import NO_HASH

MASK64 = (1 << 64) - 1  # low 64 bits
GROUP_ID_BYTES = 4  # vLLM's BlockHashWithGroupId appends the KV cache group id as 4 big-endian bytes


def hash64(block_hash: bytes | int) -> int:
    """uint64 digest of one vLLM block hash (bytes of any length, or an int); never NO_HASH."""
    if isinstance(block_hash, int):
        value = block_hash & MASK64
    else:
        value = int.from_bytes(bytes(block_hash[-8:]), "big")
    return value if value != NO_HASH else 1


def key_hash64(key: bytes) -> int:
    """Digest of a ``BlockHashWithGroupId`` (what ``KVCacheBlock.block_hash`` holds): the group id is dropped first."""
    return hash64(key[:-GROUP_ID_BYTES])
