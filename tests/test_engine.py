"""Engine behaviour: prefix sharing, fork with copy-on-write, preemption, relocation, replies, bad input."""
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import BlockState, Engine, EngineConfig, EngineError, Status
from kvstream.views import HashReason
from tests.helpers import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def make(ckpt, **kw):
    kw.setdefault("num_blocks", 128)
    kw.setdefault("block_size", 4)
    return Engine(EngineConfig(model=ckpt, **kw))


def prompt(n, start=1):
    return [(start + 7 * i) % 90 + 1 for i in range(n)]


def run_alone(ckpt, tokens, max_new, **kw):
    eng = make(ckpt, **kw)
    return eng.generate([tokens], max_new_tokens=max_new)[0]


def test_outputs_vary(ckpt):
    # the tiny model must not be degenerate, or "identical outputs" would prove nothing
    out = run_alone(ckpt, prompt(9), 20)
    assert len(set(out)) >= 5


def test_block_allocation_on_demand(ckpt):
    eng = make(ckpt, block_size=4)
    cid = eng.add_conversation(prompt_token_ids=prompt(4), max_new_tokens=3)
    eng.step()  # prefill 4 tokens: one full block
    info = eng.conversation(cid)
    assert len(info.block_table) == 1 and info.num_computed_tokens == 4
    eng.step()  # the 5th position takes a second block, 1 of 4 slots filled
    info = eng.conversation(cid)
    assert len(info.block_table) == 2
    snap = eng.snapshot()
    assert snap.num_filled[info.block_table[0]] == 4 and snap.num_filled[info.block_table[1]] == 1


def test_prefix_sharing(ckpt):
    prefix = prompt(40, start=3)
    a_tokens, b_tokens = prefix + [5, 6, 7], prefix + [9, 8]
    eng = make(ckpt, block_size=16)
    a = eng.add_conversation(prompt_token_ids=a_tokens, max_new_tokens=6)
    eng.step()
    b = eng.add_conversation(prompt_token_ids=b_tokens, max_new_tokens=6)
    eng.step()
    ta, tb = eng.conversation(a).block_table, eng.conversation(b).block_table
    snap = eng.snapshot()
    assert ta[:2] == tb[:2] and ta[2] != tb[2]
    assert snap.ref_count[list(ta[:2])].tolist() == [2, 2]
    assert snap.ref_count[ta[2]] == 1 and snap.ref_count[tb[2]] == 1
    assert int((snap.ref_count == 2).sum()) == 2
    assert eng.conversation(b).num_cached_tokens == 32
    eng.run_until_idle()
    off = make(ckpt, block_size=16, enable_prefix_caching=False)
    assert off.generate([a_tokens, b_tokens], max_new_tokens=6) == [
        list(eng.conversation(a).output_token_ids), list(eng.conversation(b).output_token_ids)]


def test_fork_copy_on_write(ckpt):
    tokens = prompt(10)
    eng = make(ckpt, block_size=4)
    parent = eng.add_conversation(prompt_token_ids=tokens, max_new_tokens=12)
    eng.step()
    eng.step()  # 11 tokens computed: blocks 0,1 full, block 2 holds 3 of 4 slots
    child = eng.fork_conversation(parent)
    shared = eng.conversation(parent).block_table
    assert eng.conversation(child).block_table == shared
    assert eng.snapshot().ref_count[list(shared)].tolist() == [2, 2, 2]
    eng.step()
    pt, ct = eng.conversation(parent).block_table, eng.conversation(child).block_table
    assert eng.metrics().num_cow_copies == 1
    assert pt[:2] == ct[:2] and pt[2] != ct[2]  # the appended-to tail was copied, the full blocks stay shared
    snap = eng.snapshot()
    assert snap.ref_count[list(pt[:2])].tolist() == [2, 2] and snap.ref_count[pt[2]] == 1
    eng.run_until_idle()
    reference = run_alone(ckpt, tokens, 12)
    assert list(eng.conversation(parent).output_token_ids) == reference
    assert list(eng.conversation(child).output_token_ids) == reference
    assert eng.conversation(child).parent_id == parent


