"""KV cache groups: layer kinds read from checkpoints, one table per group drawn from the one pool, sliding-window
releases, prefix caching per group, the transaction rules per group, views and KV events."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import BlockState, Engine, EngineConfig, EngineError
from engine.kv.groups import ABSENT, FullAttention, SlidingWindow, group_key, raw_hash
from engine.kv.manager import KVCacheManager
from engine.model.causal_lm import CausalLM, ModelConfig
from kvstream.events import WINDOW_REASON, EventKind, PoolModel
from kvstream.views import KVCacheGroupInfo
from tests.helpers import fail_forward_on_call

S, F = "sliding_attention", "full_attention"


def write_mixed_checkpoint(path, window=8, layer_types=(S, F, S), arch="LlamaForCausalLM", seed=0, vocab_size=97,
                           max_positions=512):
    """A random checkpoint whose layers slide (``layer_types``; Mistral: every layer) with weights large enough
    that greedy outputs vary from token to token."""
    d = dict(architectures=[arch], vocab_size=vocab_size, hidden_size=48, intermediate_size=64,
             num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=12,
             max_position_embeddings=max_positions, hidden_act="silu", sliding_window=window,
             layer_types=list(layer_types))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        d["use_sliding_window"] = True
    cfg = ModelConfig.from_hf_dict(d)
    model = CausalLM(cfg)
    model.init_weights(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(0.3 / 0.02)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(d))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return str(write_mixed_checkpoint(tmp_path_factory.mktemp("mixed")))


@pytest.fixture(scope="module")
def sliding_only(tmp_path_factory):
    return str(write_mixed_checkpoint(tmp_path_factory.mktemp("mistral"), layer_types=(S, S),
                                      arch="MistralForCausalLM"))


def _engine(path, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return Engine(EngineConfig(model=path, **kw))


# ---- layer kinds from config.json ----------------------------------------------------------------------------
BASE = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2)


def _kinds(**extra):
    cfg = ModelConfig.from_hf_dict({**BASE, **extra})
    return cfg.layer_types, cfg.sliding_window, [(k, w, layers) for k, w, layers in cfg.kv_cache_groups()]


def test_layer_types_with_a_window_make_two_groups_full_attention_first():
    types, window, groups = _kinds(architectures=["LlamaForCausalLM"], sliding_window=16,
                                   layer_types=[S, F, S, F])
    assert types == (S, F, S, F) and window == 16
    assert groups == [("full_attention", None, (1, 3)), ("sliding_window", 16, (0, 2))]


def test_mistral_slides_every_layer_and_ignores_layer_types():
    assert _kinds(architectures=["MistralForCausalLM"], sliding_window=8, layer_types=[F] * 4)[2] == \
        [("sliding_window", 8, (0, 1, 2, 3))]
    assert _kinds(architectures=["MistralForCausalLM"], sliding_window=None)[2] == \
        [("full_attention", None, (0, 1, 2, 3))]


def test_qwen2_window_layers_as_transformers_derives_them():
    """transformers 5's Qwen2Config: sliding only with use_sliding_window, on layers >= max_window_layers."""
    import transformers
    hf = transformers.Qwen2Config(**BASE, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    types, window, _ = _kinds(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=8,
                              max_window_layers=2)
    assert list(types) == hf.layer_types == [F, F, S, S] and window == hf.sliding_window == 8
    off = transformers.Qwen2Config(**BASE, use_sliding_window=False, sliding_window=8, max_window_layers=2)
    assert off.sliding_window is None and _kinds(architectures=["Qwen2ForCausalLM"], sliding_window=8,
                                                 max_window_layers=2)[1] is None
    hf3 = transformers.Qwen3Config(**BASE, use_sliding_window=True, sliding_window=8, layer_types=[S, F, F, S])
    types, window, _ = _kinds(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=8,
                              layer_types=[S, F, F, S])
    assert list(types) == hf3.layer_types and window == 8


def test_plain_models_have_one_full_attention_group():
    types, window, groups = _kinds(architectures=["LlamaForCausalLM"])
    assert types == () and window is None and groups == [("full_attention", None, (0, 1, 2, 3))]


@pytest.mark.parametrize("extra, words", [
    (dict(layer_types=[S, F]), "one kind per layer"),
    (dict(layer_types=[S, F, "chunked_attention", F], sliding_window=4), "unsupported layer type"),
    (dict(layer_types=[S, F, S, F]), "sliding_window is not set"),
    (dict(layer_types=[S, F, S, F], sliding_window=0), "sliding_window must be a positive"),
    (dict(layer_types=[S, F, S, F], sliding_window=True), "sliding_window must be a positive"),
    (dict(layer_types="sliding", sliding_window=4), "one kind per layer"),
])
def test_bad_layer_kinds_are_engine_errors(extra, words):
    with pytest.raises(EngineError, match=words):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"], **extra})


def test_bad_max_window_layers_is_an_engine_error():
    with pytest.raises(EngineError, match="max_window_layers"):
        ModelConfig.from_hf_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                                  "sliding_window": 4, "max_window_layers": "2"})


