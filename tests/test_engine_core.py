"""The engine core's promises: one writer whose events replay to the pool, operations that happen whole or not at
all (faults injected), chunked prefill that changes nothing but the schedule, parallel samples, owners."""
import os
import random

import numpy as np
import pytest
import torch

from engine import BlockState, Engine, EngineConfig, EngineError, FinishReason, Status
from kvstream.events import EventKind, PoolModel
from tests.helpers import fail_forward_on_call, write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("core")))


def make(ckpt, **kw):
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=ckpt, **kw))


def prompt(n, start=1):
    return [(start + 7 * i) % 90 + 1 for i in range(n)]


SHARED = prompt(10, start=3)  # a common "system prompt": two full blocks and a half at block size 4


def state_of(eng):
    """Everything observable about an engine, for before/after comparisons."""
    snap = eng.snapshot()
    return {
        "arrays": [a.tobytes() for a in (snap.ref_count, snap.num_filled, snap.state, snap.owner, snap.last_access,
                                         snap.block_hash)],
        "tables": dict(snap.block_tables), "conversations": snap.conversations, "step": snap.step_id,
        "version": snap.version, "kv": eng.kv.data.clone(), "metrics": snap.metrics,
        "free_queue": eng.pool.free_queue, "events": list(eng.manager.events),
        "waiting": [s.seq_id for s in eng.scheduler.waiting], "running": [s.seq_id for s in eng.scheduler.running],
    }


def assert_same(a, b):
    assert {k: v for k, v in a.items() if k != "kv"} == {k: v for k, v in b.items() if k != "kv"}
    assert torch.equal(a["kv"], b["kv"])


def random_workload(eng, rng, steps, replay=None):
    """Adds (some sharing a prefix), forks, replies, ends, relocations, prefix-cache resets and steps on a small
    pool (so preemption and eviction happen); calls replay(eng) after every operation."""
    ids = []
    for _ in range(steps):
        op = rng.random()
        live = [i for i in ids if i in eng.seqs and not eng.seqs[i].is_finished]
        finished = [i for i in ids if i in eng.seqs and eng.seqs[i].status == Status.FINISHED]
        try:
            if op < 0.18:
                tokens = (SHARED if rng.random() < 0.5 else []) + prompt(rng.randint(1, 14), rng.randint(1, 80))
                ids.append(eng.add_conversation(prompt_token_ids=tokens, max_new_tokens=rng.randint(1, 14),
                                                temperature=rng.choice([0.0, 0.9]), seed=rng.randint(0, 99)))
            elif op < 0.25 and live:
                ids.append(eng.fork_conversation(rng.choice(live)))
            elif op < 0.29:
                ids.extend(eng.add_samples(prompt_token_ids=SHARED + prompt(3), n=rng.randint(2, 3),
                                           max_new_tokens=rng.randint(2, 8), seed=rng.randint(0, 99)))
            elif op < 0.33 and finished:
                eng.continue_conversation(rng.choice(finished), prompt_token_ids=prompt(rng.randint(1, 5)),
                                          max_new_tokens=rng.randint(1, 6))
            elif op < 0.37 and ids:
                cid = rng.choice(ids)
                if cid in eng.seqs and eng.seqs[cid].status != Status.ENDED:
                    eng.end_conversation(cid)
            elif op < 0.41:
                eng.relocate_blocks(seed=rng.randint(0, 999), compact=rng.random() < 0.3)
            elif op < 0.43:
                if rng.random() < 0.5:
                    for cid in list(eng.seqs):
                        if eng.seqs[cid].status == Status.RUNNING:
                            eng.end_conversation(cid)
                eng.reset_prefix_cache()
            else:
                eng.step()
        except EngineError as exc:  # a reply that outgrew the pool or the model; a reset while blocks are held
            assert "pool" in str(exc) or "at most" in str(exc) or "reset only" in str(exc)
        if replay is not None:
            replay(eng)
    return ids


