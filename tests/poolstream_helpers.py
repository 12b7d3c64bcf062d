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
    return tuple((snap, events) for snap, events, _ in _run(frames, seed))


def workload_updates(frames: int = WORKLOAD_FRAMES, seed: int = 0) -> tuple[tuple, ...]:
    """:func:`workload` with each frame's change record, as the runner hands them: (snapshot, events, record)."""
    return _run(frames, seed)


@functools.lru_cache(maxsize=None)
def _run(frames: int, seed: int) -> tuple[tuple, ...]:  # one cache key however the caller spells the arguments
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
        out.append((snap, events, eng.change_record(snap)))
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
    """Every frame of ``snapshots``: (snapshot, events) pairs, or (snapshot, events, change record) triples."""
    enc = StreamEncoder(keyframe_interval=keyframe_interval, **kwargs)
    return enc, [enc.encode(*update) for update in snapshots]


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


def assert_same_v2(want: PoolSnapshot, got: PoolSnapshot, where: str = "") -> None:
    """The format-2 parts equal too: groups, group tables, block_group, tiers, conversations' new fields."""
    assert_same_snapshot(want, got, where)
    assert want.kv_cache_groups == got.kv_cache_groups, where
    assert [list(g.items()) for g in want.group_block_tables] == [list(g.items()) for g in got.group_block_tables], \
        f"{where}: group tables differ"
    if want.block_group is None:
        assert got.block_group is None, where
    else:
        assert got.block_group.dtype == want.block_group.dtype and np.array_equal(want.block_group, got.block_group), \
            f"{where}: block_group differs"
    assert sorted(want.tiers) == sorted(got.tiers), where
    for name, tier in want.tiers.items():
        other = got.tiers[name]
        assert tier.num_blocks == other.num_blocks, where
        for a in ("state", "block_hash", "last_access"):
            x, y = getattr(tier, a), getattr(other, a)
            assert x.dtype == y.dtype and np.array_equal(x, y), f"{where}: tier {name} {a} differs"
    for a, b in zip(want.conversations, got.conversations):
        assert a.group_block_tables == b.group_block_tables and \
            dict(a.prompt_token_sources) == dict(b.prompt_token_sources), where