def test_fork_leaves_sampled_parent_alone(ckpt):
    def sampled(fork):
        eng = make(ckpt)
        cid = eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=15, temperature=1.0, seed=42)
        eng.step()
        kid = eng.fork_conversation(cid) if fork else None
        eng.run_until_idle()
        return eng.conversation(cid).output_token_ids, (eng.conversation(kid) if fork else None)

    alone, _ = sampled(False)
    with_fork, kid = sampled(True)
    assert alone == with_fork
    assert kid.temperature == 1.0 and kid.max_new_tokens == 15 and len(kid.output_token_ids) == 15
    assert kid.output_token_ids != with_fork  # its own random stream


def test_preemption_recompute(ckpt):
    prompts = [prompt(n, start=n) for n in (9, 14, 5, 11, 7, 13)]
    big = make(ckpt, num_blocks=256).generate(prompts, max_new_tokens=16)
    small = make(ckpt, num_blocks=14)
    ids = [small.add_conversation(prompt_token_ids=p, max_new_tokens=16) for p in prompts]
    small.run_until_idle(max_steps=2000)
    assert small.metrics().num_preemptions > 0
    assert [list(small.conversation(i).output_token_ids) for i in ids] == big
    assert all(small.conversation(i).status == Status.FINISHED for i in ids)


def test_relocation_mid_generation(ckpt):
    prompts = [prompt(n, start=n) for n in (9, 14, 5)]
    reference = make(ckpt).generate(prompts, max_new_tokens=20)
    eng = make(ckpt)
    ids = [eng.add_conversation(prompt_token_ids=p, max_new_tokens=20) for p in prompts]
    for _ in range(6):
        eng.step()
    before = {i: eng.conversation(i).block_table for i in ids}
    report = eng.relocate_and_verify(seed=3, lookahead=3)
    assert report.max_abs_diff == 0.0 and report.num_conversations_checked == 3
    assert report.tokens_identical and report.num_tokens_compared == 9 and eng.step_id == 6
    assert all(old != new for old, new in report.mapping.items())
    for i in ids:
        assert all(report.mapping[b] == nb for b, nb in zip(before[i], eng.conversation(i).block_table))
    for _ in range(4):
        eng.step()
    eng.relocate_blocks(compact=True)
    used = np.flatnonzero(eng.snapshot().state == BlockState.USED)
    assert used.tolist() == list(range(len(used)))  # compacted towards low ids
    eng.run_until_idle()
    assert [list(eng.conversation(i).output_token_ids) for i in ids] == reference


def test_dry_run_rolls_back_everything(ckpt):
    eng = make(ckpt, num_blocks=20)
    ids = [eng.add_conversation(prompt_token_ids=prompt(n, start=n), max_new_tokens=12, temperature=t)
           for n, t in ((9, 0.0), (14, 0.9), (5, 0.0))]
    eng.step()
    eng.fork_conversation(ids[0])
    before = _pool_state(eng), eng.kv.data.clone(), eng.step_id
    ahead = eng._dry_run(5)
    assert _pool_state(eng) == before[0] and torch.equal(eng.kv.data, before[1]) and eng.step_id == before[2]
    eng.run_until_idle()
    assert len(ahead) == 4 and all(len(t) == 5 for t in ahead.values())
    for cid, tokens in ahead.items():  # every conversation had 1 output token; the real run then matches the dry run
        assert list(eng.conversation(cid).output_token_ids)[1:6] == tokens


def test_continue_reuses_cached_blocks(ckpt):
    eng = make(ckpt, block_size=4)
    cid = eng.add_conversation(prompt_token_ids=prompt(10), max_new_tokens=8)
    eng.run_until_idle()
    first = eng.conversation(cid)
    history = list(first.prompt_token_ids) + list(first.output_token_ids)  # 18 tokens, 17 with K/V
    cached_blocks = np.flatnonzero(eng.snapshot().state == BlockState.CACHED)
    assert len(cached_blocks) == 17 // 4
    computed_before = eng.metrics().num_prefill_tokens
    eng.continue_conversation(cid, prompt_token_ids=[3, 1, 4])
    eng.step()
    info = eng.conversation(cid)
    assert info.num_cached_tokens == 16 and info.status == Status.RUNNING
    assert sorted(info.block_table[:4]) == sorted(cached_blocks.tolist())
    assert eng.metrics().num_prefill_tokens - computed_before == len(history) + 3 - 16
    eng.run_until_idle()
    fresh = make(ckpt, block_size=4).generate([history + [3, 1, 4]], max_new_tokens=8)[0]
    assert list(eng.conversation(cid).output_token_ids) == fresh