def test_events_replay_to_the_pool_at_every_step(ckpt):
    """A long random workload: replaying the events alone onto an empty pool gives the snapshot's state and ref
    counts after every operation, and the bookkeeping invariants hold throughout."""
    eng = make(ckpt, num_blocks=24, block_size=3)
    model = PoolModel(24)
    seen = set()

    def replay(eng):
        for event in eng.take_events():
            model.apply(event)
            seen.add(event.kind)
        snap = eng.snapshot()
        assert np.array_equal(model.state, snap.state)
        assert np.array_equal(model.ref_count, snap.ref_count)
        assert np.array_equal(model.hashed, snap.block_hash != 0)
        eng.check_invariants()

    random_workload(eng, random.Random(7), 600, replay)
    eng.run_until_idle()
    replay(eng)
    for kind in (EventKind.ALLOCATED, EventKind.SHARED, EventKind.COPIED_ON_WRITE, EventKind.STORED,
                 EventKind.RELEASED, EventKind.CACHED, EventKind.FREED, EventKind.EVICTED, EventKind.PREEMPTED,
                 EventKind.RELOCATED, EventKind.CLEARED, EventKind.CONVERSATION_ADDED,
                 EventKind.CONVERSATION_FINISHED, EventKind.CONVERSATION_ENDED, EventKind.CONVERSATION_CONTINUED):
        assert kind in seen, f"the workload never produced {kind.value}"


def test_changed_blocks_record_covers_every_change(ckpt):
    """Each snapshot's change record says which blocks may differ from the snapshot before it
    (Engine.change_record(snapshot).block_masks, from the block pool's record of what it wrote): through a long
    random workload (adds, forks, samples, replies, ends, relocations, prefix-cache resets, preemption, eviction)
    with failed steps among them, every entry of every array that differs lies inside the record; a record is made
    for most snapshots (the pool-stream encoder's fast path is the common one), never across a rollback, and narrows
    to the blocks really written."""
    from kvstream.poolstream import ARRAYS
    eng = make(ckpt, num_blocks=24, block_size=3)
    prev = eng.snapshot()
    seen = {"snapshots": 0, "promised": 0, "narrow": 0, "split": 0, "after_fault": 0}
    faults = random.Random(5)
    failed = [False]

    def replay(eng):
        nonlocal prev
        snap = eng.snapshot()
        if snap is prev:
            return
        seen["snapshots"] += 1
        record = eng.change_record(snap)
        if record.block_masks is not None:
            base, masks = record.base, record.block_masks
            assert base is prev and set(masks) == set(ARRAYS)
            for name in ARRAYS:
                mask = masks[name]
                assert not mask.flags.writeable and mask.shape == (24,)
                differ = np.asarray(getattr(snap, name) != getattr(base, name))
                assert not (differ & ~mask).any(), f"{name} changed outside the promise at {np.flatnonzero(differ & ~mask)}"
            assert not (masks["ref_count"] & ~masks["last_access"]).any()  # last_access's is the wider one
            seen["promised"] += 1
            seen["narrow"] += int(masks["last_access"].sum()) < 24
            seen["split"] += int(masks["ref_count"].sum()) < int(masks["last_access"].sum())  # after a step
            assert not failed[0], "a promise across a rolled-back step"
        failed[0] = False
        prev = snap
        if faults.random() < 0.05 and eng.has_work():  # a failed step: rolled back, the pool restored
            real, calls = eng.runner.forward, []

            def forward(prepared):
                calls.append(1)
                raise RuntimeError("injected fault in the forward")
            eng.runner.forward = forward
            try:
                eng.step()
            except RuntimeError:
                failed[0] = bool(calls)
            finally:
                del eng.runner.forward
            seen["after_fault"] += failed[0]

    random_workload(eng, random.Random(11), 600, replay)
    assert seen["after_fault"] >= 5, seen
    assert seen["promised"] >= 0.5 * seen["snapshots"] and seen["narrow"] >= 0.9 * seen["promised"], seen
    assert seen["split"] >= 50, seen


