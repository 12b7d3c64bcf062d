"""Eviction policies under the pool's invariants and rollback (as LRU always was), what each one evicts, and the
miss causes an admission records, one test per cause."""
import numpy as np
import pytest
from hypothesis import settings

from engine import Engine, EngineConfig, EngineError
from engine.kv.policies import NAMES
from tests.helpers import write_tiny_checkpoint
from tests.test_engine_core import assert_same, state_of
from tests.test_groups import write_mixed_checkpoint
from tests.test_invariants import PoolMachine, _checkpoint


class HashFuture:
    """A stand-in for a trace's future: each hash's 'next use' is a fixed function of it."""

    def next_use(self, block_hash):
        return (block_hash * 2654435761) % 1000


def _engine(ckpt, policy, **kw):
    kw.setdefault("num_blocks", 24)
    kw.setdefault("block_size", 3)
    return Engine(EngineConfig(model=ckpt, eviction_policy=policy, **kw),
                  future=HashFuture() if policy == "belady" else None)


@pytest.mark.parametrize("policy", [p for p in NAMES if p != "lru"])
def test_policy_state_machine(tmp_path_factory, policy):
    """Adds, forks, ends, replies, steps, relocations and resets on a small pool under each policy: the pool's
    invariants and the policy's own hold after every rule, and the events replay to the same pool."""

    class Machine(PoolMachine):
        def __init__(self):
            super().__init__()
            self.eng = _engine(self.ckpt, policy, max_num_batched_tokens=256)

        def teardown(self):
            super().teardown()
            self.eng.check_invariants()

    Machine.ckpt = _checkpoint(tmp_path_factory)
    Machine.TestCase.settings = settings(max_examples=8, stateful_step_count=25, deadline=None)
    Machine.TestCase().runTest()


def _fill(eng, n, start=1):
    """Conversations that each leave two full blocks cached (6 tokens of prompt at block size 3)."""
    for i in range(n):
        eng.add_conversation(prompt_token_ids=[start + 10 * i + k for k in range(6)] + [99], max_new_tokens=1)
        eng.run_until_idle()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("policies"), vocab_size=256))