def test_end_releases_blocks_and_caches_full_ones(ckpt):
    eng = make(ckpt, block_size=4)
    cid = eng.add_conversation(prompt_token_ids=prompt(10), max_new_tokens=50)
    eng.step()
    eng.end_conversation(cid)
    snap = eng.snapshot()
    assert snap.block_tables == {} and eng.conversation(cid).status == "ended"
    assert int((snap.state == BlockState.USED).sum()) == 0
    assert int((snap.state == BlockState.CACHED).sum()) == 2  # two full blocks, the partial tail is FREE
    assert not eng.has_work()


def test_eos_finishes(tmp_path):
    probe = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "a")), num_blocks=32))
    first = probe.generate([prompt(5)], max_new_tokens=3)[0][0]
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "b", eos_token_id=first)), num_blocks=32))
    cid = eng.add_conversation(prompt_token_ids=prompt(5), max_new_tokens=10)
    eng.run_until_idle()
    assert eng.conversation(cid).output_token_ids == (first,)
    assert eng.conversation(cid).status == "finished"


def test_sampling_is_seeded(ckpt):
    def run():
        eng = make(ckpt)
        cid = eng.add_conversation(prompt_token_ids=prompt(5), max_new_tokens=12, temperature=0.9, seed=7)
        eng.run_until_idle()
        return eng.conversation(cid).output_token_ids
    assert run() == run()


def _pool_state(eng):
    s = eng.snapshot()
    return (s.ref_count.tobytes(), s.num_filled.tobytes(), s.state.tobytes(), s.block_hash.tobytes(),
            dict(s.block_tables), s.conversations, s.version, s.step_id, eng.pool.free_queue,
            len(eng.manager.events), [q.seq_id for q in eng.scheduler.waiting])