def test_a_pool_stepped_without_snapshots_keeps_a_bounded_record(ckpt):
    """An engine stepped without snapshots (a benchmark, generate()) does not pile up its record of changes: past
    a few steps it notes only that anything may have changed, and the next snapshot makes no promise."""
    eng = make(ckpt, num_blocks=64, block_size=4)
    eng.snapshot()
    for i in range(6):
        eng.add_conversation(prompt_token_ids=prompt(9, i + 1), max_new_tokens=40, ignore_eos=True)
    for _ in range(30):
        eng.step()
    assert eng.pool._all_changed and not eng.pool._touched and not eng.pool._changed
    held = eng.snapshot()
    assert eng.change_record(held).block_masks is None
    eng.step()
    record = eng.change_record(eng.snapshot())  # from there on, one step a snapshot: a record again
    assert record.base is held and 0 < record.block_masks["last_access"].sum() < 64
    assert eng.change_record(held).block_masks is None  # known only for the latest snapshot


def test_events_name_the_step_and_conversation(ckpt):
    eng = make(ckpt)
    a = eng.add_conversation(prompt_token_ids=SHARED, max_new_tokens=3)
    eng.step()
    b = eng.fork_conversation(a)
    eng.step()
    events = eng.take_events()
    assert events and all(e.step_id in (0, 1, 2) for e in events)
    added = [e for e in events if e.kind == EventKind.CONVERSATION_ADDED]
    assert [(e.conversation_id, e.other_id, e.reason) for e in added] == [(a, -1, ""), (b, a, "fork")]
    shared = [e for e in events if e.kind == EventKind.SHARED]
    assert shared[0].reason == "fork" and shared[0].block_ids[:2] == tuple(eng.conversation(b).block_table[:2])
    cow = [e for e in events if e.kind == EventKind.COPIED_ON_WRITE]
    assert len(cow) == 1 and cow[0].block_ids[0] == shared[0].block_ids[2]  # the half-filled tail was copied
    assert cow[0].conversation_id == a and eng.conversation(a).block_table[2] == cow[0].new_block_ids[0]
    stored = [e for e in events if e.kind == EventKind.STORED]
    assert stored[0].parent_hash is None and len(stored[0].token_ids) == 4 * len(stored[0].block_ids)
    assert eng.take_events() == []


# ---- whole or not at all ----------------------------------------------------------------------------------------
def busy_engine(ckpt, **kw):
    """Conversations in every state: decoding, mid-prefill (chunked), waiting, sharing, sampled."""
    eng = make(ckpt, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=6, **kw)
    eng.add_conversation(prompt_token_ids=SHARED + prompt(5), max_new_tokens=9, temperature=0.9, seed=1)
    eng.step()
    eng.add_conversation(prompt_token_ids=SHARED + prompt(30, 5), max_new_tokens=8)
    eng.add_samples(prompt_token_ids=prompt(7, 9), n=2, max_new_tokens=6, temperature=0.8, seed=3)
    eng.step()
    while not (partial := [s for s in eng.scheduler.running
                           if s.num_computed_tokens % 4 and s.num_uncomputed_tokens == 1]):
        eng.step()
    eng.fork_conversation(partial[0].seq_id)  # its half-filled tail is copied on the next write
    return eng


def finish(eng):
    eng.run_until_idle()
    return {c.conversation_id: c.output_token_ids for c in eng.conversations()}


@pytest.mark.parametrize("where", ["prepare", "copy", "forward", "sample", "native decode", "one-call step"])
def test_failed_step_changes_nothing(ckpt, where, monkeypatch):
    """A step that raises after admission, after copy-on-write, in the forward or in sampling leaves the engine as
    it was, and what follows is exactly what a run without the fault produces. "native decode": the native attention
    raises in the second (last) layer, after the native rotary pass wrote the step's K/V of both layers into the pool
    (the layer-by-layer loop). "one-call step": the decode step in one native call raises after it has written
    every layer's K/V."""
    from engine import native
    clean = busy_engine(ckpt)
    expected = finish(clean)
    eng = busy_engine(ckpt)
    before = state_of(eng)
    obj, name = {"prepare": (eng.runner, "prepare"), "copy": (eng.kv, "copy_blocks"),
                 "forward": (eng.runner, "forward"), "sample": (eng.runner, "sample"),
                 "native decode": (native, "decode"), "one-call step": (native, "decode_stack")}[where]
    calls, original = [], getattr(obj, name)

    def boom(*args, **kwargs):
        calls.append(1)
        if where == "native decode" and len(calls) < 2:
            return original(*args, **kwargs)
        if where == "one-call step":
            assert original(*args, **kwargs) is not None
        raise RuntimeError(f"injected fault in {name}")

    if where == "native decode":
        monkeypatch.setattr(native, "decode_stack", lambda *a: None)
    monkeypatch.setattr(obj, name, boom)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    monkeypatch.undo()
    assert_same(state_of(eng), before)
    assert finish(eng) == expected


