"""The plugin's reading of a real vLLM scheduler (kvstream.vllm.tap), step by step, against vLLM's own state."""
from __future__ import annotations

import numpy as np
import pytest

from kvstream.events import EventKind, PoolModel
from kvstream.poolstream import StreamDecoder, StreamEncoder
from kvstream.views import BlockState, FinishReason, Status
from kvstream.vllm.tap import UnsupportedVllm, VllmPoolTap
from tests.vllm_live.reference import BLOCK_SIZE, compare, read_state, scheduler_of

PREFIX = "The block table maps each logical block of a sequence to a physical block. "  # 76 bytes: 2 full blocks


def params(**kw):
    from vllm import SamplingParams
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


class Run:
    """Steps vLLM and checks after every step that the tap's frame equals vLLM's state and that the events,
    replayed from an empty pool, give the same states and ref counts."""

    def __init__(self, engine, tap):
        self.engine, self.tap, self.scheduler = engine, tap, scheduler_of(engine)
        self.encoder, self.decoder = StreamEncoder(), StreamDecoder()  # what --attach and --open decode
        self.model = PoolModel(tap.num_blocks)
        self.events = []
        self.snapshots = []
        self.frame()

    def frame(self):
        snap, events = self.tap.frame()
        ids = [c.conversation_id for c in snap.conversations]
        assert ids == sorted(set(ids)), f"conversation ids repeat: {ids}"
        decoded, decoded_events, _ = self.decoder.feed(self.encoder.encode(snap, events).payload)
        assert list(decoded_events) == events
        snap = decoded
        for e in events:
            self.model.apply(e)  # raises on an impossible event
        self.events += events
        self.snapshots.append(snap)
        truth = read_state(self.scheduler)
        assert compare(snap, truth) == [], f"step {snap.step_id}"
        held = truth.state[1:] == BlockState.USED  # the replay knows nothing of the null block 0
        assert np.array_equal(self.model.state[1:], truth.state[1:]), f"step {snap.step_id}: replayed states"
        assert np.array_equal(self.model.ref_count[1:][held], truth.ref_count[1:][held])
        return snap, truth

    def until_idle(self, on_step=None, max_steps=2000):
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                return
            self.engine.step()
            snap, truth = self.frame()
            if on_step is not None:
                on_step(snap, truth)
        raise AssertionError("vLLM did not finish")

    def kinds(self):
        return [e.kind for e in self.events]


@pytest.fixture
def tap(engine):
    t = VllmPoolTap(scheduler_of(engine), on_error=lambda exc: pytest.fail(f"tap failed: {exc!r}"))
    yield t
    t.detach()


def test_shared_prefix_and_samples_match_vllm_every_step(engine, tap):
    run = Run(engine, tap)
    engine.add_request("a", PREFIX + "first question", params(max_tokens=40))
    engine.add_request("b", PREFIX + "a second, longer question", params(max_tokens=40))
    engine.add_request("c", "Fork this prompt into three samples. " * 2, params(max_tokens=30, n=3, temperature=1.0,
                                                                                 seed=7))
    peak_ref = []
    run.until_idle(lambda snap, truth: peak_ref.append(int(snap.ref_count.max())))

    convs = {c.label: c for c in run.snapshots[-1].conversations}
    assert len(convs) == 5 and all(c.status == Status.FINISHED and c.finish_reason == FinishReason.LENGTH
                                   for c in convs.values())
    a, b = next(c for c in convs.values() if c.label.startswith("a-")), \
        next(c for c in convs.values() if c.label.startswith("b-"))
    samples = sorted((c for c in convs.values() if c.label.endswith(tuple(
        rid.split("_", 1)[1] for rid in convs if rid.startswith("0_")))), key=lambda c: c.conversation_id)
    assert [c.label.split("_")[0] for c in samples] == ["0", "1", "2"]
    assert [c.parent_id for c in samples] == [None, samples[0].conversation_id, samples[0].conversation_id]
    assert len(a.output_token_ids) == 40 and len(samples[2].output_token_ids) == 30
    # b found a's two prefix blocks in the cache; the samples share their prompt's full block three ways
    hits = [e for e in run.events if e.kind == EventKind.SHARED]
    assert any(e.conversation_id == b.conversation_id and len(e.block_ids) == 2 for e in hits)
    assert {e.conversation_id for e in hits} >= {b.conversation_id, samples[1].conversation_id,
                                                 samples[2].conversation_id}
    assert max(peak_ref) == 3
    added = [e for e in run.events if e.kind == EventKind.CONVERSATION_ADDED]
    assert [e.reason for e in added].count("sample") == 2
    # stored blocks carry vLLM's tokens: a's first block is its first 32 prompt tokens
    first = next(e for e in run.events if e.kind == EventKind.STORED and e.conversation_id == a.conversation_id)
    assert first.parent_hash is None and first.token_ids[:BLOCK_SIZE] == a.prompt_token_ids[:BLOCK_SIZE]
    # after the last finish: nothing held but the null block; every hashed block is cached, none lost
    final, truth = run.snapshots[-1], read_state(run.scheduler)
    assert dict(final.block_tables) == {}
    assert final.memory.num_used_blocks == 1 and final.memory.num_cached_blocks == len(truth.stored_hashes) > 0
    assert set(final.block_hash[final.state == BlockState.CACHED].tolist()) == truth.stored_hashes
    m = final.metrics
    assert m.num_generated_tokens == 40 + 40 + 3 * 30
    assert m.prefix_cache_hits >= 2 * BLOCK_SIZE and m.prefix_cache_queries == sum(
        len(c.prompt_token_ids) for c in convs.values())


