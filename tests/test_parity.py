"""The engine's paged decode equals transformers' greedy generate on the same tiny checkpoints."""
import pytest
import torch
import transformers

from engine import Engine, EngineConfig

PROMPTS = [[5, 17, 90, 33, 2, 71, 8], [41, 3], [9, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 1]]
NEW_TOKENS = 12


def _save(tmp_path_factory, arch: str):
    torch.manual_seed(0)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval()
    path = tmp_path_factory.mktemp(arch)
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return _save(tmp_path_factory, request.param)


def _hf_greedy(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("decode_path", ["sdpa", "cross_head"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers(checkpoint, block_size, decode_path, monkeypatch):
    """Both decode attention paths (engine.attention picks one per group: by context length and thread count), so
    a one-thread machine still checks the one it would not pick."""
    from engine import attention
    monkeypatch.setattr(attention.eager, "_use_cross_head", lambda *args: decode_path == "cross_head")
    model, path = checkpoint
    expected = [_hf_greedy(model, p) for p in PROMPTS]
    eng = Engine(EngineConfig(model=str(path), block_size=block_size, num_blocks=256))
    assert eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected


def test_prefill_logits_match(checkpoint):
    model, path = checkpoint
    eng = Engine(EngineConfig(model=str(path), block_size=4, num_blocks=64))
    prompt = PROMPTS[2]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
        dense = eng.model.forward_dense(torch.tensor([prompt]))[0]
    assert torch.allclose(dense, ref, atol=1e-4)
    # the paged path: prefill through block tables, read back the logits of every position
    from engine.attention import attend_batch
    from engine.model.causal_lm import BatchMetadata
    table = torch.tensor([7, 2, 9, 0, 5], dtype=torch.int64)  # a deliberately scattered layout
    slots = torch.tensor([int(table[p // 4]) * 4 + p % 4 for p in range(len(prompt))])
    meta = BatchMetadata(slots, 0, None, [(0, len(prompt), table, 0)])
    with torch.inference_mode():
        hidden = eng.model(torch.tensor(prompt), torch.arange(len(prompt)), meta, eng.kv.layers, attend_batch)
        paged = eng.model.compute_logits(hidden)
    assert torch.allclose(paged, ref, atol=1e-4)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers_through_panels_and_the_one_call_decode_step(checkpoint, block_size, monkeypatch):
    """The same where the weights do not fit in the last-level cache (here the cache is said to be 1 KiB): panels for
    1-16 rows, and decode steps in one native call. Qwen2's q/k/v biases go through the panel kernel. (The tests
    above take the path of a model that fits: panels and the one-call step for 1-64 rows.)"""
    from engine import native
    monkeypatch.setattr(native, "last_level_cache_bytes", lambda *a: 1 << 10)
    calls = []
    stack = native.decode_stack
    monkeypatch.setattr(native, "decode_stack", lambda x, *a: calls.append(x.shape[0]) or stack(x, *a))
    model, path = checkpoint
    expected = [_hf_greedy(model, p) for p in PROMPTS]
    eng = Engine(EngineConfig(model=str(path), block_size=block_size, num_blocks=256))
    assert eng.model.stack is not None
    assert eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
    assert calls and max(calls) == len(PROMPTS)


# ---- sliding windows: a sliding-only Mistral, mixed Qwen2 and Qwen3 (KV cache groups) ----------------------------
WINDOW = 8
WINDOW_PROMPTS = [[5, 17, 90, 33, 2, 71, 8, 9, 10, 11, 12, 13], [41, 3],
                  [9, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 1]]
WINDOW_NEW_TOKENS = 20  # prompts and outputs longer than the window


def _save_windowed(tmp_path_factory, arch: str, window: int | None = WINDOW):
    torch.manual_seed(1)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)
    if arch == "mistral":  # a window on every layer
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=window))
    elif arch == "qwen2":  # layers >= max_window_layers slide
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            **common, use_sliding_window=window is not None, sliding_window=window, max_window_layers=1,
            tie_word_embeddings=True))
    else:  # Qwen3: layer_types, and q/k RMSNorm per head (given weights that matter)
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, head_dim=16, use_sliding_window=window is not None, sliding_window=window,
            layer_types=["sliding_attention" if window else "full_attention", "full_attention",
                         "sliding_attention" if window else "full_attention"]))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    with torch.no_grad():  # weights large enough that the tokens vary and depend on what each layer reads
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.mul_(10)
    model.eval()
    path = tmp_path_factory.mktemp(f"{arch}-window")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


@pytest.fixture(scope="module", params=["mistral", "qwen2", "qwen3"])
def windowed(request, tmp_path_factory):
    model, path = _save_windowed(tmp_path_factory, request.param)
    expected = [_hf_greedy_n(model, p, WINDOW_NEW_TOKENS) for p in WINDOW_PROMPTS]
    return request.param, model, path, expected


def _hf_greedy_n(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_the_window_changes_transformers_output(windowed, tmp_path_factory):
    """The references below are worth something only if the window changes the tokens."""
    arch, _, _, expected = windowed
    unwindowed, _ = _save_windowed(tmp_path_factory, arch, window=None)
    assert [_hf_greedy_n(unwindowed, p, WINDOW_NEW_TOKENS) for p in WINDOW_PROMPTS] != expected


@pytest.mark.parametrize("decode_path", ["native", "eager"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_windowed_greedy_matches_transformers(windowed, block_size, decode_path):
    from engine import attention
    arch, _, path, expected = windowed
    previous = attention.use_native_kernel(decode_path == "native")
    try:
        eng = Engine(EngineConfig(model=str(path), block_size=block_size, num_blocks=256))
        assert eng.generate(WINDOW_PROMPTS, max_new_tokens=WINDOW_NEW_TOKENS) == expected
    finally:
        attention.use_native_kernel(previous)
    assert eng.kv_cache_groups[-1].sliding_window == WINDOW
    assert eng.manager.num_window_releases > 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_windowed_greedy_with_preemption_and_relocation(windowed, block_size):
    """A pool too small for all three at once (recompute preemption), every block relocated mid-generation."""
    arch, _, path, expected = windowed
    probe = Engine(EngineConfig(model=str(path), block_size=block_size, num_blocks=2))
    peak = probe.manager.peak_blocks(40, 8)  # the longest conversation's most blocks at once (every group)
    eng = Engine(EngineConfig(model=str(path), block_size=block_size, num_blocks=peak + 1,
                              max_num_batched_tokens=8, max_num_seqs=4))
    ids = [eng.add_conversation(prompt_token_ids=p, max_new_tokens=WINDOW_NEW_TOKENS, ignore_eos=True)
           for p in WINDOW_PROMPTS]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps in (5, 17):
            eng.relocate_blocks(seed=steps)
        eng.check_invariants()
    assert eng.scheduler.num_preemptions > 0
    assert [list(eng.conversation(i).output_token_ids) for i in ids] == expected