def test_a_thread_out_of_scratch_memory_in_the_one_call_step_stops_the_team_and_changes_nothing(ckpt, monkeypatch):
    """The one-call decode step runs every kernel in one OpenMP region, a barrier between kernels (csrc/team.h).
    When one thread's attention scratch cannot be had, every thread leaves at the next barrier (none waits there
    for it forever), the step reports it and raises MemoryError, and the engine is as it was; what follows is what
    a run without the fault produces."""
    from engine import native
    lib = native.kernel()
    if lib is None:
        pytest.skip(f"no native kernel here: {native.error()}")
    clean = busy_engine(ckpt)
    expected = finish(clean)
    eng = busy_engine(ckpt)
    before = state_of(eng)
    answers, real = [], native.decode_stack
    monkeypatch.setattr(native, "decode_stack", lambda *a: answers.append(1) or real(*a))
    # layer 0's attention: the second thread's scratch (the first's with one thread: layer 1's)
    lib.kernels_fail_scratch(2)
    try:
        with pytest.raises(MemoryError, match="scratch"):
            eng.step()
    finally:
        lib.kernels_fail_scratch(0)
    assert answers  # the fault was met in the one-call step
    monkeypatch.undo()
    assert_same(state_of(eng), before)
    assert finish(eng) == expected


def test_failed_step_after_the_draw_draws_the_same_again(ckpt, monkeypatch):
    """The sampler has drawn every sampled row's token, then the step fails: nothing of the draw is kept (there is
    no sampler state to restore), and the retried step draws the same tokens as a run without the fault."""
    from engine.model import sampling
    clean = busy_engine(ckpt)
    expected = finish(clean)
    eng = busy_engine(ckpt)
    before = state_of(eng)
    drawn, real = [], sampling.sample

    def draw_then_fail(*args, **kwargs):
        drawn.append(real(*args, **kwargs))
        raise RuntimeError("injected fault after the draw")

    monkeypatch.setattr(sampling, "sample", draw_then_fail)
    with pytest.raises(RuntimeError, match="after the draw"):
        eng.step()
    monkeypatch.undo()
    assert drawn and drawn[0]  # the fault came after real draws
    assert_same(state_of(eng), before)
    assert finish(eng) == expected