@pytest.mark.parametrize("call, message", [
    (lambda e: e.add_conversation(prompt_token_ids=[]), "empty"),
    (lambda e: e.add_conversation(prompt=""), "empty"),
    (lambda e: e.add_conversation(), "prompt"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], max_new_tokens=-3), "max_new_tokens"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature=-1), "temperature"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 97]), "vocabulary"),
    (lambda e: e.add_conversation(prompt_token_ids=[-1]), "vocabulary"),
    (lambda e: e.add_conversation(prompt_token_ids=list(range(1, 90)) * 3, max_new_tokens=10), "pool"),
    (lambda e: e.add_conversation(prompt="text"), "tokenizer"),
    (lambda e: e.add_conversation(prompt_token_ids=prompt(500), max_new_tokens=20), "max_position_embeddings"),
    (lambda e: e.end_conversation(99), "no conversation"),
    (lambda e: e.fork_conversation(99), "no conversation"),
    (lambda e: e.continue_conversation(0, prompt_token_ids=[1]), "finished"),
    (lambda e: e.inspect_block(64), "no block"),
    (lambda e: e.inspect_block(-1), "no block"),
    # what an adversarial user tried (issue 9): each is refused with a message and changes nothing
    (lambda e: e.add_conversation(prompt="ab\ud800cd"), "lone surrogate"),
    (lambda e: e.tokenize("ab\ud800cd"), "lone surrogate"),
    (lambda e: e.add_conversation(prompt_token_ids=[float("inf")]), "integers"),
    (lambda e: e.add_conversation(prompt_token_ids=[1.7]), "integers"),
    (lambda e: e.add_conversation(prompt_token_ids="123"), "list of integers"),
    (lambda e: e.add_conversation(prompt_token_ids=["5"]), "integers"),
    (lambda e: e.add_conversation(prompt_token_ids={1: 2}), "list of integers"),
    (lambda e: e.add_conversation(prompt_token_ids=torch.tensor([1.0, 2.0])), "integers"),
    (lambda e: e.add_conversation(prompt_token_ids=[True, 2]), "integers"),
    (lambda e: e.add_conversation(prompt_token_ids=7), "list of integers"),
    (lambda e: e.end_conversation(True), "no conversation"),
    (lambda e: e.end_conversation(False), "no conversation"),
    (lambda e: e.fork_conversation(False), "no conversation"),
    (lambda e: e.conversation(True), "no conversation"),
    (lambda e: e.conversation(0.0), "no conversation"),
    (lambda e: e.continue_conversation(True, prompt_token_ids=[1]), "no conversation"),
    (lambda e: e.inspect_block(True), "no block"),
    (lambda e: e.inspect_block(1.0), "no block"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], max_new_tokens=True), "max_new_tokens"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], max_new_tokens=2.0), "max_new_tokens"),
    (lambda e: e.add_samples(prompt_token_ids=[1, 2], n=True), "n must be"),
    (lambda e: e.run_until_idle(max_steps="x"), "max_steps"),
    (lambda e: e.run_until_idle(max_steps=True), "max_steps"),
    (lambda e: e.run_until_idle(max_steps=-1), "max_steps"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], seed=True), "seed"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], seed="x"), "seed"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], seed=2**64), "seed"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], seed=1.5), "seed"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], seed=-1), "seed"),
    (lambda e: e.fork_conversation(0, seed="x"), "seed"),
    (lambda e: e.fork_conversation(0, seed=2**64), "seed"),
    (lambda e: e.fork_conversation(0, seed=1.5), "seed"),
    (lambda e: e.fork_conversation(0, seed=False), "seed"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature="0.5"), "temperature"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature=True), "temperature"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature=1e-300), "too small"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature=float("nan")), "temperature"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], temperature=float("inf")), "temperature"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], ignore_eos="yes"), "ignore_eos"),
    (lambda e: e.add_conversation(prompt_token_ids=[1, 2], ignore_eos=1), "ignore_eos"),
    (lambda e: e.relocate_blocks(seed=-1), "seed"),
    (lambda e: e.relocate_blocks(seed="x"), "seed"),
    (lambda e: e.relocate_blocks(seed=1.5), "seed"),
    (lambda e: e.relocate_blocks(seed=float("nan")), "seed"),
    (lambda e: e.relocate_blocks(seed=True), "seed"),
    (lambda e: e.relocate_blocks(compact="no"), "compact"),
    (lambda e: e.relocate_and_verify(lookahead=-2), "lookahead"),
    (lambda e: e.generate([[1, 2, 3], [999]]), "vocabulary"),
    (lambda e: e.generate("123"), "list of token-id prompts"),
    (lambda e: e.detokenize([1.5]), "integers"),
])
def test_bad_input_is_refused_and_changes_nothing(ckpt, call, message):
    eng = make(ckpt, num_blocks=64)
    eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=30)
    eng.step()
    before = _pool_state(eng)
    with pytest.raises(EngineError, match=message):
        call(eng)
    assert _pool_state(eng) == before


def test_context_limit_is_the_models_positions(ckpt):
    """Exactly max_position_embeddings (512 here) tokens is accepted and runs; a reply that would go past it is
    refused and leaves the conversation as it was."""
    eng = make(ckpt, num_blocks=160)
    assert eng.snapshot().max_model_len == eng.max_model_len == 512
    cid = eng.add_conversation(prompt_token_ids=prompt(500), max_new_tokens=12)
    eng.run_until_idle()
    assert len(eng.conversation(cid).output_token_ids) == 12
    before = _pool_state(eng)
    with pytest.raises(EngineError, match="at most 512"):
        eng.continue_conversation(cid, prompt_token_ids=[5], max_new_tokens=1)
    assert _pool_state(eng) == before


def test_fork_of_finished_is_refused(ckpt):
    eng = make(ckpt)
    cid = eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=2)
    eng.run_until_idle()
    with pytest.raises(EngineError, match="finished"):
        eng.fork_conversation(cid)
    eng.end_conversation(cid)
    with pytest.raises(EngineError, match="ended"):
        eng.fork_conversation(cid)