def test_config_round_trips_through_to_hf_dict():
    for arch, extra in (("LlamaForCausalLM", dict(layer_types=[S, F, S, F], sliding_window=6)),
                        ("Qwen3ForCausalLM", dict(layer_types=[F, S, S, F], sliding_window=6,
                                                  use_sliding_window=True)),
                        ("MistralForCausalLM", dict(sliding_window=6))):
        cfg = ModelConfig.from_hf_dict({**BASE, "architectures": [arch], **extra})
        again = ModelConfig.from_hf_dict(cfg.to_hf_dict())
        assert again == cfg


# ---- layout ---------------------------------------------------------------------------------------------------
def test_one_pool_hybrid_layout(mixed):
    """vLLM's hybrid layout: [max layers per group, 2, blocks, ...]; layer j of each group reads plane j."""
    eng = _engine(mixed)
    assert type(eng.manager) is KVCacheManager and not eng.manager.plain
    assert [type(p) for p in eng.manager.policies] == [FullAttention, SlidingWindow]
    assert eng.kv.data.shape[:3] == (2, 2, 64)  # groups (1,) and (0, 2): two planes
    assert eng.kv.layers[0][0].data_ptr() == eng.kv.data[0, 0].data_ptr()  # sliding layer 0 -> plane 0
    assert eng.kv.layers[1][0].data_ptr() == eng.kv.data[0, 0].data_ptr()  # full layer 1 -> plane 0
    assert eng.kv.layers[2][0].data_ptr() == eng.kv.data[1, 0].data_ptr()  # sliding layer 2 -> plane 1
    snap = eng.snapshot()
    assert snap.kv_cache_groups == (KVCacheGroupInfo("full_attention", None, (1,)),
                                    KVCacheGroupInfo("sliding_window", 8, (0, 2)))


def test_plain_model_is_the_one_group_case_with_the_plain_layout(tmp_path):
    from tests.helpers import write_tiny_checkpoint
    eng = _engine(str(write_tiny_checkpoint(tmp_path / "t")))
    assert type(eng.manager) is KVCacheManager and eng.manager.plain
    assert [type(p) for p in eng.manager.policies] == [FullAttention]
    snap = eng.snapshot()
    assert snap.kv_cache_groups == (KVCacheGroupInfo("full_attention", None, (0, 1)),)
    assert snap.block_group is None
    assert snap.group_block_tables == ({},)  # one group per KV cache group (DESIGN.md), none held yet
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 12)), max_new_tokens=3, ignore_eos=True)
    eng.step()
    snap = eng.snapshot()
    assert len(snap.group_block_tables) == len(snap.kv_cache_groups) == 1
    assert snap.group_block_tables[0] is snap.block_tables and snap.block_tables[cid]  # the one group's tables
    info = eng.conversation(cid)
    assert info.group_block_tables == (info.block_table,) and len(info.block_table) == 3
    assert snap.conversation(cid).group_block_tables == (snap.block_tables[cid],)