def test_failed_step_after_eviction_restores_the_cache(ckpt, monkeypatch):
    """A step that evicts cached blocks and writes into them, then fails: the cached blocks come back with their
    K/V, and a later prompt hits them as if nothing happened."""
    eng = make(ckpt, num_blocks=12, block_size=4)
    eng.add_conversation(prompt_token_ids=prompt(20, 2), max_new_tokens=1)
    eng.run_until_idle()
    assert eng.pool.num_cached_blocks == 5
    eng.add_conversation(prompt_token_ids=prompt(40, 50), max_new_tokens=2)
    before = state_of(eng)
    calls = []
    real = eng.runner.forward

    def forward_then_fail(prepared):
        real(prepared)  # K/V really written into the evicted blocks
        calls.append(1)
        raise RuntimeError("injected fault after the forward")

    monkeypatch.setattr(eng.runner, "forward", forward_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    monkeypatch.undo()
    assert calls and eng.manager.num_evictions == 0
    assert_same(state_of(eng), before)


def _stepped(eng):
    eng.step()
    return eng


@pytest.mark.parametrize("where, fault, refusal, match", [
    ("kv.move_blocks", "DefaultCPUAllocator: can't allocate memory", EngineError, "memory"),
    ("manager.relocate", "injected fault while renaming", RuntimeError, "injected"),
])
def test_a_relocation_that_fails_changes_nothing(ckpt, monkeypatch, where, fault, refusal, match):
    """Relocation fails before the move (no memory for the copy: an EngineError) or after it (a fault while the
    tables are renamed: the error itself); either way the pool, the tables and the K/V are as they were, and decoding
    goes on to the tokens of an engine that never tried."""
    eng = _stepped(busy_engine(ckpt))
    expected = finish(_stepped(busy_engine(ckpt)))
    before = state_of(eng)
    owner, name = where.split(".")

    def broken(*args, **kwargs):
        raise RuntimeError(fault)

    monkeypatch.setattr(getattr(eng, owner), name, broken)
    with pytest.raises(refusal, match=match):
        eng.relocate_blocks(seed=3)
    monkeypatch.undo()
    assert_same(state_of(eng), before)
    assert finish(eng) == expected


def test_generate_is_atomic(ckpt, monkeypatch):
    eng = make(ckpt)
    eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=5)
    before = state_of(eng)
    with pytest.raises(EngineError, match="vocabulary"):
        eng.generate([[1, 2, 3], [999]])
    assert_same(state_of(eng), before)
    fail_forward_on_call(monkeypatch, eng, 3)
    with pytest.raises(RuntimeError, match="third"):
        eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=6)
    monkeypatch.undo()
    assert_same(state_of(eng), before)
    assert eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=6) == make(ckpt).generate([[1, 2, 3], [4, 5]], 6)


def _decoding(eng):
    """A running conversation that is decoding (its prompt computed): a fork of it shares its blocks at once."""
    return next(s.seq_id for s in eng.scheduler.running if s.num_uncomputed_tokens == 1)


def _with_finished(ckpt):
    """busy_engine stepped until one conversation has finished (a reply can go to it) while others still run."""
    eng = busy_engine(ckpt)
    while not [s for s in eng.seqs.values() if s.status == Status.FINISHED]:
        eng.step()
    return eng


def _with_waiting(ckpt):
    """busy_engine with a new conversation queued: a fork of it waits for its prompt (a pending fork)."""
    eng = busy_engine(ckpt)
    eng.add_conversation(prompt_token_ids=SHARED + prompt(6, 40), max_new_tokens=5)
    return eng


def _finished_id(eng):
    return min(s.seq_id for s in eng.seqs.values() if s.status == Status.FINISHED)


def _emit_failing(kind, nth=1):
    """A KVCacheManager.emit that raises at the nth event of ``kind`` (after everything before it happened)."""
    def patch(eng):
        real, seen = eng.manager.emit, []

        def emit(k, *args, **kwargs):
            if k == kind:
                seen.append(k)
                if len(seen) == nth:
                    raise RuntimeError(f"injected fault in emit({kind.value})")
            return real(k, *args, **kwargs)
        return eng.manager, "emit", emit
    return patch


def _raising(attr_path):
    def patch(eng):
        obj = eng
        *parents, name = attr_path.split(".")
        for part in parents:
            obj = getattr(obj, part)

        def boom(*args, **kwargs):
            raise RuntimeError(f"injected fault in {name}")
        return obj, name, boom
    return patch


def _run_now_after_fork(eng):
    """Scheduler.run_now raising after the manager already shared the parent's blocks with the child."""
    def boom(seq):
        assert eng.pool.ref_count[seq.block_table].min() > 1  # the blocks are shared by now
        raise RuntimeError("injected fault in run_now")
    return eng.scheduler, "run_now", boom


