"""The mutations both fuzz runs make of real inputs: tools/fuzz_poolstream.py (the pool stream's frames and
recordings) and tools/fuzz_kv_events.py (KV-event batches), and the tests that draw the same ones from hypothesis.

Byte-level: truncation, bit flips, overwritten, inserted, deleted and repeated ranges. On a decoded msgpack value:
every node found by its path, and replaced by an extreme integer or a value of the wrong type.
"""
from __future__ import annotations

import random

EXTREME_INTS = (-1, 0, 1, -2 ** 63, 2 ** 63 - 1, 2 ** 64 - 1, 2 ** 31, -2 ** 31 - 1, -2 ** 31, 2 ** 32, 10 ** 12,
                4 * 10 ** 8, 255, 256)
WRONG_TYPES = ("x", "", b"", 1.5, float("nan"), float("inf"), None, True, [], {}, b"\x00" * 8, b"\x00" * 40,
               [1, 2], [[1]], {"a": 1}, {"type": 1})


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """One random byte-level mutation of ``data``."""
    b = bytearray(data)
    n = len(b)
    kind = rng.randrange(6)
    if kind == 0 or n < 2:  # truncation
        return bytes(b[:rng.randrange(n + 1)])
    if kind == 1:  # bit flips
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(n)
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    i = rng.randrange(n)
    k = rng.randint(1, 8)
    if kind == 2:  # overwrite a range
        fill = rng.choice([b"\xff" * k, b"\x00" * k, bytes(rng.randrange(256) for _ in range(k))])
        b[i:i + k] = fill[:len(b[i:i + k])]
    elif kind == 3:  # insert
        b[i:i] = bytes(rng.randrange(256) for _ in range(k))
    elif kind == 4:  # delete
        del b[i:i + k]
    else:  # repeat a range
        b[i:i] = b[i:i + k]
    return bytes(b)


def nodes(value, path=()):
    """(path, value) of every node of a decoded msgpack value, the value itself first."""
    yield path, value
    if isinstance(value, list):
        for i, v in enumerate(value):
            yield from nodes(v, path + (i,))
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, path + (k,))


def set_at(value, path, new):
    """``value`` with the node at ``path`` replaced by ``new`` (in place; the root's replacement is returned)."""
    if not path:
        return new
    container = value
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = new
    return value