@pytest.mark.parametrize("kw, message", [
    ({"block_size": 0}, "block_size"), ({"num_blocks": 1}, "num_blocks"), ({"dtype": "int8"}, "dtype"),
    ({"device": "tpu"}, "device"), ({"block_size": "4"}, "block_size"), ({"block_size": True}, "block_size"),
    ({"num_blocks": 64.0}, "num_blocks"), ({"seed": 2**45}, "seed"), ({"seed": -1}, "seed"), ({"seed": "x"}, "seed"),
    ({"seed": True}, "seed"), ({"enable_prefix_caching": 1}, "enable_prefix_caching"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"), ({"compile_attention": None}, "compile_attention"),
    ({"max_num_seqs": 600}, "max_num_batched_tokens"), ({"kv_events_endpoint": "5557"}, "endpoint"),
    ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint"), ({"model": 3}, "model"),
])
def test_bad_config(kw, message):
    with pytest.raises(EngineError, match=message):
        EngineConfig(**kw)


def test_bad_checkpoints(tmp_path, ckpt):
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match="config.json"):
        Engine(EngineConfig(model=str(tmp_path / "empty")))
    def with_weights(name, filename, data):  # the tiny model's config.json beside one weights file
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text((Path(ckpt) / "config.json").read_text())
        (directory / filename).write_bytes(data)
        return str(directory)

    with pytest.raises(EngineError, match="pickle"):
        Engine(EngineConfig(model=with_weights("pickled", "pytorch_model.bin", b"not loaded")))
    with pytest.raises(EngineError, match="cannot read weights"):
        Engine(EngineConfig(model=with_weights("corrupt", "model.safetensors",
                                               b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")))
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "vocab_size": 10}')
    with pytest.raises(EngineError, match="unsupported model architecture"):
        Engine(EngineConfig(model=str(other)))
    (other / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="cannot read"):
        Engine(EngineConfig(model=str(other)))


def test_inspect_block(ckpt):
    eng = make(ckpt, block_size=4)
    tokens = prompt(6)
    a = eng.add_conversation(prompt_token_ids=tokens, max_new_tokens=10)
    eng.step()
    b = eng.fork_conversation(a)
    table = eng.conversation(a).block_table
    info = eng.inspect_block(table[0])
    assert info.token_ids == tuple(tokens[:4]) and info.positions == (0, 1, 2, 3)
    assert set(info.owners) == {(a, 0), (b, 0)} and info.ref_count == 2
    assert info.block_hash is not None
    assert info.keys.shape == (2, 4, 2, 12) and not info.keys.flags.writeable
    tail = eng.inspect_block(table[1])
    assert tail.num_filled == 2 and tail.block_hash is None and tail.hash_reason == HashReason.PARTIAL
    free = eng.inspect_block(100)
    assert free.state == BlockState.FREE and free.token_ids == () and free.keys.shape[1] == 0


def test_snapshot_is_immutable_copy(ckpt):
    eng = make(ckpt)
    eng.add_conversation(prompt_token_ids=prompt(6), max_new_tokens=10)
    eng.step()
    snap = eng.snapshot()
    with pytest.raises(ValueError):
        snap.ref_count[0] = 5
    filled = snap.num_filled.copy()
    eng.step()
    assert (snap.num_filled == filled).all() and snap.step_id == 1 and eng.snapshot().step_id == 2


def test_ignore_eos_keeps_decoding(tmp_path):
    probe = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "a")), num_blocks=32))
    first = probe.generate([prompt(5)], max_new_tokens=3)[0][0]
    eng = Engine(EngineConfig(model=str(write_tiny_checkpoint(tmp_path / "b", eos_token_id=first)), num_blocks=32))
    cid = eng.add_conversation(prompt_token_ids=prompt(5), max_new_tokens=6, ignore_eos=True)
    kid = eng.fork_conversation(cid)
    eng.run_until_idle()
    assert eng.conversation(cid).output_token_ids[0] == first and len(eng.conversation(cid).output_token_ids) == 6
    assert len(eng.conversation(kid).output_token_ids) == 6
    # generate: stops at the end-of-sequence token unless told to take it like any other (benchmarks do)
    assert eng.generate([prompt(5)], max_new_tokens=6) == [[first]]
    out = eng.generate([prompt(5)], max_new_tokens=6, ignore_eos=True)[0]
    assert out[0] == first and len(out) == 6
    with pytest.raises(EngineError, match="ignore_eos"):
        eng.generate([prompt(5)], max_new_tokens=6, ignore_eos="yes")