def synthetic_v2(frames: int = 60, seed: int = 0, num_blocks: int = 40, block_size: int = 4, window: int = 8,
                 host: int = 16, disk: int = 8) -> list[tuple[PoolSnapshot, tuple[BlockEvent, ...]]]:
    """A two-group pool (full attention, a sliding window of ``window``) with a host and a disk tier, as a producer
    would publish it: conversations grow, their sliding-group blocks leave the window as -1 holes, finished ones
    free theirs, blocks move between the tiers. Every frame is a pool that can exist (the validator's rules)."""
    from kvstream.views import BlockState, ConversationInfo, KVCacheGroupInfo, Status, TierView

    rng = random.Random(seed)
    groups = (KVCacheGroupInfo("full_attention", None, (0, 2)), KVCacheGroupInfo("sliding_window", window, (1, 3)))
    convs: dict[int, dict] = {}  # cid -> {"tokens": n, "tables": [list, list]}
    free = list(range(num_blocks))
    tier_state = {"host": np.zeros(host, np.int8), "disk": np.zeros(disk, np.int8)}
    tier_hash = {"host": np.zeros(host, np.uint64), "disk": np.zeros(disk, np.uint64)}
    tier_last = {"host": np.zeros(host, np.int64), "disk": np.zeros(disk, np.int64)}
    out = []
    next_id = 0
    for step in range(frames):
        events = []
        if rng.random() < 0.3 or not convs:  # a new conversation
            convs[next_id] = {"tokens": 0, "tables": [[], []], "prompt": [rng.randrange(97) for _ in range(5)]}
            next_id += 1
        for cid in list(convs):
            c = convs[cid]
            if rng.random() < 0.08:  # finished: its blocks go back
                for g, t in enumerate(c["tables"]):
                    ids = [b for b in t if b != -1]
                    free.extend(ids)
                    if ids:
                        events.append(BlockEvent(step, EventKind.FREED, cid, tuple(ids), group=g))
                del convs[cid]
                continue
            c["tokens"] += rng.randrange(1, 4)
            need = -(-c["tokens"] // block_size)
            for g in range(2):
                t = c["tables"][g]
                while len(t) < need and free:
                    b = free.pop(rng.randrange(len(free)))
                    t.append(b)
                    events.append(BlockEvent(step, EventKind.ALLOCATED, cid, (b,), group=g))
            # the sliding group: blocks wholly before position tokens - window are released
            t = c["tables"][1]
            first_kept = max(0, c["tokens"] - window) // block_size
            for i in range(min(first_kept, len(t))):
                if t[i] != -1:
                    free.append(t[i])
                    events.append(BlockEvent(step, EventKind.FREED, cid, (t[i],), group=1, reason="sliding_window"))
                    t[i] = -1
        for tier in ("host", "disk"):  # a block offloaded, one dropped
            st, h = tier_state[tier], tier_hash[tier]
            slot = rng.randrange(st.size)
            if st[slot] == BlockState.FREE:
                st[slot], h[slot] = BlockState.CACHED, rng.randrange(1, 2 ** 64)
                tier_last[tier][slot] = step
                events.append(BlockEvent(step, EventKind.OFFLOADED, block_hashes=(int(h[slot]),), tier=tier,
                                         tier_slots=(slot,)))
            else:
                events.append(BlockEvent(step, EventKind.DROPPED, block_hashes=(int(h[slot]),), tier=tier,
                                         tier_slots=(slot,)))
                st[slot], h[slot] = BlockState.FREE, 0
        state = np.zeros(num_blocks, np.int8)
        ref = np.zeros(num_blocks, np.int32)
        filled = np.zeros(num_blocks, np.int32)
        owner = np.full(num_blocks, -1, np.int32)
        group = np.zeros(num_blocks, np.int8)
        infos = []
        gtables: list[dict] = [{}, {}]
        for cid, c in convs.items():
            for g, t in enumerate(c["tables"]):
                for i, b in enumerate(t):
                    if b == -1:
                        continue
                    state[b], ref[b], owner[b], group[b] = BlockState.USED, 1, cid, g
                    filled[b] = min(block_size, c["tokens"] - i * block_size)
                if t:
                    gtables[g][cid] = tuple(t)
            tabs = tuple(tuple(t) for t in c["tables"])
            infos.append(ConversationInfo(
                cid, Status.RUNNING, tuple(c["prompt"]), (), "", "", tabs[0], c["tokens"], 0, 64, 0.0, None, 0, 0,
                group_block_tables=tabs, prompt_token_sources={"device": 0, "host": 4, "disk": 0, "computed": 1}))
        tiers = {name: TierView(tier_state[name].size, tier_state[name].copy(), tier_hash[name].copy(),
                                tier_last[name].copy()) for name in ("host", "disk")}
        snap = PoolSnapshot(step_id=step, block_size=block_size, num_blocks=num_blocks, ref_count=ref,
                            num_filled=filled, state=state, owner=owner,
                            last_access=np.full(num_blocks, step, np.int64),
                            block_tables=dict(gtables[0]), conversations=tuple(infos), version=step + 1,
                            source="engine", kv_cache_groups=groups, group_block_tables=tuple(gtables),
                            block_group=group, tiers=tiers)
        for a in (ref, filled, state, owner, group):
            a.setflags(write=False)
        out.append((snap, tuple(events)))
    return out


def install_fake_tap(monkeypatch) -> None:
    """Let ``kvstream.vllm.plugin.attach`` run without vLLM: a tap module whose tap hands out the shared workload's
    first pool, so a test can look at what the plugin binds, logs and publishes."""
    import sys
    import types

    class Tap:
        num_blocks, block_size, pending, idle = 4, 16, False, True
        after_step = _on_error = None
        scheduler = None

        def __init__(self, scheduler, **_):
            self.scheduler = scheduler

        def frame(self):
            return workload()[0][0], []

        def detach(self):
            pass

    fake_tap = types.ModuleType("kvstream.vllm.tap")
    fake_tap.VllmPoolTap, fake_tap.UnsupportedVllm = Tap, RuntimeError
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.0-test"))
    monkeypatch.setitem(sys.modules, "kvstream.vllm.tap", fake_tap)