# ---- windows release ------------------------------------------------------------------------------------------
def test_sliding_group_holds_a_bounded_number_of_blocks_and_releases_as_it_goes(mixed):
    eng = _engine(mixed, num_blocks=128)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 30)), max_new_tokens=40, ignore_eos=True)
    bound = math.ceil(8 / 4) + 1
    most = 0
    releases = []
    while eng.has_work():
        eng.step()
        eng.check_invariants()
        events = eng.take_events()
        releases += [e for e in events if e.reason == WINDOW_REASON]
        seq = eng.seqs[cid]
        if seq.status == "running":
            full, sliding = seq.group_table(0), seq.group_table(1)
            held = [b for b in sliding if b != ABSENT]
            most = max(most, len(held))
            assert len(held) <= bound
            assert ABSENT not in full and len(full) == len(sliding)
            n = seq.num_computed_tokens
            assert sliding[: max(0, n - 8 + 1) // 4] == [ABSENT] * (max(0, n - 8 + 1) // 4)
    assert most == bound
    assert releases and all(e.group == 1 and e.kind in (EventKind.WINDOW_RELEASED, EventKind.CACHED, EventKind.FREED)
                            for e in releases)
    assert {e.kind for e in releases} >= {EventKind.WINDOW_RELEASED}  # the typed event that names the group
    released = [b for e in releases if e.kind != EventKind.WINDOW_RELEASED for b in e.block_ids]
    assert sorted(released) == sorted(b for e in releases if e.kind == EventKind.WINDOW_RELEASED for b in e.block_ids)
    assert eng.manager.num_window_releases == len(released) == (29 + 40 - 1 - 8 + 1) // 4  # all behind the
    #                                                   window of the last query (the last token is never computed)


def test_window_release_is_the_step_that_makes_the_block_unreadable(mixed):
    """Block i (positions 4i..4i+3) of the sliding group goes when the next query's position p has
    p - 8 >= 4i + 3, i.e. once p = 4i + 11 tokens are computed: not a step earlier, not a step later."""
    eng = _engine(mixed, max_num_batched_tokens=256)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 10)), max_new_tokens=20, ignore_eos=True)
    eng.step()  # prefill 9 tokens: position 9 next; keys > 1 -> block 0 (positions 0..3) still read
    seq = eng.seqs[cid]
    assert seq.group_table(1)[0] != ABSENT
    eng.step()  # position 10 computed; next query 10... reads keys > 2: block 0 still read
    assert seq.group_table(1)[0] != ABSENT
    eng.step()  # 11 computed: next query at 11 reads keys > 3: block 0 out
    assert seq.group_table(1)[0] == ABSENT and seq.group_table(1)[1] != ABSENT


def test_sliding_only_model_group0_has_holes_and_views_show_them(sliding_only):
    eng = _engine(sliding_only)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 25)), max_new_tokens=6, ignore_eos=True)
    for _ in range(3):
        eng.step()
    snap = eng.snapshot()
    table = snap.block_tables[cid]
    assert table[0] == ABSENT and snap.group_block_tables[0][cid] == table
    info = eng.conversation(cid)
    assert info.group_block_tables == (table,)
    live = [b for b in table if b != ABSENT]
    assert all(snap.state[b] == BlockState.USED for b in live)
    blk = eng.inspect_block(live[0])
    assert blk.owners == ((cid, table.index(live[0])),)
    eng.relocate_blocks(seed=3, compact=True)
    eng.check_invariants()
    eng.relocate_blocks(seed=4)
    eng.check_invariants()
    assert eng.conversation(cid).block_table[0] == ABSENT


# ---- prefix caching per group ---------------------------------------------------------------------------------
def test_prefix_hit_in_every_group_sliding_group_only_the_window(mixed):
    eng = _engine(mixed, num_blocks=128)
    prompt = list(range(1, 30))
    first = eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=2)
    eng.run_until_idle()
    eng.take_events()
    second = eng.add_conversation(prompt_token_ids=prompt + [50, 51], max_new_tokens=2)
    eng.step()
    seq = eng.seqs[second]
    hits = seq.num_cached_tokens
    assert hits == 28  # 7 full blocks of the 29-token prompt are cached in both groups
    shared = [e for e in eng.take_events() if e.kind == EventKind.SHARED]
    by_group = {e.group: e.block_ids for e in shared}
    assert len(by_group[0]) == 7
    # the sliding group shares only the blocks the window of position 28 reads (keys > 20: blocks 5, 6)
    assert len(by_group[1]) == 2
    assert seq.group_table(1)[:5] == [ABSENT] * 5
    eng.check_invariants()
    eng.run_until_idle()
    assert first != second


def test_a_sliding_hit_needs_its_window_blocks(mixed):
    """Evict a sliding block inside the hit's window: the hit shrinks to where the window's blocks are cached."""
    eng = _engine(mixed, num_blocks=128)
    prompt = list(range(1, 30))
    eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=1)
    eng.run_until_idle()
    manager, pool = eng.manager, eng.pool
    hashes = eng.seqs[0].block_hashes
    victim = pool.lookup(group_key(hashes[6], 1))  # sliding block 6 (positions 24..27)
    assert victim is not None
    with eng.transaction():  # drop that one hash, as an eviction would
        pool._drop_hash(victim)
        pool._cached.pop(victim)
        pool.state[victim] = BlockState.FREE
        pool.num_filled[victim] = 0
        pool._free[victim] = None
        eng.changed()
    cid = eng.add_conversation(prompt_token_ids=prompt, max_new_tokens=1)
    hits = manager.prefix_hits(eng.seqs[cid])
    # 7 blocks would need sliding blocks 5, 6; block 6 is gone -> 6 blocks (needs 3..5 for position 24: keys > 16)
    assert len(hits) == 6
    assert hits.tables[1][:4] == [ABSENT] * 4 and ABSENT not in hits.tables[1][4:]