FAULTY_OPS = {  # name: (setup, operation, where the fault is injected)
    "add/scheduler.add": (busy_engine, lambda e: e.add_conversation(prompt_token_ids=prompt(9, 4), max_new_tokens=4),
                          _raising("scheduler.add")),
    "add/after queueing": (busy_engine,
                           lambda e: e.add_conversation(prompt_token_ids=prompt(9, 4), max_new_tokens=4),
                           _emit_failing(EventKind.CONVERSATION_ADDED)),
    "fork/manager.fork": (busy_engine, lambda e: e.fork_conversation(_decoding(e), seed=4),
                          _raising("manager.fork")),
    "fork/after sharing": (busy_engine, lambda e: e.fork_conversation(_decoding(e), seed=4), _run_now_after_fork),
    "fork/pending": (_with_waiting, lambda e: e.fork_conversation(max(e.seqs), seed=4), _raising("changed")),
    "continue/scheduler.add": (_with_finished, lambda e: e.continue_conversation(
        _finished_id(e), prompt_token_ids=prompt(3, 8), max_new_tokens=4), _raising("scheduler.add")),
    "continue/after queueing": (_with_finished, lambda e: e.continue_conversation(
        _finished_id(e), prompt_token_ids=prompt(3, 8), max_new_tokens=4),
        _emit_failing(EventKind.CONVERSATION_CONTINUED)),
    "add_samples/third sample": (busy_engine, lambda e: e.add_samples(
        prompt_token_ids=SHARED + prompt(4, 6), n=3, max_new_tokens=5, temperature=0.9, seed=8),
        _emit_failing(EventKind.CONVERSATION_ADDED, nth=3)),
    "add_samples/queueing the first": (busy_engine, lambda e: e.add_samples(
        prompt_token_ids=prompt(5, 6), n=2, max_new_tokens=5, seed=8), _raising("scheduler.add")),
}


@pytest.mark.parametrize("case", list(FAULTY_OPS))
def test_failed_add_fork_continue_and_samples_change_nothing(ckpt, case, monkeypatch):
    """add / fork / continue (reply) / add_samples with an inner call raising halfway (the scheduler queueing, the
    manager sharing blocks, an event after the conversation is queued, the third of three samples): the injected
    error reaches the caller unchanged, the engine is exactly as before (pool, K/V, tables, queues, events, ids),
    and the same operation done afterwards, and everything after it, gives what a run without the fault gives."""
    setup, op, inject = FAULTY_OPS[case]
    clean = setup(ckpt)
    clean_result = op(clean)
    expected = finish(clean)
    eng = setup(ckpt)
    before = state_of(eng)
    monkeypatch.setattr(*inject(eng))
    with pytest.raises(RuntimeError, match="injected fault"):
        op(eng)
    monkeypatch.undo()
    assert_same(state_of(eng), before)
    eng.check_invariants()
    assert op(eng) == clean_result  # the same ids again: nothing of the failed attempt was kept
    assert finish(eng) == expected
    a, b = eng.snapshot(), clean.snapshot()
    assert a.block_tables == b.block_tables and np.array_equal(a.state, b.state)
    assert np.array_equal(a.block_hash, b.block_hash) and torch.equal(eng.kv.data, clean.kv.data)


def test_dry_run_leaves_cache_bytes_alone(ckpt):
    eng = _stepped(busy_engine(ckpt))
    before = state_of(eng)
    report = eng.relocate_and_verify(seed=4, lookahead=4)
    assert report.max_abs_diff == 0.0 and report.tokens_identical and report.num_tokens_compared > 0
    after = state_of(eng)
    assert after["step"] == before["step"]
    assert [c.token_ids for c in after["conversations"]] == [c.token_ids for c in before["conversations"]]


def test_relocation_moves_only_what_is_used(ckpt):
    """K/V of non-free blocks move with them; free blocks' contents are never read or copied."""
    eng = _stepped(busy_engine(ckpt))
    used = np.flatnonzero(eng.pool.state != BlockState.FREE)
    data = {int(b): eng.kv.data[:, :, b].clone() for b in used}
    mapping = eng.relocate_blocks(seed=11)
    assert set(mapping) == set(data.keys())
    for old, new in mapping.items():
        assert torch.equal(eng.kv.data[:, :, new], data[old])