def _checkpoint_with(tmp_path, ckpt, name, config=None, generation=None, tokenizer_vocab=None):
    """The tiny model with one thing changed in its config.json / generation_config.json / tokenizer."""
    import json
    import shutil
    directory = tmp_path / name
    shutil.copytree(ckpt, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg.update(config or {})
    (directory / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    if tokenizer_vocab is not None:
        from tokenizers import Tokenizer, models
        vocab = {f"t{i}": i for i in range(tokenizer_vocab)}
        Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return str(directory)


@pytest.mark.parametrize("name, changes, message", [
    ("rope", {"config": {"rope_scaling": "linear"}}, "rope_scaling"),
    ("rope2", {"config": {"rope_scaling": {"type": "linear", "factor": 2.0}}}, "rope_scaling"),
    ("heads", {"config": {"num_attention_heads": 0}}, "num_attention_heads"),
    ("vocab", {"config": {"vocab_size": -1}}, "vocab_size"),
    ("dim", {"config": {"head_dim": -12}}, "head_dim"),
    ("positions", {"config": {"max_position_embeddings": 0}}, "max_position_embeddings"),
    ("positions2", {"config": {"max_position_embeddings": -5}}, "max_position_embeddings"),
    ("layers", {"config": {"num_hidden_layers": True}}, "num_hidden_layers"),
    ("eos", {"config": {"eos_token_id": 500}}, "eos_token_id"),
    ("gen_eos", {"generation": {"eos_token_id": 97}}, "eos_token_id"),
    ("gen_eos_type", {"generation": {"eos_token_id": "2"}}, "eos_token_id"),
    ("gen_eos_list", {"generation": {"eos_token_id": [3, 1.5]}}, "eos_token_id"),
    ("tokenizer", {"tokenizer_vocab": 200}, "tokenizer"),
])
def test_bad_checkpoint_fields(tmp_path, ckpt, name, changes, message):
    path = _checkpoint_with(tmp_path, ckpt, name, **changes)
    with pytest.raises(EngineError, match=message):
        Engine(EngineConfig(model=path, num_blocks=16))


def test_a_file_is_not_a_checkpoint_directory(tmp_path, ckpt):
    with pytest.raises(EngineError, match="is a file"):
        Engine(EngineConfig(model=str(Path(ckpt) / "config.json")))


@pytest.mark.parametrize("kw", [{"block_size": 10000, "num_blocks": 100_000}, {"num_blocks": 10**8}])
def test_pool_too_large_for_memory_is_refused_at_once(ckpt, kw):
    import time
    start = time.perf_counter()
    with pytest.raises(EngineError, match=r"needs .* GiB .* available"):
        Engine(EngineConfig(model=ckpt, **kw))
    assert time.perf_counter() - start < 5  # refused before allocating anything (not a timing claim on speed)


@pytest.mark.parametrize("case, message", [
    ("id_out_of_range", "outside the cache"), ("negative_id", "outside the cache"),
    ("len_past_table", "needs more blocks"), ("zero_len", "at least 1"), ("float_table", "integers"),
    ("list_table", "torch tensor"), ("float_lens", "integers"),
])
def test_paged_attention_refuses_bad_tables(case, message):
    from engine import paged_attention
    q, k = torch.randn(2, 4, 8), torch.randn(6, 4, 2, 8)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8])
    if case == "id_out_of_range":
        tables = torch.tensor([[0, 6], [2, 3]])
    elif case == "negative_id":
        tables = torch.tensor([[0, 1], [-1, 3]])
    elif case == "len_past_table":
        lens = torch.tensor([5, 9])
    elif case == "zero_len":
        lens = torch.tensor([0, 8])
    elif case == "float_table":
        tables = tables.float()
    elif case == "list_table":
        tables = [[0, 1], [2, 3]]
    elif case == "float_lens":
        lens = lens.float()
    with pytest.raises(EngineError, match=message):
        paged_attention(q, k, k.clone(), tables, lens)
    ok = paged_attention(q, k, k.clone(), torch.tensor([[0, 99], [2, 3]]), torch.tensor([4, 8]))  # past the end: ignored
    assert ok.shape == (2, 4, 8)
