"""A real-engine workload for the pool-stream tests, and the exact comparison of two snapshots.

The workload runs once per test process (lru_cache) and is shared by test_poolstream, test_recording and
test_publish: a tiny random Llama checkpoint, a pool small enough to preempt and evict, blocks of 4, conversations
that share a prefix, forks (copy-on-write), ends, replies (continue_conversation) and relocations, with the
engine's block events once it has them.
"""
from __future__ import annotations

import functools
import random
import tempfile
from pathlib import Path

import numpy as np

from kvstream.events import BlockEvent, EventKind
from kvstream.poolstream import decode as poolstream_decode
from kvstream.poolstream import ARRAYS, StreamEncoder
from kvstream.views import PoolSnapshot

SCALARS = ("step_id", "block_size", "num_blocks", "metrics", "memory", "model_name", "max_model_len", "device",
           "version", "source")
WORKLOAD_FRAMES = 260  # frames of the shared workload


def assert_same_snapshot(want: PoolSnapshot, got: PoolSnapshot, where: str = "") -> None:
    """Every field equal; arrays equal in value and dtype; block tables and conversations equal and in order."""
    for name in ARRAYS:
        a, b = getattr(want, name), getattr(got, name)
        if a is None or b is None:
            assert a is None and b is None, f"{where}: {name} is {a!r} vs {b!r}"
            continue
        assert a.dtype == b.dtype, f"{where}: {name} dtype {a.dtype} vs {b.dtype}"
        assert np.array_equal(a, b), f"{where}: {name} differs at {np.flatnonzero(a != b)[:10]}"
        assert not b.flags.writeable, f"{where}: decoded {name} is writable"
    for name in SCALARS:
        assert getattr(want, name) == getattr(got, name), f"{where}: {name} {getattr(want, name)!r} vs " \
                                                          f"{getattr(got, name)!r}"
    assert list(want.block_tables.items()) == list(got.block_tables.items()), f"{where}: block tables differ"
    assert want.conversations == got.conversations, f"{where}: conversations differ"
    for a, b in zip(want.conversations, got.conversations):
        assert type(a.status) is type(b.status) and type(a.finish_reason) is type(b.finish_reason), where


def _synthetic_events(step: int, before: PoolSnapshot, after: PoolSnapshot) -> list[BlockEvent]:
    """Events an engine without take_events() would have emitted, roughly (blocks that changed state)."""
    out = []
    newly_used = np.flatnonzero((after.state == 1) & (before.state != 1))
    if newly_used.size:
        out.append(BlockEvent(step, EventKind.ALLOCATED, block_ids=tuple(int(b) for b in newly_used)))
    freed = np.flatnonzero((after.state == 0) & (before.state != 0))
    if freed.size:
        out.append(BlockEvent(step, EventKind.FREED, block_ids=tuple(int(b) for b in freed)))
    return out


@functools.lru_cache(maxsize=None)
def workload(frames: int = WORKLOAD_FRAMES, seed: int = 0) -> tuple[tuple[PoolSnapshot, tuple[BlockEvent, ...]], ...]:
    """(snapshot, events since the previous frame) after every step and every command that changed something."""
    from engine import Engine, EngineConfig, EngineError

    from tests.helpers import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="poolstream-ckpt-")), seed=seed)
    eng = Engine(EngineConfig(model=str(ckpt), block_size=4, num_blocks=48, seed=seed))
    take = getattr(eng, "take_events", None)
    rng = random.Random(seed)
    shared = [rng.randrange(97) for _ in range(9)]  # a common prefix: two full blocks of 4 to share
    out: list = []
    ids: list[int] = []
    last = eng.snapshot()

    def frame() -> None:
        nonlocal last
        snap = eng.snapshot()
        events = tuple(take()) if take is not None else tuple(_synthetic_events(snap.step_id, last, snap))
        if take is not None and not events and snap.version and snap.version == last.version:
            return  # nothing changed: the runner publishes no frame
        out.append((snap, events))
        last = snap

    while len(out) < frames:
        r = rng.random()
        try:
            if r < 0.12 or not ids:
                prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(97) for _ in range(rng.randrange(1, 14))]
                ids.append(eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=rng.randrange(2, 40),
                                                temperature=rng.choice([0.0, 0.9]), seed=rng.randrange(1000)))
            elif r < 0.18:
                ids.append(eng.fork_conversation(rng.choice(ids), seed=rng.randrange(1000)))
            elif r < 0.21:
                eng.end_conversation(rng.choice(ids))
            elif r < 0.24:
                eng.continue_conversation(rng.choice(ids), prompt_token_ids=[rng.randrange(97) for _ in range(3)],
                                          max_new_tokens=rng.randrange(2, 12))
            elif r < 0.265:
                eng.relocate_blocks(seed=rng.randrange(1000))
            else:
                eng.step()
        except EngineError:
            continue  # a fork of a finished conversation, a reply to a running one: refused, nothing changed
        frame()
    return tuple(out)


def encode_all(snapshots, keyframe_interval: int = 16, **kwargs):
    enc = StreamEncoder(keyframe_interval=keyframe_interval, **kwargs)
    return enc, [enc.encode(snap, events) for snap, events in snapshots]


def count_keyframe_decodes(monkeypatch) -> list[int]:
    """The seqs of the keyframes decoded whole from now on (a decoder going on through a bridge decodes none)."""
    rebuilt: list[int] = []
    real = poolstream_decode._keyframe_state
    monkeypatch.setattr(poolstream_decode, "_keyframe_state", lambda head, body: rebuilt.append(head.seq) or real(head, body))
    return rebuilt


def assert_scrubs_forward_through_bridges(history, snaps, rebuilt: list[int]) -> None:
    """Forward through ``history`` in strides that cross a keyframe every other step: every frame equals the
    engine's, and only the first keyframe was decoded whole (``rebuilt``: from count_keyframe_decodes)."""
    for seq in range(3, len(snaps), 5):
        assert_same_snapshot(snaps[seq][0], history.snapshot_at(seq), f"frame {seq}")
    assert rebuilt == [0]
