"""Fuzzing the KV-event decoder and the watcher's handler (issue 32): mutations of real batches (truncation, bit
flips, spliced bytes, swapped fields, extreme integers, wrong types, reshuffled events) end in a clean
``KVEventDecodeError`` or a usable batch, never another exception, and decoding allocates a bounded amount. A few
hundred inputs here (seconds); ``tools/fuzz_kv_events.py`` runs the same mutators for as long as asked."""
from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvstream.kv_events import KVEventDecodeError, decode_batch_report
from tools.fuzz_kv_events import (ALLOC_CONSTANT, ALLOC_PER_BYTE, MUTATORS, check_alloc, check_decode,
                                  feed_follower, mutate, new_follower, seed_payloads)

SEEDS = seed_payloads()
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(st.sampled_from(SEEDS), st.randoms(use_true_random=False))
def test_mutated_batches_decode_cleanly(payload, rng):
    assert check_decode(mutate(rng, payload)) in ("error", "batch")


@FUZZ
@given(st.sampled_from(SEEDS), st.sampled_from(MUTATORS), st.randoms(use_true_random=False))
def test_each_mutator_alone(payload, mutator, rng):
    assert check_decode(mutator(rng, payload)) in ("error", "batch")


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_cleanly(payload):
    assert check_decode(payload) in ("error", "batch")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(SEEDS), st.randoms(use_true_random=False)), min_size=1, max_size=20))
def test_the_watchers_handler_never_raises(messages):
    follower = new_follower()
    for payload, rng in messages:
        feed_follower(follower, rng, mutate(rng, payload))
    assert follower.num_malformed + follower.index.num_batches + follower.num_future + len(follower.pending) >= 0


@pytest.mark.parametrize("payload", [
    b"\xdd\xff\xff\xff\xff",  # an array claiming 2**32 - 1 elements, none sent
    b"\x93\xcb?\xf0\x00\x00\x00\x00\x00\x00\xdd\xff\xff\xff\xff",  # a batch whose events claim as many
    b"\x92\x01\x91\xdf\xff\xff\xff\xff",  # an event map claiming 2**32 - 1 entries
    b"\x92\x01\x91\xc6\xff\xff\xff\xff",  # a bin claiming 4 GiB
    b"\x92\x01\x91\xdb\xff\xff\xff\xff",  # a str claiming 4 GiB
    b"\x91" * 100_000,  # nesting 100,000 deep
])
def test_claimed_sizes_do_not_allocate(payload):
    tracemalloc.start()
    try:
        peak = check_alloc(payload)
    finally:
        tracemalloc.stop()
    assert peak <= ALLOC_PER_BYTE * len(payload) + ALLOC_CONSTANT
    with pytest.raises(KVEventDecodeError):
        decode_batch_report(payload)


def test_the_long_run_script_counts(tmp_path):
    from tools.fuzz_kv_events import run
    counts = run(400, seed=random.Random(7).randrange(1000))
    assert counts["inputs"] == 400 and counts["non_clean"] == 0 and counts["follower_non_clean"] == 0
    assert counts["error"] > 0 and counts["batch"] > 0 and counts["alloc_over"] == 0