@pytest.mark.parametrize("policy", NAMES)
def test_a_failed_step_after_evictions_restores_the_policy_too(ckpt, policy, monkeypatch):
    """A step evicts under the policy, then fails: the pool and the policy's own state are as they were, so the
    retried step evicts the same blocks a run without the fault evicts."""
    clean = _engine(ckpt, policy)
    faulty = _engine(ckpt, policy)
    for eng in (clean, faulty):
        _fill(eng, 6)
        eng.add_conversation(prompt_token_ids=[200 + k for k in range(18)], max_new_tokens=2)
    before = state_of(faulty)
    policy_before = faulty.pool.policy.state()
    order_before = faulty.pool.next_free(24)
    real = faulty.runner.forward

    def forward_then_fail(prepared):
        real(prepared)
        raise RuntimeError("injected fault after the evictions")

    monkeypatch.setattr(faulty.runner, "forward", forward_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        faulty.step()
    monkeypatch.undo()
    assert_same(state_of(faulty), before)
    assert all(np.array_equal(a, b) for a, b in zip(faulty.pool.policy.state(), policy_before))
    assert faulty.pool.next_free(24) == order_before
    faulty.check_invariants()
    for eng in (clean, faulty):
        eng.run_until_idle()
    assert [e for e in clean.take_events() if e.kind == "evicted"][-3:] == \
        [e for e in faulty.take_events() if e.kind == "evicted"][-3:]
    assert clean.snapshot().block_hash.tolist() == faulty.snapshot().block_hash.tolist()


def _evicted_tokens(policy, ckpt):
    """Three conversations cache two blocks each; the first is hit again; then a long prompt needs 4 of them."""
    eng = _engine(ckpt, policy, num_blocks=12)
    _fill(eng, 3)
    eng.add_conversation(prompt_token_ids=[1, 2, 3, 4, 5, 6, 99], max_new_tokens=1)  # hits the first one's blocks
    eng.run_until_idle()
    records = {h: eng.pool.hashed[h].token_ids for h in eng.pool.hash_to_block}
    eng.take_events()
    eng.add_conversation(prompt_token_ids=list(range(100, 127)), max_new_tokens=1)
    eng.run_until_idle()
    return [records[h] for e in eng.take_events() if e.kind == "evicted" for h in e.block_hashes]


def test_lru_and_fifo_part_over_a_hit(ckpt):
    """The first conversation's blocks were hit again after the others were stored: LRU keeps them (used most
    recently), FIFO evicts them first (they entered first; hits do not refresh)."""
    lru, fifo = _evicted_tokens("lru", ckpt), _evicted_tokens("fifo", ckpt)
    first = {(1, 2, 3), (4, 5, 6)}
    assert len(lru) == len(fifo) == 3  # 28 tokens computed (the last output's K/V never is): 10 blocks, 3 evicted
    assert not first & set(lru)
    assert first <= set(fifo[:2])


def test_belady_needs_a_future(ckpt):
    with pytest.raises(EngineError, match="trace replay"):
        Engine(EngineConfig(model=ckpt, eviction_policy="belady"))
    with pytest.raises(EngineError, match="eviction_policy must be one of"):
        EngineConfig(eviction_policy="random")


# ---- why each prompt block missed (one test per cause) -----------------------------------------------------------
def _outcomes(eng, cid):
    return [o.outcome for o in eng.prompt_block_outcomes(cid)]


def _run(eng, tokens, new=1):
    cid = eng.add_conversation(prompt_token_ids=tokens, max_new_tokens=new)
    eng.run_until_idle()
    return cid


def test_cold_then_hits_on_the_device(ckpt):
    eng = _engine(ckpt, "lru", num_blocks=32)
    first = _run(eng, list(range(1, 14)))  # 4 full blocks and a partial one at block size 3
    assert _outcomes(eng, first) == ["cold"] * 4 + ["partial"]
    again = _run(eng, list(range(1, 14)) + [50])
    assert _outcomes(eng, again) == ["device"] * 4 + ["partial"]
    assert eng.conversation(again).prompt_block_outcomes == eng.prompt_block_outcomes(again)


def test_evicted_says_when_by_what_and_for_whom(ckpt):
    eng = _engine(ckpt, "fifo", num_blocks=12)
    first = _run(eng, list(range(1, 10)) + [200])  # 3 full blocks cached
    step_before = eng.step_id
    thief = _run(eng, list(range(100, 130)))  # needs 10 blocks: evicts the first one's
    back = _run(eng, list(range(1, 10)) + [201])
    evicted = [o for o in eng.prompt_block_outcomes(back) if o.outcome == "evicted"]
    assert evicted and evicted[0].index == 0
    o = evicted[0]
    assert o.evicted_by == "fifo" and o.evicted_for == thief and o.evicted_step > step_before
    assert o.idle_steps is not None and o.idle_steps >= 1
    assert first != thief


def test_after_break_is_held_but_recomputed(ckpt):
    eng = _engine(ckpt, "lru", num_blocks=32)
    _run(eng, list(range(1, 13)) + [90])  # blocks A B C D
    _run(eng, [70, 71, 72])  # something else cached
    cid = _run(eng, [5, 5, 5] + list(range(4, 13)) + [91])  # a different first block: B, C, D follow it
    assert _outcomes(eng, cid)[0] == "cold"
    # B, C, D have the same tokens but another prefix: their chained hashes differ, so they are cold too
    assert _outcomes(eng, cid)[1:4] == ["cold"] * 3
    same = _run(eng, list(range(1, 4)) + [9, 9, 9] + list(range(7, 13)) + [92])  # A hits, then a new block, C D
    outcomes = _outcomes(eng, same)
    assert outcomes[0] == "device" and outcomes[1] == "cold" and outcomes[2:4] == ["cold", "cold"]
    whole = _run(eng, list(range(1, 13)) + [93])
    assert _outcomes(eng, whole)[:4] == ["device"] * 4


def test_after_break_when_a_middle_block_was_evicted(ckpt):
    """FIFO evicts a prompt's first block (stored first) while its later blocks stay: asked again, the first block
    missed (evicted) and the later ones the pool still holds are recomputed (after_break) and kept meanwhile."""
    eng = _engine(ckpt, "fifo", num_blocks=8)
    first = list(range(1, 13)) + [90]
    _run(eng, first)  # A B C D cached, the partial tail freed
    _run(eng, list(range(200, 213)))  # needs one cached block: FIFO takes A, the oldest stored
    again = _run(eng, first)
    assert _outcomes(eng, again) == ["evicted", "after_break", "after_break", "after_break", "partial"]
    assert [e.kind for e in eng.take_events() if e.kind == "evicted"]  # its admission evicted others, not B C D


def test_last_token_of_a_prompt_held_whole(ckpt):
    eng = _engine(ckpt, "lru", num_blocks=32)
    _run(eng, list(range(1, 13)), new=2)  # exactly 4 full blocks
    again = _run(eng, list(range(1, 13)))
    assert _outcomes(eng, again) == ["device"] * 3 + ["last_token"]
    assert eng.conversation(again).num_cached_tokens == 9


def test_a_whole_prompt_after_a_miss_is_after_break_not_last_token(ckpt):
    """The last-token block of a prompt held whole is "last_token" only where every block before it was held: after
    an evicted first block it is recomputed because of that miss ("after_break"), as the prompt check
    (kvstream.prompt_check) and the vLLM tap say it."""
    eng = _engine(ckpt, "fifo", num_blocks=8)
    first = list(range(1, 13))  # exactly 4 full blocks
    _run(eng, first, new=2)
    _run(eng, list(range(200, 213)))  # FIFO takes the oldest stored block: the first one's block 0
    check = eng.check_prompt(prompt_token_ids=first)
    again = _run(eng, first)
    assert _outcomes(eng, again) == ["evicted", "after_break", "after_break", "after_break"]
    assert [b.outcome for b in check.blocks] == _outcomes(eng, again)


def test_hits_from_the_host_and_disk_tiers(ckpt, tmp_path):
    eng = _engine(ckpt, "lru", num_blocks=10, host_tier_blocks=2, disk_tier_blocks=8,
                  disk_tier_path=str(tmp_path / "disk.bin"))
    first = list(range(1, 10)) + [200]
    _run(eng, first)
    _run(eng, list(range(100, 128)), new=2)  # takes the whole pool: the first one's blocks go down the tiers
    back = _run(eng, first)
    outcomes = _outcomes(eng, back)
    assert set(outcomes[:3]) <= {"host", "disk"} and "disk" in outcomes[:3]
    eng.close()


def test_window_released_it(tmp_path):
    """A running conversation holds its full-attention blocks, but its sliding group let its early blocks go
    (cached) and another request's blocks pushed them out: a prompt of its first ten tokens finds the full-attention
    layers' blocks but not the window's, so it misses them all, because of the window."""
    ckpt = str(write_mixed_checkpoint(tmp_path / "mixed", window=4))
    eng = Engine(EngineConfig(model=ckpt, block_size=2, num_blocks=40))
    a = eng.add_conversation(prompt_token_ids=list(range(1, 25)), max_new_tokens=12)
    for _ in range(6):
        eng.step()
    assert eng.snapshot().group_block_tables[1][a][:12] == (-1,) * 12  # released by the window
    eng.add_conversation(prompt_token_ids=list(range(30, 48)), max_new_tokens=1)
    for _ in range(3):
        eng.step()
    c = eng.add_conversation(prompt_token_ids=list(range(1, 11)) + [90], max_new_tokens=1)
    for _ in range(3):
        eng.step()
    assert _outcomes(eng, c) == ["window"] * 5 + ["partial"]


@pytest.mark.parametrize("policy", [p for p in NAMES if p != "lru"])
def test_policy_state_machine_with_tiers(tmp_path_factory, policy):
    """The same rules on a pool with a host and a disk tier, each tier choosing by the policy too: every tier's
    bookkeeping and the policy's own invariants hold after every rule, and events rebuild every tier."""
    from tests.test_invariants import TieredPoolMachine

    class Machine(TieredPoolMachine):
        def __init__(self):
            super().__init__()
            self.eng.close()
            path = f"{self.disk_dir}/tier-{policy}-{id(self)}.bin"
            self.eng = Engine(EngineConfig(model=self.ckpt, block_size=3, num_blocks=24, max_num_batched_tokens=256,
                                           host_tier_blocks=4, disk_tier_blocks=6, disk_tier_path=path,
                                           eviction_policy=policy),
                              future=HashFuture() if policy == "belady" else None)

    Machine.ckpt = _checkpoint(tmp_path_factory)
    Machine.disk_dir = str(tmp_path_factory.mktemp(f"tiers-{policy}"))
    Machine.TestCase.settings = settings(max_examples=6, stateful_step_count=25, deadline=None)
    Machine.TestCase().runTest()


@pytest.mark.parametrize("policy, gone", [("lru", (4, 5, 6)), ("fifo", (1, 2, 3)), ("s3lru", (4, 5, 6))])
def test_a_tier_chooses_by_the_policy_too(policy, gone):
    """A host tier of three slots holds A, B and C; A is used again (loaded back); the next block to come in makes
    room by the policy: LRU and S3-LRU give up B (A was used since), FIFO gives up A (it entered first)."""
    from engine.kv.policies import make_policy
    from engine.kv.pool import HashedBlock, hash_block_tokens
    from engine.kv.tiers import HostTier
    tier = HostTier(3, 8)
    tier.use_policy(make_policy(policy))
    contents = [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    keys = [hash_block_tokens(None, c) for c in contents]

    def store(i, clock):
        slot = tier.free_slot()
        if slot is None:
            slot = tier.victim()
            tier.drop(slot, clock)
        tier.write(slot, np.zeros(8, np.uint8))
        tier.put(slot, keys[i], HashedBlock(contents[i], 0, None), clock)

    for i in range(3):
        store(i, i)
    tier.touch(tier.lookup(keys[0]), 5)
    victim = tier.victim()
    assert tuple(tier.records[int(tier.block_hash[victim])].token_ids) == gone
    store(3, 6)
    assert tier.lookup(hash_block_tokens(None, gone)) is None
    tier.check_invariants()
