"""Fuzz the KV-event decoder and the watcher's message handling with mutations of real batches.

Every input is a real batch (vLLM 0.34's map form with every field, placeholders, SGLang's forms, the older tagged
arrays) with one to three mutations: truncation, bit flips, inserted or deleted bytes, swapped field values,
extreme integers, wrong types, duplicated or dropped events. Each must end in one of two clean outcomes:

- ``KVEventDecodeError`` (a ValueError naming where it went wrong), or
- a batch whose every event is usable (the index applies it without error).

Anything else (another exception, an event that breaks the index) is a non-clean outcome; so is an input whose
decoding allocates more than ``ALLOC_LIMIT`` bytes per input byte plus a constant (checked with tracemalloc on a
sample). The watcher's handler (``_Follower.on_live``) gets the same inputs with mutated sequence numbers and
frame counts and must never raise.

Run: ``python tools/fuzz_kv_events.py -n 100000 --seed 1`` (prints the counts as JSON; exit 1 on any non-clean
outcome). The structured mutations share tools/mutate.py with tools/fuzz_poolstream.py. The CI tests
(tests/test_kv_events_fuzz.py) drive the same mutators from hypothesis, a few hundred inputs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
import tracemalloc
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstream.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVCacheIndex,  # noqa: E402
                                KVEventBatch, KVEventDecodeError, KVEventEndpoint, decode_batch_report,
                                encode_batch, make_batch)
from kvstream.kv_events.subscriber import _Follower  # noqa: E402
from tools.mutate import EXTREME_INTS, WRONG_TYPES, nodes, set_at  # noqa: E402

ALLOC_PER_BYTE = 64  # decoding may allocate this many bytes per input byte ...
ALLOC_CONSTANT = 256 * 1024  # ... plus this much
WRONG_VALUES = WRONG_TYPES + (-1, 2**64 - 1)  # a value of another type, or an int out of every range


def seed_payloads() -> list[bytes]:
    """Real batches: what vLLM 0.34 (every field), its offloading connector and SGLang send."""
    tokens = tuple(range(100, 132))
    full = BlockStored((11, 12, 13, 14), None, tokens, 8, 3, "GPU", "adapter",
                       extra_keys=(("a",), None, ("m", 1), None),
                       group_idx=0, kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                       locality="LOCAL", ownership=None, session_id="s1",
                       lookahead_token_ids=((1,), (2,), (3,), (4,)))
    placeholder = BlockStored((2**64 - 1,), None, (), 0, None, "CPU", None, group_idx=1, locality="LOCAL",
                              ownership="cpu")
    mamba = BlockStored((14,), 13, (), 8, None, "STORAGE", None, group_idx=2, kv_cache_spec_kind="mamba")
    digest = BlockStored((b"\x01" * 32,), b"\xfe" * 32, (5, 6, 7, 8), 4, None, "GPU", None)
    payloads = [
        encode_batch(make_batch([full, placeholder, mamba], 1.5, 0)),
        encode_batch(make_batch([BlockRemoved((11, 12), "GPU", group_idx=0), BlockRemoved((14,), "CPU", 1, "LOCAL",
                                                                                           "cpu"),
                                 AllBlocksCleared()], 2.5, 1)),
        encode_batch(make_batch([digest, BlockRemoved((b"\x01" * 32,), None)], 3.0)),
        encode_batch(KVEventBatch(ts=4.0, events=())),
        # SGLang: medium left out or its spellings, signed hashes, cache_salt; attn_dp_rank in the rank's place
        msgspec.msgpack.encode([5.0, [
            {"type": "BlockStored", "block_hashes": [-5, 6], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": 2, "lora_id": None, "cache_salt": "salt", "medium": "CPU_PINNED"},
            {"type": "BlockRemoved", "block_hashes": [6], "medium": "DISK"}], 0]),
        # the older tagged-array form, two-element batch
        msgspec.msgpack.encode([6.0, [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None, "GPU"],
                                      ["BlockRemoved", [1]], ["AllBlocksCleared"]]]),
    ]
    return payloads


# ----------------------------------------------------------------------------------------------- mutators
def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(len(data) + 1)]


def bit_flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(len(out))
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def splice(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data) + 1)
    if rng.random() < 0.5 and data:
        return data[:i] + data[i + rng.randint(1, 8):]
    return data[:i] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))) + data[i:]


def _structured(rng: random.Random, data: bytes, change) -> bytes:
    try:
        value = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return data
    value = change(rng, value)
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, msgspec.EncodeError):
        return data


def _swap_fields(rng, value):
    maps = [(p, v) for p, v in nodes(value) if isinstance(v, dict) and len(v) >= 2]
    if not maps:
        return value
    _, m = rng.choice(maps)
    a, b = rng.sample(list(m), 2)
    m[a], m[b] = m[b], m[a]
    return value


def _extreme_int(rng, value):
    ints = [p for p, v in nodes(value) if isinstance(v, int) and not isinstance(v, bool)]
    if not ints:
        return value
    return set_at(value, rng.choice(ints), rng.choice(EXTREME_INTS))


def _wrong_type(rng, value):
    paths = [p for p, _ in nodes(value)]
    return set_at(value, rng.choice(paths), rng.choice(WRONG_VALUES))


def _events_reshuffled(rng, value):
    if isinstance(value, list) and len(value) >= 2 and isinstance(value[1], list) and value[1]:
        events = value[1]
        op = rng.randrange(3)
        if op == 0:
            events.append(rng.choice(events))
        elif op == 1:
            events.pop(rng.randrange(len(events)))
        else:
            events.insert(rng.randrange(len(events) + 1), rng.choice(WRONG_VALUES))
    return value


def swap_fields(rng, data):
    return _structured(rng, data, _swap_fields)


def extreme_int(rng, data):
    return _structured(rng, data, _extreme_int)


def wrong_type(rng, data):
    return _structured(rng, data, _wrong_type)


def reshuffle_events(rng, data):
    return _structured(rng, data, _events_reshuffled)


MUTATORS = (truncate, bit_flip, splice, swap_fields, extreme_int, wrong_type, reshuffle_events)


def mutate(rng: random.Random, payload: bytes) -> bytes:
    for _ in range(rng.randint(1, 3)):
        payload = rng.choice(MUTATORS)(rng, payload)
    return payload


# ----------------------------------------------------------------------------------------------- outcomes
def check_decode(payload: bytes) -> str:
    """"error" (clean refusal) or "batch" (a usable batch); raises AssertionError or anything else otherwise."""
    try:
        report = decode_batch_report(payload)
    except KVEventDecodeError:
        return "error"
    assert isinstance(report.batch, KVEventBatch)
    index = KVCacheIndex()
    index.apply_batch(report.batch, 0)  # every kept event is usable
    index.stored_hashes_by_medium()
    return "batch"


def check_alloc(payload: bytes) -> int:
    """Peak bytes allocated while decoding ``payload`` (tracemalloc must be tracing)."""
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        decode_batch_report(payload)
    except KVEventDecodeError:
        pass
    return tracemalloc.get_traced_memory()[1] - base


def new_follower() -> _Follower:
    """A watcher's per-endpoint handler without sockets (no replay socket: nothing to ask)."""
    return _Follower(None, KVEventEndpoint("ipc:///nonexistent/kv"), KVCacheIndex(), 1.0)


