"""Issue 32: fuzzing in CI. Hypothesis draws mutations of real frames (truncation, bit flips, overwritten, inserted,
deleted and repeated bytes; extreme integers, wrong types, swapped, dropped and repeated fields in the msgpack
structure; a recording's frames re-checksummed or their length fields changed) and every input must end cleanly: a
StreamError / RecordingError, or frames whose pools pass the invariants; never another exception, never more than
a bounded allocation. A few seconds here; ``python tools/fuzz_poolstream.py --inputs 100000`` is the long run."""
from __future__ import annotations

import functools
import random
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.fuzz_poolstream import (EXTREME_INTS, bounded, corpus, decode_outcome, frame_spans, mutate_payload,
                                  mutate_recording, recording_bytes, recording_outcome)

FAST = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@functools.lru_cache(maxsize=None)
def _corpus():
    frames, starts = corpus()
    data = recording_bytes(frames[:12])
    return frames, starts, data, frame_spans(data)


@pytest.fixture(autouse=True)
def _traced():
    tracemalloc.start()
    yield
    tracemalloc.stop()


@FAST
@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 39), st.integers(1, 3))
def test_the_decoder_refuses_or_accepts_a_possible_pool(seed, k, rounds):
    frames, starts, _, _ = _corpus()
    rng = random.Random(seed)
    payload = frames[k].payload
    for _ in range(rounds):  # mutations on mutations
        payload = mutate_payload(rng, payload)
    bounded(decode_outcome, starts[k], payload)


@FAST
@given(st.integers(0, 39), st.sampled_from(EXTREME_INTS), st.integers(0, 2 ** 32 - 1))
def test_extreme_integers_anywhere_in_a_frame(k, value, seed):
    """Every integer of a real frame, one at a time (the draw picks which), replaced by an extreme one."""
    import msgspec

    from tools.mutate import nodes, set_at
    frames, starts, _, _ = _corpus()
    obj = msgspec.msgpack.decode(frames[k].payload)
    ints = [path for path, v in nodes(obj) if isinstance(v, int) and not isinstance(v, bool)]
    path = ints[random.Random(seed).randrange(len(ints))]
    payload = msgspec.msgpack.encode(set_at(obj, path, value))
    bounded(decode_outcome, starts[k], payload)


@settings(max_examples=80, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2 ** 32 - 1))
def test_the_recording_reader_refuses_or_reads_possible_pools(tmp_path, seed):
    _, _, data, spans = _corpus()
    rng = random.Random(seed)
    path = tmp_path / "fuzz.kvpool"
    path.write_bytes(mutate_recording(rng, data, spans))
    bounded(recording_outcome, str(path))


def test_the_mutations_reach_both_outcomes():
    """The fuzzer is worth its time: its inputs are refused for many reasons, and some are still accepted (a
    mutation that keeps the pool possible), so the decoder's acceptance path is exercised too."""
    frames, starts, data, spans = _corpus()
    rng = random.Random(1)
    outcomes = [decode_outcome(starts[k], mutate_payload(rng, frames[k].payload))
                for k in (rng.randrange(len(frames)) for _ in range(400))]
    assert outcomes.count("refused") > 100 and outcomes.count("accepted") > 10


@functools.lru_cache(maxsize=None)
def _corpus_v2():
    """Format-2 frames: the synthetic two-group pool with a host and a disk tier (keyframes every 8)."""
    from kvstream.poolstream import StreamDecoder
    from tests.poolstream_helpers import encode_all, synthetic_v2
    _, frames = encode_all(synthetic_v2(frames=40, seed=5), keyframe_interval=8)
    starts, dec = [], StreamDecoder()
    for f in frames:
        starts.append(dec.copy())
        dec.feed(f.payload)
    return frames, starts


@FAST
@given(st.integers(0, 2 ** 32 - 1), st.integers(0, 39), st.integers(1, 3))
def test_mutated_v2_frames_with_tiers_and_groups_are_refused_or_possible(seed, k, rounds):
    frames, starts = _corpus_v2()
    rng = random.Random(seed)
    payload = frames[k].payload
    for _ in range(rounds):
        payload = mutate_payload(rng, payload)
    bounded(decode_outcome, starts[k], payload)


@FAST
@given(st.integers(0, 39), st.sampled_from(EXTREME_INTS), st.integers(0, 2 ** 32 - 1))
def test_extreme_integers_anywhere_in_a_v2_frame(k, value, seed):
    import msgspec

    from tools.mutate import nodes, set_at
    frames, starts = _corpus_v2()
    obj = msgspec.msgpack.decode(frames[k].payload)
    ints = [path for path, v in nodes(obj) if isinstance(v, int) and not isinstance(v, bool)]
    path = ints[random.Random(seed).randrange(len(ints))]
    bounded(decode_outcome, starts[k], msgspec.msgpack.encode(set_at(obj, path, value)))