def test_preemption_and_eviction_match_vllm(engine, tap):
    """Eight requests of 4 prompt + 6 output blocks each cannot all fit 40 blocks: vLLM evicts cached blocks and
    preempts the newest requests; the tap agrees with it through all of it."""
    run = Run(engine, tap)
    engine.add_request("warm", "cached blocks to evict later " * 5, params(max_tokens=1))
    run.until_idle()
    for i in range(8):
        engine.add_request(f"r{i}", f"request {i} with a long prompt " * 4, params(max_tokens=190))
    run.until_idle()
    kinds = run.kinds()
    assert EventKind.PREEMPTED in kinds and EventKind.EVICTED in kinds
    final = run.snapshots[-1]
    preempted = [e for e in run.events if e.kind == EventKind.PREEMPTED]
    assert final.metrics.num_preemptions == len(preempted) == sum(c.num_preemptions for c in final.conversations)
    assert final.metrics.num_evictions == sum(len(e.block_ids) for e in run.events if e.kind == EventKind.EVICTED)
    assert all(len(c.output_token_ids) == 190 for c in final.conversations if c.label.startswith("r"))


def test_abort_between_steps_and_prefix_cache_reset(engine, tap):
    run = Run(engine, tap)
    engine.add_request("keep", PREFIX * 2, params(max_tokens=20))
    engine.add_request("drop", PREFIX + "to be aborted", params(max_tokens=200))
    for _ in range(5):
        engine.step()
        run.frame()
    rid = next(r for r in run.scheduler.requests if r.startswith("drop-"))
    engine.abort_request([rid], internal=True)
    snap, truth = run.frame()
    ended = [e for e in run.events if e.kind == EventKind.CONVERSATION_ENDED]
    assert len(ended) == 1 and snap.conversation(ended[0].conversation_id).status == Status.ENDED
    assert ended[0].conversation_id not in snap.block_tables
    run.until_idle()
    assert engine.reset_prefix_cache()
    snap, truth = run.frame()
    assert run.events[-1].kind == EventKind.CLEARED
    assert snap.memory.num_cached_blocks == 0 and not np.any(snap.hashes()) and truth.stored_hashes == set()


def test_tap_failure_leaves_vllm_as_without_it(engine):
    """A fault inside the tap's bookkeeping detaches it; vLLM's outputs are those of a run without any tap."""
    scheduler = scheduler_of(engine)
    prompts = [PREFIX + "one", PREFIX + "two"]

    def generate():
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}", p, params(max_tokens=24))
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = list(out.outputs[0].token_ids)
        engine.reset_prefix_cache()
        return outs

    plain = generate()
    errors = []
    tap = VllmPoolTap(scheduler, on_error=errors.append)

    def broken(blocks):
        raise RuntimeError("injected fault")
    tap._on_freed = broken
    try:
        assert generate() == plain
    finally:
        tap.detach()
    assert len(errors) == 1 and "injected fault" in str(errors[0]) and not tap.attached
    assert "free_blocks" not in vars(scheduler.kv_cache_manager.block_pool)
    assert "schedule" not in vars(scheduler)


def test_detach_restores_every_method(engine):
    scheduler = scheduler_of(engine)
    objects = (scheduler, scheduler.kv_cache_manager.block_pool,
               scheduler.kv_cache_manager.coordinator.single_type_managers[0])
    before = [set(vars(o)) for o in objects]
    tap = VllmPoolTap(scheduler)
    assert "update_from_output" in vars(scheduler) and "touch" in vars(objects[1])
    tap.detach()
    assert [set(vars(o)) for o in objects] == before


def test_unsupported_version_is_refused_untouched(engine):
    scheduler = scheduler_of(engine)
    before = set(vars(scheduler))
    with pytest.raises(UnsupportedVllm, match=r"vLLM 0\.20\.1 is not a supported version"):
        VllmPoolTap(scheduler, version="0.20.1")
    assert set(vars(scheduler)) == before
    tap = VllmPoolTap(scheduler, version="0.20.1", any_version=True)  # internals checked instead
    tap.detach()