def test_cache_keys_differ_per_group_and_events_carry_plain_hashes(mixed):
    eng = _engine(mixed)
    eng.add_conversation(prompt_token_ids=list(range(1, 14)), max_new_tokens=1)
    eng.run_until_idle()
    stored = [e for e in eng.take_events() if e.kind == EventKind.STORED]
    assert {e.group for e in stored} == {0, 1}
    by_group = {g: [h for e in stored if e.group == g for h in e.block_hashes] for g in (0, 1)}
    assert by_group[0] == by_group[1] == eng.seqs[0].block_hashes[:3]
    for h in by_group[1]:
        assert eng.pool.lookup(group_key(h, 1)) is not None and group_key(h, 1) != h
        assert raw_hash(group_key(h, 1), 1) == h


# ---- admission, sharing, preemption, transactions --------------------------------------------------------------
def test_admission_counts_every_group(mixed):
    eng = _engine(mixed, num_blocks=16)
    # 13 tokens: 4 blocks per group, 8 in all; a second such prompt fits (16), a third waits
    ids = [eng.add_conversation(prompt_token_ids=[i + 1] * 13, max_new_tokens=4) for i in range(3)]
    eng.step()
    assert [eng.seqs[i].status for i in ids] == ["running", "running", "waiting"]
    eng.check_invariants()
    need = eng.manager.num_blocks_for(eng.seqs[ids[2]], 13, eng.manager.prefix_hits(eng.seqs[ids[2]]))
    assert need == 8


def test_fork_and_copy_on_write_per_group(mixed):
    eng = _engine(mixed, num_blocks=64)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 11)), max_new_tokens=8, ignore_eos=True)
    eng.step()
    kid = eng.fork_conversation(cid)
    eng.check_invariants()
    parent, child = eng.seqs[cid], eng.seqs[kid]
    for g in (0, 1):
        assert parent.group_table(g) == child.group_table(g)
    eng.take_events()
    eng.step()
    events = eng.take_events()
    cows = [e for e in events if e.kind == EventKind.COPIED_ON_WRITE]
    assert {e.group for e in cows} == {0, 1}
    eng.check_invariants()
    eng.run_until_idle()
    eng.check_invariants()


def test_preemption_and_recompute_give_the_same_tokens(mixed):
    prompts = [list(range(1 + i, 14 + i)) for i in range(4)]
    roomy = _engine(mixed, num_blocks=200).generate(prompts, max_new_tokens=16)
    eng = _engine(mixed, num_blocks=24)  # too small for all four at once: preemptions
    assert eng.generate(prompts, max_new_tokens=16) == roomy
    assert eng.scheduler.num_preemptions > 0
    eng.check_invariants()


def test_a_failed_step_leaves_every_group_as_it_was(mixed, monkeypatch):
    eng = _engine(mixed)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 12)), max_new_tokens=12, ignore_eos=True)
    for _ in range(3):
        eng.step()
    seq = eng.seqs[cid]
    before = ([list(seq.group_table(g)) for g in (0, 1)], eng.pool.ref_count.copy(), eng.pool.state.copy(),
              eng.manager.block_group.copy(), eng.kv.data.clone(), eng.manager.num_window_releases)
    fail_forward_on_call(monkeypatch, eng, 1)
    with pytest.raises(RuntimeError):
        eng.step()
    after = ([list(seq.group_table(g)) for g in (0, 1)], eng.pool.ref_count, eng.pool.state,
             eng.manager.block_group, eng.kv.data, eng.manager.num_window_releases)
    assert before[0] == after[0]
    assert all(np.array_equal(a, b) for a, b in zip(before[1:4], after[1:4]))
    assert torch.equal(before[4], after[4]) and before[5] == after[5]
    eng.check_invariants()