# ---- scheduling -------------------------------------------------------------------------------------------------
def test_chunked_prefill_gives_the_same_tokens(ckpt):
    prompts = [prompt(n, n) for n in (5, 40, 130, 17, 64)]
    whole = make(ckpt, num_blocks=256, enable_chunked_prefill=False, max_num_batched_tokens=4096)
    reference = whole.generate(prompts, max_new_tokens=12)
    for budget in (8, 16, 100):
        eng = make(ckpt, num_blocks=256, max_num_batched_tokens=budget, max_num_seqs=5)
        assert eng.generate(prompts, max_new_tokens=12) == reference
        eng.check_invariants()


def test_chunked_prefill_respects_the_budget_and_counts_prefix_hits(ckpt):
    eng = make(ckpt, num_blocks=128, max_num_batched_tokens=16, max_num_seqs=4)
    eng.add_conversation(prompt_token_ids=SHARED + prompt(2), max_new_tokens=2)
    eng.run_until_idle()
    cid = eng.add_conversation(prompt_token_ids=SHARED + prompt(50, 11), max_new_tokens=3)
    steps = 0
    while eng.conversation(cid).num_computed_tokens < len(SHARED) + 50:
        eng.step()
        steps += 1
        assert eng.metrics().last_step_prefill_tokens + eng.metrics().last_step_tokens <= 16 + 1
    assert eng.conversation(cid).num_cached_tokens == 8  # the two full blocks of the shared prompt
    assert steps == -(-(len(SHARED) + 50 - 8) // 16)
    m = eng.metrics()
    assert m.prefix_cache_hits == 8 and m.prefix_cache_queries == len(SHARED) + 2 + len(SHARED) + 50


def test_forks_respect_max_num_seqs(ckpt):
    eng = make(ckpt, max_num_seqs=2, max_num_batched_tokens=64)
    a = eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=20)
    eng.step()
    kids = [eng.fork_conversation(a) for _ in range(3)]
    assert len(eng.scheduler.running) == 2
    for _ in range(5):
        eng.step()
        assert len(eng.scheduler.running) <= 2
    assert eng.conversation(kids[0]).status == Status.RUNNING
    assert {eng.conversation(k).status for k in kids[1:]} == {Status.WAITING}
    eng.run_until_idle()
    assert all(len(eng.conversation(k).output_token_ids) == 20 for k in kids)


def test_add_samples_share_the_prompt_and_are_atomic(ckpt):
    eng = make(ckpt, num_blocks=64)
    ids = eng.add_samples(prompt_token_ids=SHARED + prompt(3), n=3, max_new_tokens=30, temperature=0.9, seed=5)
    assert len(ids) == 3 and all(eng.conversation(i).status == Status.WAITING for i in ids)
    eng.step()  # the prompt is computed once; the other two samples fork from it at once
    tables = [eng.conversation(i).block_table for i in ids]
    assert tables[0][:3] == tables[1][:3] == tables[2][:3]
    assert all(len(eng.conversation(i).output_token_ids) == 1 for i in ids)
    assert eng.metrics().num_prefill_tokens == len(SHARED) + 3
    eng.run_until_idle()
    outs = [eng.conversation(i).output_token_ids for i in ids]
    assert all(len(o) == 30 for o in outs) and len(set(outs)) == 3  # each its own random stream
    before = state_of(eng)
    with pytest.raises(EngineError, match="vocabulary"):
        eng.add_samples(prompt_token_ids=[5000], n=3)
    with pytest.raises(EngineError, match="n must be at least 1"):
        eng.add_samples(prompt_token_ids=[5], n=0)
    assert_same(state_of(eng), before)


def test_owner_moves_to_a_remaining_holder(ckpt):
    """Fork 9 into 10, end 9: 10's shared blocks now belong to 10 (they were 9's)."""
    eng = make(ckpt)
    for _ in range(9):
        eng.end_conversation(eng.add_conversation(prompt_token_ids=[1], max_new_tokens=1))
    nine = eng.add_conversation(prompt_token_ids=prompt(14), max_new_tokens=20)
    eng.step()
    ten = eng.fork_conversation(nine)
    assert (nine, ten) == (9, 10)
    eng.step()
    eng.end_conversation(nine)
    table = eng.snapshot().block_tables[ten]
    assert eng.snapshot().owner[list(table)].tolist() == [ten] * len(table)
    eng.check_invariants()