def feed_follower(follower: _Follower, rng: random.Random, payload: bytes) -> None:
    """One mutated message to the handler: it must count, skip or apply, never raise."""
    seq = rng.choice((0, 1, follower.next_seq or 0, (follower.next_seq or 0) + 1, 2**64 - 1, 2**63,
                      rng.randrange(2**64)))
    frames = [b"", (seq % 2**64).to_bytes(8, "big"), payload]  # next_seq + 1 passes 2**64 - 1 after a far batch
    op = rng.randrange(6)
    if op == 0:
        frames = frames[:rng.randint(0, 2)]
    elif op == 1:
        frames[1] = frames[1][:rng.randrange(9)]
    follower.on_live(frames)


def run(n: int, seed: int, alloc_every: int = 50) -> dict:
    rng = random.Random(seed)
    seeds = seed_payloads()
    counts = {"inputs": 0, "error": 0, "batch": 0, "non_clean": 0, "alloc_checked": 0, "alloc_over": 0,
              "max_alloc_peak_bytes": 0, "follower_messages": 0, "follower_non_clean": 0}
    examples: list[str] = []
    follower = new_follower()
    tracemalloc.start()
    started = time.perf_counter()
    for i in range(n):
        payload = mutate(rng, rng.choice(seeds))
        counts["inputs"] += 1
        try:
            counts[check_decode(payload)] += 1
        except Exception as exc:  # noqa: BLE001 -- what the run is looking for
            counts["non_clean"] += 1
            if len(examples) < 5:
                examples.append(f"{type(exc).__name__}: {exc} on {payload[:80]!r}")
        if i % alloc_every == 0:
            peak = check_alloc(payload)
            counts["alloc_checked"] += 1
            counts["max_alloc_peak_bytes"] = max(counts["max_alloc_peak_bytes"], peak)
            if peak > ALLOC_PER_BYTE * len(payload) + ALLOC_CONSTANT:
                counts["alloc_over"] += 1
        try:
            feed_follower(follower, rng, payload)
            counts["follower_messages"] += 1
        except Exception as exc:  # noqa: BLE001
            counts["follower_non_clean"] += 1
            if len(examples) < 5:
                examples.append(f"follower {type(exc).__name__}: {exc}")
    tracemalloc.stop()
    counts["seconds"] = round(time.perf_counter() - started, 1)
    counts["follower_malformed"] = follower.num_malformed
    counts["follower_odd_events"] = follower.num_odd_events
    counts["follower_future"] = follower.num_future
    counts["examples"] = examples
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=100_000, help="mutated inputs (default 100000)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    counts = run(args.n, args.seed)
    print(json.dumps(counts))
    return 1 if counts["non_clean"] or counts["follower_non_clean"] or counts["alloc_over"] else 0


if __name__ == "__main__":
    sys.exit(main())