def test_a_failed_generate_through_window_releases_rolls_back(mixed, monkeypatch):
    eng = _engine(mixed)
    snap = eng.snapshot()
    fail_forward_on_call(monkeypatch, eng, 9)  # after several releases
    with pytest.raises(RuntimeError):
        eng.generate([list(range(1, 12))], max_new_tokens=12)
    assert not eng.seqs and np.array_equal(eng.pool.state, snap.state)
    assert not eng.take_events()
    eng.check_invariants()


def test_events_replay_to_the_pool_with_groups(mixed):
    eng = _engine(mixed, num_blocks=30)
    model = PoolModel(30)
    ids = [eng.add_conversation(prompt_token_ids=[5, 6, 7, 8, 9, 10, 11, 12, 13, i + 1], max_new_tokens=14,
                                ignore_eos=True) for i in range(3)]
    for step in range(40):
        if step == 3:
            ids.append(eng.fork_conversation(ids[0]))
        if step == 6:
            eng.relocate_blocks(seed=step)
        if step == 9:
            eng.end_conversation(ids[1])
        eng.step()
        for e in eng.take_events():
            model.apply(e)
        snap = eng.snapshot()
        assert (model.state == snap.state).all() and (model.ref_count == snap.ref_count).all()
        eng.check_invariants()


def test_snapshot_group_tables_and_block_groups(mixed):
    eng = _engine(mixed)
    cid = eng.add_conversation(prompt_token_ids=list(range(1, 20)), max_new_tokens=4, ignore_eos=True)
    eng.step()
    snap = eng.snapshot()
    full, sliding = snap.group_block_tables[0][cid], snap.group_block_tables[1][cid]
    assert snap.block_tables[cid] == full and eng.conversation(cid).group_block_tables == (full, sliding)
    assert all(snap.block_group[b] == 0 for b in full)
    assert all(snap.block_group[b] == 1 for b in sliding if b != ABSENT)
    assert ABSENT in sliding
    blk = eng.inspect_block(sliding[-1])
    assert blk.owners == ((cid, len(sliding) - 1),) and blk.keys.shape[0] == 2  # the sliding group's 2 layers


# ---- KV events ------------------------------------------------------------------------------------------------
def test_kv_events_name_group_kind_and_window_as_vllm_034():
    from engine.kv.kv_events import to_kv_events
    from kvstream.events import BlockEvent
    groups = (KVCacheGroupInfo("full_attention", None, (1,)), KVCacheGroupInfo("sliding_window", 8, (0, 2)))
    events = [BlockEvent(1, EventKind.STORED, 0, (3,), block_hashes=(11,), token_ids=(1, 2, 3, 4), group=1),
              BlockEvent(1, EventKind.STORED, 0, (4,), block_hashes=(11,), token_ids=(1, 2, 3, 4)),
              BlockEvent(2, EventKind.EVICTED, 0, (3,), block_hashes=(11,), group=1)]
    stored_s, stored_f, removed = to_kv_events(events, 4, groups)
    assert (stored_s.group_idx, stored_s.kv_cache_spec_kind, stored_s.kv_cache_spec_sliding_window) == \
        (1, "sliding_window", 8)
    assert (stored_f.group_idx, stored_f.kv_cache_spec_kind, stored_f.kv_cache_spec_sliding_window) == \
        (0, "full_attention", None)
    assert removed.group_idx == 1 and stored_s.block_hashes == (11,)