def test_finish_reasons(tmp_path, ckpt):
    eng = make(ckpt)
    a = eng.add_conversation(prompt_token_ids=prompt(5), max_new_tokens=3)
    b = eng.add_conversation(prompt_token_ids=prompt(5, 2), max_new_tokens=30)
    eng.step()
    eng.end_conversation(b)
    eng.run_until_idle()
    assert eng.conversation(a).finish_reason == FinishReason.LENGTH
    assert eng.conversation(b).finish_reason == FinishReason.ENDED
    first = eng.generate([prompt(5)], max_new_tokens=1)[0][0]
    eos = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "e", eos_token_id=first)), num_blocks=32))
    c = eos.add_conversation(prompt_token_ids=prompt(5), max_new_tokens=8)
    eos.run_until_idle()
    assert eos.conversation(c).finish_reason == FinishReason.EOS and eos.conversation(c).output_token_ids == (first,)
    eng.continue_conversation(a, prompt_token_ids=[7, 8], max_new_tokens=2)
    info = eng.conversation(a)
    assert info.finish_reason is None and info.turns == ((0, 5), (8, 10))


def test_finished_window_bounds_views(ckpt):
    eng = make(ckpt, finished_window=5)
    ids = [eng.add_conversation(prompt_token_ids=prompt(3, i), max_new_tokens=1) for i in range(12)]
    live = eng.add_conversation(prompt_token_ids=prompt(3), max_new_tokens=50)
    eng.run_until_idle(max_steps=4)
    shown = [c.conversation_id for c in eng.snapshot().conversations]
    assert shown == ids[-5:] + [live]
    with pytest.raises(EngineError, match="no conversation"):
        eng.conversation(ids[0])


def test_compile_attention_is_per_engine(ckpt):
    from engine import attention
    compiled = make(ckpt, compile_attention=True)
    plain = make(ckpt)
    assert compiled.runner.attend is attention.COMPILED and plain.runner.attend is attention.DEFAULT
    assert compiled.runner.attend.name == "compiled" and plain.runner.attend.name == "default"
    assert (attention.attend_batch, attention.attend_batch_compiled) == (attention.DEFAULT, attention.COMPILED)


def test_the_first_engine_freezes_the_startup_heap_and_is_still_collected_when_dropped():
    """In a fresh process: the objects alive before the first engine (the imported libraries) are frozen, so a full
    garbage collection no longer walks them, and that first engine (full of reference cycles, made after the
    freeze) is still collected when dropped, its K/V tensor with it. PAGED_KV_FREEZE_HEAP=0 turns the freeze off."""
    import subprocess
    import sys
    from pathlib import Path
    script = (
        "import gc, weakref\n"
        "from engine import Engine, EngineConfig\n"
        "tracked = len(gc.get_objects())\n"
        "eng = Engine(EngineConfig(model='builtin', num_blocks=64, block_size=16))\n"
        "frozen = gc.get_freeze_count()\n"
        "assert frozen >= 0.9 * tracked, (frozen, tracked)\n"
        "assert len(gc.get_objects()) < frozen / 4, (len(gc.get_objects()), frozen)\n"
        "eng.generate([[1, 2, 3]], max_new_tokens=3)\n"
        "refs = [weakref.ref(eng), weakref.ref(eng.model), weakref.ref(eng.kv.data)]\n"
        "del eng\n"
        "gc.collect()\n"
        "assert all(r() is None for r in refs), [r() is None for r in refs]\n"
        "print('ok', frozen)\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-2000:]
    off = ("import gc\n"
           "from engine import Engine, EngineConfig\n"
           "Engine(EngineConfig(model='builtin', num_blocks=64, block_size=16))\n"
           "print(gc.get_freeze_count())\n")
    env = {**os.environ, "PAGED_KV_FREEZE_HEAP": "0"}  # the caller's opt-out
    done = subprocess.run([sys.executable, "-c", off], cwd=root, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "0", done.stderr[-2000:]