def test_kv_event_fields_are_vllms_names_in_vllms_order():
    from kvstream.kv_events.codec import BlockStored
    fields = BlockStored.__struct_fields__
    at = fields.index("group_idx")
    assert fields[at:at + 3] == ("group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    assert BlockStored.__struct_defaults__[fields.index("kv_cache_spec_sliding_window") - len(fields)] is None


# ---- the window demo's checkpoint -----------------------------------------------------------------------------
def test_window_demo_checkpoint(tmp_path):
    from engine.model.tokenizer import ByteTokenizer
    from engine.model.window_model import write_window_checkpoint
    path = write_window_checkpoint(tmp_path / "w", window=16)
    eng = Engine(EngineConfig(model=str(path), block_size=4, num_blocks=100))
    assert [g.kind for g in eng.kv_cache_groups] == ["full_attention", "sliding_window"]
    assert eng.kv_cache_groups[1].sliding_window == 16 and eng.kv_cache_groups[1].layers == (0, 2)
    text = "Paging never drops KV; a window does. ü"
    assert eng.tokenize(text) == ByteTokenizer().encode(text)
    assert eng.detokenize(eng.tokenize(text)) == text
    cid = eng.add_conversation(prompt=text * 2, max_new_tokens=40, ignore_eos=True)
    while eng.has_work():
        eng.step()
        seq = eng.seqs[cid]
        if seq.status == "running":
            assert sum(b != ABSENT for b in seq.group_table(1)) <= 16 // 4 + 1
    assert len(eng.conversation(cid).output_token_ids) == 40
    with pytest.raises(EngineError):
        write_window_checkpoint(tmp_path / "bad", window=0)


def test_relocation_proves_attention_unchanged_in_every_group(mixed):
    """relocate_and_verify probes every layer through its own group's tables (with its window) before and after."""
    eng = _engine(mixed)
    for i in range(3):
        eng.add_conversation(prompt_token_ids=list(range(1 + i, 20 + i)), max_new_tokens=12, ignore_eos=True)
    for _ in range(4):
        eng.step()
    report = eng.relocate_and_verify(seed=2, lookahead=3)
    assert report.num_conversations_checked == 3 and report.max_abs_diff == 0.0 and report.tokens_identical
    eng.check_invariants()
    probed = eng.probe_attention()
    assert all(v.shape[0] == 3 for v in probed.values())  # every layer, both groups


def test_samples_and_replies_share_every_group(mixed):
    eng = _engine(mixed, num_blocks=96)
    ids = eng.add_samples(prompt_token_ids=list(range(1, 15)), n=3, max_new_tokens=6, temperature=0.8, seed=3)
    eng.step()
    tables = [eng.seqs[i].extra_tables[0] for i in ids]
    assert tables[0] == tables[1] == tables[2] and tables[0][0] == ABSENT
    eng.run_until_idle()
    eng.continue_conversation(ids[0], prompt_token_ids=[7, 8, 9], max_new_tokens=3)
    eng.step()
    assert eng.seqs[ids[0]].num_cached_tokens > 0  # its own cached blocks, in both groups
    eng.run_until_idle()
    eng.check_invariants()


def test_grouped_event_workload_replays_and_names_its_groups(tmp_path):
    from tests.event_workload import grouped_engine_frames
    eng, pairs = grouped_engine_frames(tmp_path)
    model = PoolModel(eng.cfg.num_blocks)
    for _, e in pairs:
        model.apply(e)
    snap = eng.snapshot()
    assert (model.state == snap.state).all() and (model.ref_count == snap.ref_count).all()
    events = [e for _, e in pairs]
    assert any(e.reason == WINDOW_REASON and e.group == 1 for e in events)
    assert {e.group for e in events if e.kind == EventKind.COPIED_ON_WRITE} == {0, 1}
    assert any(e.kind == EventKind.PREEMPTED for e in events)
    assert any(e.kind == EventKind.SHARED and e.reason == "prefix_hit" and e.group == 1 for e in events)


# ---- one manager ----------------------------------------------------------------------------------------------
def manager_subclass_methods(root) -> dict[str, set[str]]:
    """Each class under ``root`` that derives from KVCacheManager (directly or through another such class), with the
    methods it defines (issue 50 counts them all: a renamed replacement such as _take_group_blocks for _take_blocks
    overrides as surely as a same-named one)."""
    import ast
    classes = {}
    for path in sorted(Path(root).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                methods = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                classes[node.name] = (bases, methods)
    subclasses, grew = {"KVCacheManager"}, True
    while grew:
        grew = False
        for name, (bases, _) in classes.items():
            if name not in subclasses and bases & subclasses:
                subclasses.add(name)
                grew = True
    return {name: classes[name][1] for name in subclasses - {"KVCacheManager"}}


def test_one_manager_over_the_groups_no_subclass_defines_more_than_five_methods(tmp_path):
    """Issue 50: a plain model and a grouped one go through the same manager; any subclass of it stays small."""
    import engine
    root = Path(engine.__file__).parent
    found = manager_subclass_methods(root)
    assert all(len(methods) <= 5 for methods in found.values()), found
    # the scan sees a subclass, and one through another subclass, and names what each defines
    fake = tmp_path / "engine"
    fake.mkdir()
    names = ("admit", "commit", "fork", "free", "preempt", "x")
    methods = "".join(f"    def {m}(self):\n        pass\n" for m in names)
    (fake / "sub.py").write_text(f"class A(KVCacheManager):\n    pass\nclass B(A):\n{methods}\nclass C:\n    pass\n")
    assert manager_subclass_methods(fake) == {"A": set(), "B": {"admit", "commit", "fork", "free", "preempt", "x"}}
